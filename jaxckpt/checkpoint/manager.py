"""The checkpoint manager: async saves, atomic commits, retention, restore.

    with CheckpointManager('/ckpt', CheckpointOptions(keep=3)) as mgr:
      for step in range(start, steps):
        state = train_step(state, batch)
        if mgr.should_save(step + 1):
          mgr.save(step + 1, state, run_state={'data_position': step + 1})
    state, run_state = mgr.restore(mgr.latest_step(), target=abstract_state)

`save` returns once the state is copied to host memory and the run state and metadata it was
handed are serialized: whatever the caller mutates afterwards, the checkpoint holds the values of
the call. Writing, fsyncing, committing and deleting old checkpoints run on one background thread. One save is in flight at a time: the next
`save` waits for the previous one. An error in the background is stored and raised in the caller's
thread by the next `save`, `wait_until_finished` or `close`; the checkpoint it was writing is never
committed. The manager does not import the trainer: any pytree of arrays can be saved.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxckpt.checkpoint import layout, manifest, rawstore
from jaxckpt.checkpoint.policy import RetentionPolicy, SavePolicy
from jaxckpt.checkpoint.staging import HostStager
from jaxckpt.errors import CheckpointError, JaxckptError, UsageError

MODES = ('auto', 'async', 'sync')
RAW_DATA = f'{layout.STATE_DIR}/{rawstore.DATA}'  # the raw store's data file, in a manifest
STORAGES = ('auto', 'raw', 'orbax')

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """How and when a manager saves. Zero turns a cadence or retention rule off."""
  every_steps: int = 0          # save when step % every_steps == 0
  every_secs: float = 0.0       # save when this many seconds passed since the last save
  mode: str = 'auto'            # async: stage then write in the background; sync: write inline;
                                # auto: async when host memory has room for a staged copy, else
                                # write inline from the arrays themselves (no staged copy)
  keep: int = 3                 # newest checkpoints kept (0 keeps all)
  keep_every: int = 0           # steps divisible by this are kept forever
  verify_checksums: bool = True  # check every file's CRC before restoring it
  storage: str = 'auto'         # raw: jaxckpt's flat file; orbax: tensorstore; auto: raw when
                                # one process holds every array, orbax across processes

  def __post_init__(self):
    if self.mode not in MODES:
      raise UsageError('E-CONFIG-004', f'checkpoint mode {self.mode!r} is not one of {MODES}',
                       'use --checkpoint_mode=auto|async|sync')
    if self.storage not in STORAGES:
      raise UsageError('E-CONFIG-004', f'checkpoint storage {self.storage!r} is not one of '
                       f'{STORAGES}', 'use auto, raw or orbax')
    for field in ('every_steps', 'every_secs', 'keep', 'keep_every'):
      if getattr(self, field) < 0:
        raise UsageError('E-CONFIG-004', f'checkpoint {field}={getattr(self, field)} is negative',
                         'use 0 to turn it off')


@dataclasses.dataclass(frozen=True)
class CommitInfo:
  """What one committed save cost; handed to `on_commit` callbacks."""
  step: int
  path: Path
  bytes: int
  seconds_blocked: float    # the caller's wait: previous save + device->host copy
  seconds_to_commit: float  # from the call of save() to the manifest being durable
  deleted: tuple[int, ...]  # older steps removed by retention after this commit
  # Older steps retention could not remove, with why ('step 100: PermissionError: ...'). The
  # commit stands; the next commit tries again, and the next writer's start removes half-deleted
  # ones as debris.
  retention_errors: tuple[str, ...] = ()
  # The host copy that was just written, by leaf name ('params/h/0/attn/c_attn/kernel', ...).
  # IMPORTANT: valid only until the next save starts (it reuses these buffers). The next save
  # waits for the callback, so reading them inside it (e.g. to export) is safe; keep no reference.
  staged: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)


def leaf_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator='/')


def named_leaves(tree) -> dict[str, Any]:
  """{'params/h/0/attn/c_attn/kernel': leaf, ...} in tree order."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  names = _NAMES.get(treedef)
  if names is None:
    # Building 449 path strings costs ~1 ms, on every save; a tree structure's names never change.
    if len(_NAMES) >= 64:
      _NAMES.clear()
    names = _NAMES[treedef] = tuple(
        leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
  return dict(zip(names, leaves))


_NAMES: dict[Any, tuple[str, ...]] = {}


def avals(leaves: Mapping[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
  """{name: (shape, dtype, sharding)}: what `tensor_table` needs, without holding the arrays."""
  return {n: (np.shape(x), x.dtype, getattr(x, 'sharding', None)) for n, x in leaves.items()}


def tensor_table(avals: Mapping[str, tuple[Any, Any, Any]]) -> list[dict[str, Any]]:
  """The manifest's tensor list: name, shape, dtype and partition spec of each leaf."""
  return [{'name': n, 'shape': list(shape), 'dtype': str(np.dtype(dtype)),
           'spec': _spec(sharding)} for n, (shape, dtype, sharding) in avals.items()]


def _spec(sharding) -> str | None:
  spec = getattr(sharding, 'spec', None)
  return None if spec is None else str(tuple(spec))


def available_host_memory(meminfo: str = '/proc/meminfo') -> int | None:
  """Bytes the kernel can hand out without swapping (`MemAvailable`: free memory plus the page
  cache it can reclaim); None where that is not known.

  Free pages alone (`SC_AVPHYS_PAGES`) shrink as the page cache fills with checkpoint data the
  kernel would drop at once, and would push `auto` to sync for no reason.
  """
  try:
    with open(meminfo) as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def choose_mode(mode: str, needed: int, available: int | None) -> str:
  """The mode of one save: `auto` is async when the staged copy's `needed` new bytes fit twice
  into `available` host memory (the copy, and headroom for the training step that runs beside
  the write), else sync; unknown memory counts as room."""
  if mode != 'auto':
    return mode
  return 'async' if available is None or available > 2 * needed else 'sync'


class _Unstaged(Mapping[str, np.ndarray]):
  """Leaves read as host arrays one at a time, when a save writes inline without a staged copy
  (`auto` short of memory): on CPU `np.asarray` shares the device buffer, on an accelerator each
  leaf is fetched when the writer reaches it."""

  def __init__(self, leaves: Mapping[str, Any]):
    self._leaves = leaves

  def __getitem__(self, name: str) -> np.ndarray:
    return np.asarray(self._leaves[name])

  def __iter__(self):
    return iter(self._leaves)

  def __len__(self) -> int:
    return len(self._leaves)


class CheckpointManager:
  """Saves and restores checkpoints of one run under `directory`.

  Args:
    directory: where `step_<n>/` directories live; created if missing.
    options: cadence, mode and retention.
    clock: seconds as a float; injected by tests for time-based cadence.
    on_commit: called (on the background thread) with a `CommitInfo` after each commit.
    writer: False for readers (evaluators, inspection): they never create, clean or delete.
  """

  def __init__(self, directory: str | os.PathLike, options: CheckpointOptions | None = None, *,
               clock: Callable[[], float] = time.monotonic,
               on_commit: Callable[[CommitInfo], None] | None = None, writer: bool = True):
    self.directory = Path(directory).absolute()  # orbax wants absolute paths
    self.options = options or CheckpointOptions()
    self._clock = clock
    self._on_commit = on_commit
    self._writer = writer
    self._save_policy = SavePolicy(self.options.every_steps, self.options.every_secs)
    self._retention = RetentionPolicy(self.options.keep, self.options.keep_every)
    self._stager = HostStager()
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self._pending: concurrent.futures.Future | None = None
    self._lock = threading.Lock()
    self._last_save_step = -1
    self._last_save_time = clock()
    self.removed_debris: list[Path] = []
    self.mode_used: str | None = None  # the mode the last save ran in ('async' or 'sync')
    if writer:
      self.directory.mkdir(parents=True, exist_ok=True)
      self.removed_debris = layout.remove_debris(self.directory)
      steps = list(layout.committed_steps(self.directory))
      self._last_save_step = steps[-1] if steps else -1

  # ----------------------------------------------------------------------------- discovery
  def all_steps(self) -> list[int]:
    return list(layout.committed_steps(self.directory))

  def latest_step(self) -> int | None:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_dir(self, step: int) -> Path:
    return self.directory / layout.step_dirname(step)

  # ------------------------------------------------------------------------------- saving
  def should_save(self, step: int) -> bool:
    """Whether the cadence asks for a checkpoint of `step` now (the caller adds the last step)."""
    return self._save_policy.due(step, self._clock(), self._last_save_step, self._last_save_time)

  def continue_from(self, step: int) -> None:
    """Training (re)starts at `step`: the cadence counts from there.

    Without this the cadence counts from the newest committed step. A run that continues from an
    older checkpoint (an explicit one, or `latest` passing over a damaged newer one) replays
    steps that may have checkpoints of an earlier history; they are saved again as the run
    passes them, each replacing the old one atomically (see `save`).
    """
    self._last_save_step, self._last_save_time = step, self._clock()

  def _mode(self, leaves: Mapping[str, Any]) -> str:
    """This save's mode, decided before any host memory is allocated for it."""
    if self.options.mode != 'auto':
      return self.options.mode
    needed = sum(int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
                 for x in leaves.values())
    return choose_mode('auto', max(0, needed - self._stager.nbytes()), available_host_memory())

  def save(self, step: int, state: Any, run_state: Mapping[str, Any] | None = None, *,
           metadata: Mapping[str, Any] | None = None,
           exclude: Callable[[str], bool] | None = None) -> None:
    """Checkpoint `state` (any pytree of arrays) as `step`.

    Blocks while the previous save finishes and `state` is copied to host memory; the write
    continues in the background (or inline in sync mode). `run_state` is JSON (counters, data
    position, RNG); `metadata` is added to the manifest (identity, config, ...). Both are
    serialized before `save` returns, so the checkpoint holds their values at the call even when
    the caller changes them while the write runs.

    A step that already has a committed checkpoint (a replay after resuming from an older one)
    is replaced atomically: the new checkpoint is completed, manifest included, under its
    temporary name and swapped with the old one in a single `renameat2(RENAME_EXCHANGE)`, so a
    crash at any moment leaves one intact version of the step.

    `exclude` leaves tensors out: a predicate on `named_leaves` names. They are neither copied nor
    written; the manifest lists them under `excluded` (name, shape, dtype, spec), not under
    `tensors`, and the caller restores them from elsewhere (`restore` a target without them).
    """
    if not self._writer:
      raise CheckpointError('E-CKPT-008', 'this manager was opened read-only', 'open a writer')
    t0 = time.perf_counter()
    self.wait_until_finished()
    leaves = named_leaves(state)
    left_out = {}
    if exclude is not None:
      left_out = {n: x for n, x in leaves.items() if exclude(n)}
      leaves = {n: x for n, x in leaves.items() if n not in left_out}
    # Captured now, as bytes and a private copy: the caller's dicts and lists may change while
    # the write runs (a bandit's pulls, counters), and a non-JSON value fails here, in its thread.
    run_state_json = _json_bytes({'step': step, **(run_state or {})})
    metadata = json.loads(_json_bytes(dict(metadata or {})))
    # The tensor tables are formatted by the writer: the caller only waits for the host copy (the
    # arrays themselves may be donated to the next train step by then).
    shapes = (avals(leaves), avals(left_out))
    self.mode_used = mode = self._mode(leaves)
    if mode == 'sync' and self.options.mode == 'auto':
      self._stager.release()  # short of memory: write from the arrays, hold no staged copy
      staged = _Unstaged(leaves)
    else:
      staged = self._stager.stage(leaves)
    blocked = time.perf_counter() - t0
    self._last_save_step, self._last_save_time = step, self._clock()
    job = (step, staged, shapes, run_state_json, metadata, t0, blocked)
    if mode == 'sync':
      self._write(*job)
      return
    if self._executor is None:
      self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='jaxckpt-save')
    self._pending = self._executor.submit(self._write, *job)

  def wait_until_finished(self) -> None:
    """Wait for the save in flight; raise its error here if it failed."""
    with self._lock:
      pending, self._pending = self._pending, None
    if pending is not None:
      pending.result()

  def close(self) -> None:
    try:
      self.wait_until_finished()
    finally:
      if self._executor is not None:
        self._executor.shutdown(wait=True)
        self._executor = None
      self._stager.close()

  def __enter__(self) -> 'CheckpointManager':
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _write(self, step, staged, shapes, run_state_json, metadata, t0, blocked) -> None:
    tmp = layout.temporary_dir(self.directory, step)
    try:
      saved, left_out = shapes
      table = tensor_table(saved)
      if left_out:
        metadata['excluded'] = tensor_table(left_out)
      tmp.mkdir(parents=False)
      storage = self._storage()
      known = {}
      if storage == 'raw':
        known = {f'{layout.STATE_DIR}/{k}': v
                 for k, v in rawstore.write(tmp / layout.STATE_DIR, staged).items()}
      else:
        _checkpointer().save(tmp / layout.STATE_DIR, args=ocp.args.PyTreeSave(dict(staged)))
      metadata = {**metadata, 'storage': storage}
      layout.write_file_durably(tmp / layout.RUN_STATE, run_state_json)
      files = manifest.file_table(tmp, known=known)
      sealed = manifest.sealed_json(manifest.build(step, files, table, metadata))
      final = self.step_dir(step)
      if final.exists():
        _replace(tmp, final, sealed)  # an earlier history reached this step too
      else:
        os.rename(tmp, final)
        layout.fsync_dir(self.directory)
        layout.write_file_durably(final / layout.MANIFEST, sealed)  # the commit
      committed = time.perf_counter()
    except BaseException as e:
      shutil.rmtree(tmp, ignore_errors=True)
      last = layout.committed_steps(self.directory) if self.directory.is_dir() else {}
      intact = f'the last committed checkpoint (step {max(last)}) is intact' if last else \
          'no earlier checkpoint exists'
      raise CheckpointError('E-CKPT-001', f'writing checkpoint step {step} under '
                            f'{self.directory} failed: {type(e).__name__}: {e}',
                            f'nothing was committed for step {step}; {intact}') from e
    deleted, retention_errors = self._apply_retention()
    if self._on_commit is None:
      return
    info = CommitInfo(step, final, sum(f['size'] for f in files.values()), blocked,
                      committed - t0, tuple(deleted), tuple(retention_errors), staged=staged)
    try:
      self._on_commit(info)
    except JaxckptError:
      raise  # already says what failed and what is intact (e.g. an export)
    except Exception as e:
      raise CheckpointError('E-CKPT-009', f'the on_commit callback after checkpoint step {step} '
                            f'failed: {type(e).__name__}: {e}',
                            f'checkpoint step {step} is committed and intact') from e

  def _storage(self) -> str:
    if self.options.storage != 'auto':
      return self.options.storage
    return 'raw' if jax.process_count() == 1 else 'orbax'

  def _apply_retention(self) -> tuple[list[int], list[str]]:
    """Delete what retention lets go; only ever called right after a commit.

    Returns (deleted steps, problems). A step that cannot be removed is a warning, not a failed
    save: the checkpoint just committed is intact, and the next commit tries again.
    """
    deleted, problems = [], []
    try:
      committed = layout.committed_steps(self.directory)
      for step in self._retention.to_delete(committed):
        try:
          # Rename first so a half-deleted directory never looks like a checkpoint.
          gone = layout.deleting_dir(self.directory, step)
          os.rename(committed[step], gone)
          deleted.append(step)
          shutil.rmtree(gone)
        except OSError as e:
          problems.append(f'step {step}: {type(e).__name__}: {e}')
      if deleted:
        layout.fsync_dir(self.directory)
    except Exception as e:  # listing or fsync failed: the commit before it stands all the same
      problems.append(f'{type(e).__name__}: {e}')
    for problem in problems:
      _log.warning('retention under %s could not delete %s', self.directory, problem)
    return deleted, problems

  # ----------------------------------------------------------------------------- restoring
  def read_manifest(self, step_or_dir: int | os.PathLike) -> dict[str, Any]:
    return manifest.read(self._resolve(step_or_dir))

  def read_run_state(self, step_or_dir: int | os.PathLike) -> dict[str, Any]:
    return layout.read_json(self._resolve(step_or_dir) / layout.RUN_STATE)

  def _resolve(self, step_or_dir) -> Path:
    if isinstance(step_or_dir, (int, np.integer)):
      return self.step_dir(int(step_or_dir))
    return Path(step_or_dir)

  def verify(self, step_or_dir, *, checksums: bool | None = None) -> list[str]:
    """Problems of a checkpoint ([] when intact): the ones `jaxckpt verify` reports, its
    manifest's own checksum included. Damage is returned, never raised."""
    checksums = self.options.verify_checksums if checksums is None else checksums
    return manifest.check(self._resolve(step_or_dir), checksums=checksums)[1]

  def restore(self, step_or_dir: int | os.PathLike, target: Any, *,
              only: Callable[[str], bool] | None = None,
              verify: bool = True) -> tuple[Any, dict[str, Any]]:
    """Load a committed checkpoint into the structure, shapes, dtypes and shardings of `target`.

    `target` is a pytree of `jax.ShapeDtypeStruct` (with `sharding`) or of arrays. Arrays are
    placed on the target's shardings, whatever mesh wrote them. Returns (state, run_state).

    `only` restores a subset: a predicate on saved tensor names (`named_leaves` names); only the
    tensors it accepts are compared with `target` and read, the others are never touched. An
    evaluator reads the weights alone with
    `restore(step, {'params': abstract.params}, only=lambda n: n.startswith('params/'))`.

    `verify=False` skips checking the files against the manifest, for a caller that just did.
    """
    step_dir = self._resolve(step_or_dir)
    meta = manifest.read(step_dir)
    raw = meta.get('storage') == 'raw'
    checksums = verify and self.options.verify_checksums
    if verify:
      # The raw data file's CRC is checked while it is read below (array by array when `only`
      # picks a subset): one pass over the data, not two.
      _, problems = manifest.check(step_dir, meta, checksums=checksums,
                                   skip_checksum=[RAW_DATA] if raw else [])
      if problems:
        raise CheckpointError('E-CKPT-003', f'{step_dir} is damaged: {problems[0]}'
                              + (f' (+{len(problems) - 1} more)' if len(problems) > 1 else ''),
                              'resume from an earlier checkpoint')
    want = named_leaves(target)
    saved = {t['name']: t for t in meta['tensors'] if only is None or only(t['name'])}
    _check_compatible(step_dir, saved, want)
    if raw:
      def place(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        # Each run of arrays as soon as it is read, overlapping the next reads; one batched call
        # per run (andrea_12m's 233 leaves: 6 ms batched, 9 ms one device_put per leaf).
        return dict(zip(arrays, jax.device_put(list(arrays.values()),
                                               [want[n].sharding for n in arrays])))

      restored = rawstore.read(
          step_dir / layout.STATE_DIR, list(want), place=place,
          expect_crc32=meta['files'][RAW_DATA]['crc32'] if checksums else None,
          direct=verify)  # unverified: the caller's check just read the file
    else:
      restored = _orbax_restore(step_dir, want, partial=only is not None)
    leaves = [restored[n] for n in want]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)
    return state, layout.read_json(step_dir / layout.RUN_STATE)


def _json_bytes(obj: Any) -> bytes:
  try:
    return (json.dumps(obj, indent=1) + '\n').encode()
  except (TypeError, ValueError) as e:
    raise CheckpointError('E-CKPT-011', f'run_state and metadata must be JSON: {e}',
                          'pass plain dicts, lists, strings and numbers') from e


def _replace(tmp: Path, final: Path, sealed: bytes) -> None:
  """Commit `tmp` as `final` where `final` is already a checkpoint, never leaving neither.

  The manifest goes into `tmp` first, so `tmp` is a complete checkpoint under a temporary name
  (debris to any reader); one exchange then swaps the two names. Before it the old checkpoint is
  in place, after it the new one, and the old one, now under the temporary name, is removed.
  """
  layout.write_file_durably(tmp / layout.MANIFEST, sealed)
  if not layout.exchange(tmp, final):
    # No RENAME_EXCHANGE here (not Linux, or a filesystem without it): two renames, with a
    # window in which a crash leaves this step only as debris. Older steps are untouched.
    aside = layout.deleting_dir(final.parent, int(final.name.split('_')[1]))
    os.rename(final, aside)
    os.rename(tmp, final)
    tmp = aside
  layout.fsync_dir(final.parent)
  shutil.rmtree(tmp, ignore_errors=True)


def read_host_arrays(step_dir: os.PathLike) -> dict[str, np.ndarray]:
  """Every array of a committed checkpoint as host numpy, whatever wrote it; no devices used.

  Raw-store data is checked against the manifest's CRC as it is read (E-CKPT-003 on a mismatch),
  so a caller verifying the other files can skip `RAW_DATA`: one pass over it.
  """
  step_dir = Path(step_dir).absolute()
  meta = manifest.read(step_dir)
  if meta.get('storage') == 'raw':
    return rawstore.read(step_dir / layout.STATE_DIR,
                         expect_crc32=meta['files'][RAW_DATA]['crc32'])
  args = {t['name']: ocp.RestoreArgs(restore_type=np.ndarray) for t in meta['tensors']}
  restored = _checkpointer().restore(step_dir / layout.STATE_DIR,
                                     args=ocp.args.PyTreeRestore(restore_args=args))
  return {k: np.asarray(v) for k, v in restored.items()}


def _orbax_restore(step_dir: Path, want: Mapping[str, Any], *, partial: bool) -> dict[str, Any]:
  item = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for n, x in want.items()}
  restore_args = {n: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                          dtype=x.dtype) for n, x in want.items()}
  return _checkpointer().restore(step_dir / layout.STATE_DIR, args=ocp.args.PyTreeRestore(
      item=item, restore_args=restore_args, partial_restore=partial))


def _check_compatible(step_dir: Path, saved: Mapping[str, Any], want: Mapping[str, Any]) -> None:
  new, gone = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
  if new or gone:
    raise CheckpointError('E-PARAM-001', f'{step_dir} does not fit this model: '
                          + '; '.join(filter(None, [f'new {new[:5]}' if new else '',
                                                   f'gone {gone[:5]}' if gone else ''])),
                          'resume with the config that wrote it, or start a new workdir')
  for name, x in want.items():
    s = saved[name]
    if tuple(s['shape']) != tuple(x.shape) or s['dtype'] != str(np.dtype(x.dtype)):
      raise CheckpointError('E-PARAM-002', f'{name}: checkpoint has {s["dtype"]}{s["shape"]}, '
                            f'model wants {np.dtype(x.dtype)}{list(x.shape)}',
                            'resume with the config that wrote it, or start a new workdir')


def _checkpointer() -> ocp.Checkpointer:
  # zstd costs ~35% of save time on incompressible weights and saves almost nothing: off.
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
