"""The checkpoint manager: async saves, atomic commits, retention, restore.

    with CheckpointManager('/ckpt', CheckpointOptions(keep=3)) as mgr:
      for step in range(start, steps):
        state = train_step(state, batch)
        if mgr.should_save(step + 1):
          mgr.save(step + 1, state, run_state={'data_position': step + 1})
    state, run_state = mgr.restore(mgr.latest_step(), target=abstract_state)

`save` returns once the state is copied to host memory and the run state and metadata it was
handed are serialized: whatever the caller mutates afterwards, the checkpoint holds the values of
the call. Writing, fsyncing, committing and deleting old checkpoints run on one background
thread. One save is in flight at a time: the next `save` waits for the previous one. An error in the background is stored and raised in the caller's
thread by the next `save`, `wait_until_finished` or `close` (or returned, at once, by
`take_error`); the checkpoint it was writing is never committed. The manager does not import
the trainer: any pytree of arrays can be saved.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np

from . import (abandoned, atomic, bounded, calls, jobcommit, layout, manifest, multihost,
               orbaxstore, reading, replicas, retention, single_writer)
from .errors import ArgumentError, CheckpointError
from .formats import SAFETENSORS
from .options import CheckpointOptions, CommitInfo
from .policy import RetentionPolicy, SavePolicy
from .staging import (DeviceSnapshot, HostStager, Unstaged, auto_mode, available_host_memory,
                      check_storable, choose_staging)
from .staging import choose_mode  # noqa: F401  # tests import it from here
from .tree import avals, check_fits, named_leaves, tensor_table


class CheckpointManager:
  """Saves and restores checkpoints of one run under `directory`.

  Args:
    directory: where `step_<n>/` directories live; created if missing.
    options: cadence, mode and retention.
    clock: seconds as a float; injected by tests for time-based cadence.
    on_commit: called (on the background thread) with a `CommitInfo` after each commit.
    writer: False for readers (evaluators, inspection): they never create, clean or delete.
  """

  def __init__(self,
               directory: str | os.PathLike,
               options: CheckpointOptions | None = None,
               *,
               clock: Callable[[], float] = time.monotonic,
               on_commit: Callable[[CommitInfo], None] | None = None,
               writer: bool = True):
    self.directory = Path(directory).absolute()  # orbax wants absolute paths
    self.options = options or CheckpointOptions()
    self._clock = clock
    self._on_commit = on_commit
    # Steps retention leaves alone for now: ones a reader still needs (an upload in progress).
    self.held: Callable[[], Iterable[int]] = lambda: ()
    self._writer = writer
    self._save_policy = SavePolicy(self.options.every_steps, self.options.every_secs)
    self._retention = RetentionPolicy(self.options.keep, self.options.keep_every,
                                      self.options.keep_best)
    self._stager = HostStager()
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self._pending: concurrent.futures.Future | None = None
    self._pending_of, self._stuck = (0, 0), None  # its (step, bytes); a `bounded.Stuck` one
    self._lock = threading.Lock()
    self._last_save_step, self._last_save_time, self._in_memory = -1, clock(), {}
    self.removed_debris: list[Path] = []
    self.mode_used: str | None = None  # the mode the last save ran in ('async' or 'sync')
    self.staging_used: str | None = None  # where it staged the state first ('host', 'device')
    # Across processes every one opens its writer, process 0 cleans up, and all save together.
    self._group = multihost.Group(
        self.options.barrier_timeout_secs) if (writer and jax.process_count() > 1) else None
    self._saves, self._held, self._closed = 0, None, False
    if writer:
      layout.check_writable(self.directory)  # here, not at the first save after a run's work

      def tidy():  # the one writer here (`single_writer`), before anything of another's is touched
        self._held = single_writer.hold(self.directory)
        self.removed_debris = layout.remove_debris(self.directory)

      if self._group is None:
        replicas.check(self.options.replicas, 1, False)  # never a silent replicas=N
        tidy()
      else:  # nobody writes before the debris is gone
        replicas.check(self.options.replicas, self._group.count,
                       self._group.open(self.directory, tidy), self._storage())
      steps = list(layout.committed_steps(self.directory))
      self._last_save_step = steps[-1] if steps else -1

  # ----------------------------------------------------------------------------- discovery
  def all_steps(self) -> list[int]:
    return list(layout.committed_steps(self.directory))

  def latest_step(self) -> int | None:
    steps = sorted(set(self.all_steps()) - abandoned.steps(self.directory))
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
    passes them, each replacing the old one atomically (see `save`). Until then none of those
    is the newest checkpoint (`abandoned`: recorded here, before the first step).
    """
    self._check_open('continue_from()')
    self._last_save_step, self._last_save_time = step, self._clock()
    if self._group is None or self._group.leader or not self._group.shared:
      abandoned.record(self.directory, step)

  def _mode(self, leaves: Mapping[str, Any]) -> str:
    """This save's mode, decided before any host memory is allocated for it."""
    if self.options.mode != 'auto':
      return self.options.mode
    needed = sum(
        int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for x in leaves.values())
    return auto_mode(needed, self._stager, available_host_memory())

  def prepare(self, state: Any, *, exclude: Callable[[str], bool] | None = None) -> bool:
    """Allocate and fault in the host buffer a save of `state` (arrays or `ShapeDtypeStruct`s;
    `exclude` as `save`'s) stages into, on a background thread, so the first `save` does not
    pay for it (it waits for that thread). Call it once the shapes are known, before other work
    (a compile). Returns whether it prepares: not when `auto` would write without a staged copy
    for lack of host memory, nor across processes. Waits for the save in flight."""
    self._check_open('prepare()')
    self.wait_until_finished()
    self._stager.wait_prepared()
    leaves = {n: x for n, x in named_leaves(state).items() if exclude is None or not exclude(n)}
    if not self._writer or self._group is not None or self._mode(leaves) == 'sync' and \
        self.options.mode == 'auto':
      return False
    self._stager.prepare(leaves)
    return True

  def save(self,
           step: int,
           state: Any,
           run_state: Mapping[str, Any] | None = None,
           *,
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
    self._check_open('save()')
    t0, step = time.perf_counter(), calls.step(step)
    leaves = named_leaves(state)
    calls.leaves(leaves)  # at the call, before waiting: the arrays it was handed
    calls.metadata_keys(metadata)
    self.wait_until_finished()
    self._stager.wait_prepared()  # a `prepare` still faulting the buffer in
    left_out = {}
    if exclude is not None:
      left_out = {n: x for n, x in leaves.items() if exclude(n)}
      leaves = {n: x for n, x in leaves.items() if n not in left_out}
    check_storable(self._storage(), leaves)  # E-CKPT-013 here, not from the writer
    if self._group is not None:  # before anything is written: N copies of one array, no restore
      multihost.refuse_process_local(leaves)
    # Captured now, as bytes and a private copy: the caller's dicts and lists may change while
    # the write runs (a bandit's pulls, counters), and a non-JSON value fails here, in its thread.
    run_state_json = calls.json_bytes({'step': step, **(run_state or {})})
    metadata = json.loads(calls.json_bytes(dict(metadata or {})))
    # Across processes each one stages and writes only the shards it owns (`multihost`).
    group, parts, places, grid = self._group, leaves, {}, None
    copies = []  # the parts of other processes this one keeps (`replicas`)
    if group is not None and self._storage() == SAFETENSORS:
      (parts, places), grid = multihost.owned_parts(leaves), multihost.grid(leaves)
      copies = replicas.dispatch(leaves, self.options.replicas) if self.options.replicas else []
    # The tensor tables are formatted by the writer: the caller only waits for the host copy (the
    # arrays themselves may be donated to the next train step by then).
    shapes = (avals(leaves), avals(left_out), (places, grid), self._saves, copies)
    self._saves += 1
    self.mode_used = mode = self._mode(parts)
    self.staging_used = 'host'
    if group is not None and self._storage() != SAFETENSORS:
      self.mode_used = mode = 'sync'  # orbax writes the global arrays across processes, inline
      staged = leaves
    elif mode == 'sync' and self.options.mode == 'auto':
      self._stager.release()  # short of memory: write from the arrays, hold no staged copy
      staged = Unstaged(parts)
    elif mode == 'async' and choose_staging(self.options.staging, leaves) == 'device':
      # A second copy on the devices, which the next step cannot donate away: the loop waits
      # only for it to be enqueued; the writer copies it to host memory, then lets it go.
      self.staging_used = 'device'
      staged = DeviceSnapshot(leaves, parts=None if not places else multihost.owned_parts)
    else:
      staged = self._stager.stage(parts)
    blocked = time.perf_counter() - t0
    self._last_save_step, self._last_save_time = step, self._clock()
    job = (step, staged, shapes, run_state_json, metadata, t0, blocked)
    if mode == 'sync':
      self._write(*job)
      return
    if self._executor is None:
      self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='jaxckpt-save')
    self._pending = self._executor.submit(self._write, *job)
    self._pending_of = (step, sum(getattr(x, 'nbytes', 0) for x in parts.values()))

  def wait_until_finished(self) -> None:
    """Wait for the save in flight, bounded (`bounded.finished`); raise its error here if it
    failed. Past the bound (E-CKPT-018) every later save raises it at once."""
    if self._stuck is not None:
      raise self._stuck
    with self._lock:
      pending, self._pending = self._pending, None
    if pending is not None:
      try:
        bounded.finished(pending, *self._pending_of, self.options.barrier_timeout_secs)
      except bounded.Stuck as e:
        self._stuck = e
        raise

  def take_error(self) -> BaseException | None:
    """The error of a background save that has finished, cleared as if raised; None when none
    failed or one is still running. Never blocks: a loop can ask at every step and hear of a
    failed write at once, not at its next `save`."""
    with self._lock:
      pending = self._pending
      if pending is None or not pending.done():
        return None
      self._pending = None
    return pending.exception()

  def _check_open(self, what: str) -> None:
    """E-CKPT-008 on a reader, E-CKPT-022 once closed: neither writes (the lock is let go)."""
    if not self._writer:
      raise CheckpointError('E-CKPT-008', f'{what} on a manager opened read-only', 'open a writer')
    if self._closed:
      raise calls.closed(what)

  def close(self) -> None:
    self._closed = True
    try:
      if self._stuck is None:  # raised once already otherwise
        self.wait_until_finished()
    finally:
      if self._executor is not None:  # not a thread stuck past its bound
        self._executor.shutdown(wait=self._stuck is None)
        self._executor = None
      self._stager.close()
      if self._held is not None and self._stuck is None:  # a stuck writer may still write here
        self._held.release()

  def __enter__(self) -> 'CheckpointManager':
    return self

  def __exit__(self, kind, error, tb) -> None:
    if error is None:
      self.close()
      return
    try:  # the body's error is the one raised; a failed save in the background is said with it
      self.close()
    except CheckpointError as e:
      logging.getLogger(__name__).error('closing %s: %s', self.directory, e.line())
      error.add_note(f'and while closing the checkpoint manager: {e.line()}')

  def _write(self, step, staged, shapes, run_state_json, metadata, t0, blocked) -> None:
    group = self._group
    tmp = (group or layout).temporary_dir(self.directory, step)  # all processes: one name
    saved, left_out, places, seq, replicated = shapes
    try:
      staging = 'device' if isinstance(staged, DeviceSnapshot) else 'host'
      if staging == 'device':
        staged = staged.to_host(self._stager)
      table = tensor_table(saved)
      if left_out:
        metadata['excluded'] = tensor_table(left_out)
      tmp.mkdir(parents=False, exist_ok=group is not None)
      storage, known, held, copies = self._storage(), {}, {}, None
      # Why this checkpoint is kept is its own: a later run's other flags never delete it (on
      # own disks process 0 adds what the others' earlier commits of the step were kept for).
      kept = retention.record(step, self.options, replacing=self.step_dir(step))
      metadata = {**metadata, 'storage': storage, 'retention': kept}
      if storage == SAFETENSORS:  # one file, straight from the staging region
        region = None if isinstance(staged, Unstaged) else self._stager.region
        known, table, held, self._in_memory, copies = jobcommit.write_part(
            self._group, self._stager, tmp, step, seq, staged, region, table,
            (places, replicated, kept))
      else:
        orbaxstore.save(tmp / layout.STATE_DIR, staged)
      final = self.step_dir(step)
      if group is not None and not group.leader:  # process 0 commits; its word ends the save
        at, job, kept, copies = jobcommit.await_commit(group, seq, step)
        files = known
        if not group.shared:  # this host's part, under process 0's manifest (the same bytes)
          metadata['retention'] = kept  # process 0's: a replay may find other commits here
          replicas.keep_matching(tmp, held, job)
          files = manifest.commit(tmp, final, step, job, table,
                                  jobcommit.listing(metadata, job, storage, True), run_state_json,
                                  at)
      else:
        now = time.time()
        files = manifest.commit(tmp, final, step, known, table,
                                jobcommit.listing(metadata, known, storage, group is not None),
                                run_state_json, now)
        if group is not None:
          jobcommit.announce(group, seq, now, known, metadata['retention'], copies)
          group.forget(str(seq - 1))  # every process has read the previous save's keys
      committed = time.perf_counter()
    except BaseException as e:
      if group is not None and group.leader:
        group.announce(f'{seq}/commit', f'{type(e).__name__}: {e}')
      if group is None or group.leader or not group.shared:
        shutil.rmtree(tmp, ignore_errors=True)
      last = layout.committed_steps(self.directory) if self.directory.is_dir() else {}
      intact = f'the last committed checkpoint (step {max(last)}) is intact' if last else \
          'no earlier checkpoint exists'
      raise CheckpointError(
          'E-CKPT-001', f'writing checkpoint step {step} under '
          f'{self.directory} failed: {type(e).__name__}: {e}',
          e.fix if isinstance(e, manifest.NotConfirmed) else
          f'nothing was committed for step {step}; {intact}') from e
    deleted, retention_errors = self._apply_retention(step)
    if self._on_commit is None:
      return
    info = CommitInfo(
        step,
        final,
        sum(f['size'] for f in files.values()),
        blocked,
        committed - t0,
        tuple(deleted),
        tuple(retention_errors),
        staging,
        staged=staged,
        in_memory=self._in_memory,
        replicas=copies)
    try:
      self._on_commit(info)
    except CheckpointError:
      raise  # already says what failed and what is intact (e.g. an export)
    except Exception as e:
      raise CheckpointError(
          'E-CKPT-009', f'the on_commit callback after checkpoint step {step} '
          f'failed: {type(e).__name__}: {e}',
          f'checkpoint step {step} is committed and intact') from e

  def _storage(self) -> str:
    return SAFETENSORS if self.options.storage == 'auto' else self.options.storage

  def _apply_retention(self, step: int) -> tuple[list[int], list[str]]:
    """After committing `step`: never it, nor a step above it (a replay's abandoned future)."""
    if self._group is not None and not self._group.leader and self._group.shared:
      return [], []  # process 0 deletes
    return retention.apply(
        self.directory, self._retention, self.options, newest=step, held=self.held())

  # ----------------------------------------------------------------------------- restoring
  def read_manifest(self, step_or_dir: int | os.PathLike) -> dict[str, Any]:
    return manifest.read(self._resolve(step_or_dir))

  def read_run_state(self, step_or_dir: int | os.PathLike) -> dict[str, Any]:
    return atomic.read_json(self._resolve(step_or_dir) / layout.RUN_STATE)

  def _resolve(self, step_or_dir, *, committed: bool = True) -> Path:
    """A step's directory (one not `committed` here: E-CKPT-010), or the path given."""
    if isinstance(step_or_dir, (str, os.PathLike)):
      return Path(step_or_dir)
    path = self.step_dir(calls.step(step_or_dir))
    if committed and not (path / layout.MANIFEST).is_file():
      steps = list(layout.committed_steps(self.directory))
      raise ArgumentError(
          'E-CKPT-010', f'step {step_or_dir} is not a committed checkpoint under '
          f'{self.directory} (' + (f'steps {steps[0]}..{steps[-1]}' if steps else 'none') + ')',
          'take one of latest_step() or all_steps() (retention may have removed it meanwhile)')
    return path

  def verify(self, step_or_dir, *, checksums: bool | None = None) -> list[str]:
    """Problems of a checkpoint ([] when intact): the ones a full verification reports, its
    manifest's own checksum included. Damage is returned, never raised."""
    checksums = self.options.verify_checksums if checksums is None else checksums
    return manifest.audit(self._resolve(step_or_dir, committed=False), checksums=checksums)[1]

  def restore(self,
              step_or_dir: int | os.PathLike,
              target: Any,
              *,
              only: Callable[[str], bool] | None = None,
              verify: bool = True,
              meanwhile: Callable[[], Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Load a committed checkpoint into the structure, shapes, dtypes and shardings of `target`.

    `target` is a pytree of `jax.ShapeDtypeStruct` (with `sharding`) or of arrays. Arrays are
    placed on the target's shardings, whatever mesh wrote them. Returns (state, run_state).

    `only` restores a subset: a predicate on saved tensor names (`named_leaves` names); only the
    tensors it accepts are compared with `target` and read, the others are never touched. An
    evaluator reads the weights alone with
    `restore(step, {'params': abstract.params}, only=lambda n: n.startswith('params/'))`.

    `verify=False` skips checking the files against the manifest, for a caller that just did.

    `meanwhile()` (a compile of the first step) runs on this thread while the state file (from
    several files, this process's byte ranges) is read on another, each window placed on the
    devices as it is read: the host holds a window or two, not the state. From orbax, the read
    follows."""
    step_dir = self._resolve(step_or_dir)
    raw, meta = reading.manifest_bytes(step_dir)  # E-CKPT-010 once retention removed it
    checksums = verify and self.options.verify_checksums
    want = reading.targets(named_leaves(target))  # a numpy leaf: the default device
    shards = reading.shard_rows(step_dir, raw, meta, verify=verify)
    if verify:
      reading.audit(step_dir, meta, want, shards, checksums=checksums)
    saved = {t['name']: t for t in meta['tensors'] if only is None or only(t['name'])}
    check_fits(step_dir, saved, want)
    how = {'checksums': checksums, 'verify': verify, 'partial': only is not None, 'shards': shards}
    restored = reading.read_arrays(step_dir, meta, want, meanwhile=meanwhile, **how)
    leaves = [restored[n] for n in want]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)
    return state, reading.read_run_state(step_dir)
