"""A committed checkpoint's arrays read onto their target shardings, whatever mesh wrote them.

- Across processes, or from several state files: each process reads the byte ranges of its
  own shards (`multihost.restore`); given something to do `meanwhile`, on a thread of its own
  while the caller does it, then the caller places them.
- One safetensors file: read in runs of tensors, each run placed on the devices as soon as it is
  read, overlapping the next reads. Or, given something to do `meanwhile` (the caller's compile of
  its first step), read on a thread of its own while the caller does it, and placed by the caller
  once it is done, as the rest lands: the read and its page faults cost the start nothing when
  the compile is longer.
- Orbax: tensorstore reads what each device needs.
"""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from . import beside, layout, manifest, multihost, orbaxstore, shardtable
from .errors import CheckpointError
from .formats import SAFETENSORS, data_file, read_state_file


def audit(step_dir: Path, meta: Mapping[str, Any], want: Mapping[str, Any],
          shards: shardtable.Table | None, *, checksums: bool) -> None:
  """E-CKPT-003 unless the checkpoint's files match its manifest, before a restore reads them.
  The state files' CRCs are checked while they are read (tensor by tensor when a subset is
  read, shard by shard across processes): one pass over the data, not two. Across processes, a
  file holding none of this process's shards may be on another disk."""
  single = data_file(meta)
  read_later = [single] if single else multihost.state_files(meta) + [shardtable.SHARDS]
  _, problems = manifest.audit(
      step_dir,
      meta,
      checksums=checksums,
      skip_checksum=read_later,
      absent_ok=() if shards is None else multihost.unread(meta, want, shards))
  if problems:
    raise CheckpointError(
        'E-CKPT-003', f'{step_dir} is damaged: {problems[0]}' +
        (f' (+{len(problems) - 1} more)' if len(problems) > 1 else ''),
        'resume from an earlier checkpoint')


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
  return shardtable.shard_table(step_dir, meta, single)


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
  state files, are read on another (see the module's docstring); before the read from orbax."""
  single = data_file(meta)
  if shards is not None:
    if meanwhile is None:
      return multihost.restore(step_dir, shards, want, checksums=checksums)
    held = multihost.held_boxes(want)  # this process's byte ranges, read beside `meanwhile`
    boxes = beside.beside(
        lambda: multihost.read_boxes(step_dir, shards, held, checksums=checksums),
        meanwhile,
        _stuck(step_dir, multihost.read_bound(shards, held)),
        name=READER)
    return multihost.place(want, boxes)
  if not single:
    if meanwhile is not None:
      meanwhile()  # tensorstore reads what each device needs: on this thread, after it
    return orbaxstore.restore(step_dir / layout.STATE_DIR, want, partial=partial)

  def place(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    # One batched call per run (andrea_12m's 233 leaves: 6 ms batched, 9 ms one device_put
    # per leaf).
    return dict(
        zip(arrays, jax.device_put(list(arrays.values()), [want[n].sharding for n in arrays])))

  if meanwhile is None:
    return read_state_file(
        step_dir, meta, list(want), checksums=checksums, place=place, direct=verify)
  path = step_dir / single
  stuck = _stuck(path, meta['files'][single]['size'])

  # The reader hands each batch of tensors over as it lands; once `meanwhile` returns, this
  # thread places them as they come (a host-to-device copy beside the rest of the read).
  landed: queue.SimpleQueue = queue.SimpleQueue()
  placed: dict[str, jax.Array] = {}

  def take(seconds: float) -> None:
    try:
      placed.update(place(landed.get(timeout=seconds)))
    except queue.Empty:
      pass

  beside.beside(
      lambda: read_state_file(
          step_dir,
          meta,
          list(want),
          checksums=checksums,
          place=lambda a: landed.put(a) or {},
          direct=verify),
      meanwhile,
      stuck,
      name=READER,
      between=take)
  while not landed.empty():  # what landed after the last look
    take(0)
  return placed


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
