"""A committed checkpoint's arrays read onto their target shardings, whatever mesh wrote them.

- Across processes, or from several state files: each process reads the byte ranges of its
  own shards a window of arrays at a time and places each window before it reads the next
  (`boxrestore.restore`).
- One safetensors file: read in windows of tensors, each placed on the devices as soon as it is
  read, overlapping the next reads.
- Given something to do `meanwhile` (the caller's compile of its first step), either of those
  runs on a thread of its own while the caller does it, placing as it goes: the read and its
  page faults cost the start nothing when the compile is longer, and the host holds a window or
  two of the state, not all of it, while the compile runs.
- Orbax: tensorstore reads what each device needs.

A target leaf without a sharding (a numpy array, a `jax.ShapeDtypeStruct` made without one) is
restored onto the default device (`targets`). A read that fails because a writer's retention
removed the checkpoint meanwhile is E-CKPT-010 (take the newest again), never damage or a raw
OSError (`_unless_removed`): evaluators read the newest checkpoint of a run that keeps deleting
older ones.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import jax
import numpy as np

from . import atomic, beside, boxrestore, layout, manifest, multihost, orbaxstore, shardtable
from .errors import ArgumentError, CheckpointError
from .formats import SAFETENSORS, data_file, read_state_file


def audit(step_dir: Path, meta: Mapping[str, Any], want: Mapping[str, Any],
          shards: shardtable.Table | None, *, checksums: bool) -> None:
  """E-CKPT-003 unless the checkpoint's files match its manifest, before a restore reads them.
  The state files' CRCs are checked while they are read (tensor by tensor when a subset is
  read, shard by shard across processes): one pass over the data, not two. Across processes, a
  file holding none of this process's shards may be on another disk. `want` is `targets`'s
  answer; a checkpoint removed meanwhile is E-CKPT-010."""
  single = data_file(meta)
  read_later = [single] if single else multihost.state_files(meta) + [shardtable.SHARDS]
  _, problems = manifest.audit(
      step_dir,
      meta,
      checksums=checksums,
      skip_checksum=read_later,
      absent_ok=() if shards is None else multihost.unread(meta, want, shards) | _subsets(step_dir))
  if problems:
    if (gone := _gone(step_dir, meta)) is not None:  # retention or a new commit, not damage
      raise gone
    raise CheckpointError(
        'E-CKPT-003', f'{step_dir} is damaged: {problems[0]}' +
        (f' (+{len(problems) - 1} more)' if len(problems) > 1 else ''),
        'resume from an earlier checkpoint')


def _subsets(step_dir: Path) -> set[str]:
  """The parts of which a peer restore left this process the tensors it needs alone (checked
  shard by shard as they are read)."""
  state = step_dir / layout.STATE_DIR
  found = state.glob(f'*{layout.SUBSET}') if state.is_dir() else ()
  return {f'{layout.STATE_DIR}/{p.name[:-len(layout.SUBSET)]}' for p in found}


def shard_rows(step_dir: Path, raw: bytes, meta: Mapping[str, Any], *,
               verify: bool) -> shardtable.Table | None:
  """The shard table of a checkpoint read from several state files (across processes), read
  once for a restore, and only once the manifest (`raw`) matches its seal when `verify`; None
  for a single state file on one process, or orbax."""
  single = data_file(meta)
  if meta.get('storage') != SAFETENSORS or (jax.process_count() == 1 and single):
    return None
  if verify and (problem := manifest.check_seal(raw, meta)):
    raise CheckpointError('E-CKPT-003', f'{step_dir} is damaged: {problem}',
                          'resume from an earlier checkpoint')
  return _unless_removed(step_dir, lambda: shardtable.shard_table(step_dir, meta, single), meta)


def targets(want: Mapping[str, Any]) -> dict[str, Any]:
  """`want` ({name: target leaf}) with a sharding on every leaf: one without (a numpy array, a
  `ShapeDtypeStruct` made without one) is restored onto the default device, `jax.devices()[0]`.
  ArgumentError (E-CKPT-021) naming a leaf that is not an array (no shape and dtype)."""
  out, default = {}, None
  for name, x in want.items():
    if not (hasattr(x, 'shape') and hasattr(x, 'dtype')):
      raise ArgumentError(
          'E-CKPT-021', f'restore target leaf {name!r} is a {type(x).__name__}, not an array',
          'pass arrays or jax.ShapeDtypeStructs (with a sharding, else the default device)')
    if getattr(x, 'sharding', None) is None:
      default = default or jax.sharding.SingleDeviceSharding(jax.devices()[0])
      x = jax.ShapeDtypeStruct(tuple(np.shape(x)), np.dtype(x.dtype), sharding=default)
    out[name] = x
  return out


def manifest_bytes(step_dir: Path) -> tuple[bytes, dict[str, Any]]:
  """`manifest.read_bytes` for a restore: E-CKPT-010 when the checkpoint was removed since it
  was found (a writer's retention)."""
  return _unless_removed(step_dir, lambda: manifest.read_bytes(step_dir))


def read_run_state(step_dir: Path) -> dict[str, Any]:
  """The run state a restore returns: E-CKPT-010 when the checkpoint was removed while it was
  read (a writer's retention), E-CKPT-004 when the file is missing from one still there."""
  return _unless_removed(step_dir, lambda: atomic.read_json(step_dir / layout.RUN_STATE))


def removed(step_dir: Path) -> bool:
  """Whether `step_dir` is gone: retention (and `jaxckpt delete`) renames a checkpoint to
  `.deleting-*` before it deletes it. A directory still there without its manifest is not
  removed but damaged, or never committed: its own error stands."""
  return not step_dir.is_dir()


def _removed(step_dir: Path) -> ArgumentError:
  return ArgumentError(
      'E-CKPT-010', f'{step_dir} was removed while being read (retention: a writer deletes '
      'older checkpoints after each commit)', 'take the newest again (latest_step())')


def _gone(step_dir: Path, meta: Mapping[str, Any] | None) -> ArgumentError | None:
  """E-CKPT-010 when `step_dir` was removed, or (given the manifest it was read with, `meta`)
  replaced by another commit of its step (a run that went back saved it again); else None."""
  if removed(step_dir):
    return _removed(step_dir)
  seal = (meta or {}).get(manifest.SEAL)
  try:
    now = manifest.seal_of((step_dir / layout.MANIFEST).read_bytes()) if seal else seal
  except OSError:
    return None
  if now == seal:
    return None
  return ArgumentError(
      'E-CKPT-010', f'{step_dir} was replaced by another commit of its step while being read '
      f'(manifest seal {seal}, now {now})', 'restore it again')


T = TypeVar('T')


def _unless_removed(step_dir: Path,
                    read: Callable[[], T],
                    meta: Mapping[str, Any] | None = None) -> T:
  """`read()`, whose failure once `step_dir` is gone, or (given `meta`, the manifest read)
  replaced by another commit, is E-CKPT-010 (whatever the read met: a missing file, a short one,
  a header that vanished, a CRC that no longer matches); a file missing from a checkpoint still
  there is E-CKPT-003. An ArgumentError (a call that cannot work) is raised as it is, and so is
  a device's or the host's memory running out: the reader's own, whatever became of the step."""
  try:
    return read()
  except (ArgumentError, MemoryError):
    raise
  except Exception as e:  # pylint: disable=broad-except  # told apart by the manifest, below
    if isinstance(e, jax.errors.JaxRuntimeError) and 'RESOURCE_EXHAUSTED' in str(e):
      raise
    if (gone := _gone(step_dir, meta)) is not None:
      raise gone from e
    if isinstance(e, FileNotFoundError):
      what = os.path.relpath(os.fsdecode(e.filename), step_dir) if e.filename else str(e)
      raise CheckpointError('E-CKPT-003', f'{step_dir} is damaged: {what}: missing',
                            'resume from an earlier checkpoint') from e
    raise


def read_arrays(step_dir: Path,
                meta: Mapping[str, Any],
                want: Mapping[str, Any],
                *,
                checksums: bool,
                verify: bool,
                partial: bool,
                shards: shardtable.Table | None,
                meanwhile: Callable[[], Any] | None = None) -> dict[str, jax.Array]:
  """{name: array} of the tensors `want` names (each a `ShapeDtypeStruct` with its sharding or
  an array). `verify=False`: the caller's check just read the file (no direct I/O needed).
  `shards`: `shard_rows`'s answer; given, each process reads the byte ranges of its shards.
  `meanwhile` runs on this thread while the state file, or this process's byte ranges of the
  state files, are read and placed on another (see the module's docstring); before the read
  from orbax.
  `want` is `targets`'s answer: every leaf has its sharding."""
  single = data_file(meta)
  if shards is not None:
    held = boxrestore.held_boxes(want)
    read: Callable[[], dict[str, jax.Array]] = lambda: boxrestore.restore(
        step_dir, shards, want, checksums=checksums, held=held)
    nbytes = boxrestore.read_bound(shards, held) if meanwhile else 0
  elif single:

    def place(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
      # One batched call per run (andrea_12m's 233 leaves: 6 ms batched, 9 ms one device_put
      # per leaf).
      return dict(
          zip(arrays, jax.device_put(list(arrays.values()), [want[n].sharding for n in arrays])))

    read = lambda: read_state_file(
        step_dir, meta, list(want), checksums=checksums, place=place, direct=verify)
    nbytes = meta['files'][single]['size']
  else:
    if meanwhile is not None:
      meanwhile()  # tensorstore reads what each device needs: on this thread, after it
    return _unless_removed(
        step_dir, lambda: orbaxstore.restore(step_dir / layout.STATE_DIR, want, partial=partial),
        meta)
  if meanwhile is None:
    return _unless_removed(step_dir, read, meta)
  # Each window is placed as it is read, on the reader's thread: beside a long compile the host
  # holds a window or two, not the state. The caller's `jax.enable_x64(...)`, which holds on its
  # own thread alone, holds on the reader's too: 64-bit arrays stay 64-bit.
  x64 = bool(jax.config.jax_enable_x64)

  def placed() -> dict[str, jax.Array]:
    with jax.enable_x64(x64):
      return _unless_removed(step_dir, read, meta)

  return beside.beside(
      placed, meanwhile, _stuck(step_dir / single if single else step_dir, nbytes), name=READER)


def _stuck(what: Path, nbytes: int) -> Callable[[], CheckpointError | None]:
  """`beside`'s question for a read of `nbytes` from `what`: E-CKPT-017 once it has run READ_WAIT
  seconds (and a second per READ_WAIT_BYTES_PER_SEC) past the return of what ran beside it."""
  limit = READ_WAIT_SECS + nbytes / READ_WAIT_BYTES_PER_SEC
  deadline = []  # set when `meanwhile` returns: the read's time beside it is not counted

  def stuck() -> CheckpointError | None:
    if not deadline:
      deadline.append(time.monotonic() + limit)
    if time.monotonic() < deadline[0]:
      return None
    return CheckpointError(
        'E-CKPT-017', f'reading {what} in the background (thread {READER}) had not finished '
        f'{limit:.0f} s after what ran beside it returned', 'check that disk (a hung mount), then '
        'run the same command again')

  return stuck


READER = 'jaxckpt-restore'
# A read in the background that has not finished after this is stuck (a hung mount): 20 MB/s.
READ_WAIT_SECS, READ_WAIT_BYTES_PER_SEC = 120, 20e6
