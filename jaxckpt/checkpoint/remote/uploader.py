"""The background uploader: committed local checkpoints become durable in a remote store.

One thread copies the newest submitted checkpoint (`objects.upload`: data first under this run's
attempt name, the commit last), then applies the retention rules remotely, deleting only steps
older than the new remote commit. Every write is fenced by the lease: none unless it is fresh
(`Lease.writable`), and none of a commit or a delete without renewing it first (`Lease.renewed`).
The training loop never waits for it. When the store is down, slow or failing, uploads are
retried with backoff (1 s doubling to 30 s); checkpoints submitted meanwhile replace the pending
one, so when the store is back the newest local checkpoint is the one uploaded. A lost lease
stops all remote writes for good. A local checkpoint that fails its CRC-32s as it is read is
never committed, and not retried (`objects.DamagedLocal`, E-STORE-013).

Across processes (`parts`) every process runs one: each uploads its own part of each checkpoint
under the one attempt name process 0 chose, and process 0 commits it once all are there
(`jaxckpt.checkpoint.remote.parts`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import CheckpointError
from ..manifest import seal_of
from ..policy import RetentionPolicy, manifest_fields, pins
from .lease import Lease, LeaseError
from .mirror import Mirror
from .objects import (PART_BYTES, REMOTE_META, DamagedLocal, delete, holds, inspect, new_attempt,
                      stale, step_prefix, steps, upload)
from .parts import OK, Parts, Superseded
from .segments import SEGMENTS, Appended, Segments, unnamed
from .store import Store

Records = Mapping[str, 'bytes | Appended | Callable[[], bytes]']
Memory = Mapping[str, Any]  # {state file: `staging.InMemory`}: read instead of the disk
_BACKOFF = (1.0, 30.0)


class Uploader:
  """Uploads committed checkpoints to `store` on its own thread.

  `on_event(name, **fields)` hears `upload_started`, `uploaded`, `upload_failed`,
  `remote_retention` and `lease_lost` (called on the uploader's thread). `remote_step` is the newest step this
  uploader made durable: committed remotely, or found there as it is (`objects.holds`: the
  checkpoint the run was downloaded from). Never what the store held when the run started: a
  replay's steps are not durable until they are uploaded. On a process other than 0 (`parts`),
  the newest step whose part from this process is uploaded.
  """

  def __init__(self,
               store: Store,
               *,
               retention: RetentionPolicy = RetentionPolicy(),
               lease: Lease | None = None,
               on_event: Callable[..., None] = lambda name, **fields: None,
               best_metric: str = 'heldout_loss',
               warn_every_secs: float = 60.0,
               part_bytes: int = PART_BYTES,
               mirror: tuple[Path, str] | None = None,
               parts: Parts | None = None):
    self.store, self.retention, self.lease = store, retention, lease
    self._parts = parts
    # Process 0 names the attempt every process of the job writes under; the others learn it.
    self.attempt = new_attempt() if parts is None or parts.leader else None
    if parts is not None and parts.leader:
      parts.name_attempt(self.attempt)
    # (local directory, key prefix) kept equal after each commit: the exports.
    self._mirror = None if mirror is None else Mirror(
        store,
        *mirror,
        part_bytes=part_bytes,
        may_write=self._may_write,
        may_delete=self._may_delete)
    self._on_event, self._best_metric = on_event, best_metric
    self._part_bytes, self._warn_every = part_bytes, warn_every_secs
    self.remote_step: int | None = None
    self._stop_asked = -float('inf')
    self.error: str | None = None
    self._pending: tuple[int, Path, Records, Memory] | None = None
    self._busy_step: int | None = None
    self._epoch = 0  # one more at each replay: an upload of an earlier one is not durable now
    self._fields: dict[int, dict[str, Any] | None] = {}  # `manifest_fields` of remote steps
    self._metas: dict[int, dict[str, Any] | None] = {}  # their remote.json: attempt, records
    self._seals: dict[int, str | None] = {}  # their manifests' seals
    # {step: seal} of the remote checkpoints the run abandoned (`remote.abandoned`): retention
    # does not count them, and deletes those below the newest commit that no manifest keeps;
    # the replay replaces the others (process 0's `started`). None: not known
    # yet, and retention waits for it (the next commit's deletes what this one would have).
    self.abandoned: Mapping[int, str] | None = {}
    self._segments = Segments()  # the records sent by segment (process 0's)
    self._seeded = self._swept = False  # once per uploader: segments taken, unnamed removed
    self._unnamed: dict[str, float] = {}  # segment key: when a sweep first found it unnamed
    self._closed = False
    self._dead = False  # the lease was lost: nothing is written any more
    self._last_warning = -float('inf')
    self._cv = threading.Condition()
    self._thread = threading.Thread(target=self._run, name='jaxckpt-upload', daemon=True)
    self._thread.start()

  def submit(self,
             step: int,
             step_dir: Path,
             records: Records | None = None,
             memory: Memory | None = None) -> None:
    """Queues the committed checkpoint `step_dir` (it replaces one still waiting). `records` are
    {name: bytes, a function returning them when the upload runs, or `segments.Appended`: a
    record that only grows, sent by segment} uploaded beside it;
    `memory` ({state file: `InMemory`}, `CommitInfo.in_memory`) is read instead of the disk
    while the save's buffer holds it. A step older than one made durable or queued before (a
    replay) starts `remote_step` over."""
    with self._cv:
      if self._dead:
        return
      known = (self.remote_step, self._busy_step, self._pending and self._pending[0])
      if any(k is not None and k > step for k in known):
        # A replay (the run went back to an older checkpoint): what it made durable or is
        # sending is another history's future, and says nothing of this one's steps.
        self._epoch, self.remote_step, self._pending = self._epoch + 1, None, None
      if self._pending is None or step >= self._pending[0]:
        self._pending = (step, Path(step_dir), dict(records or {}), dict(memory or {}))
      self._cv.notify_all()

  @property
  def wanted_step(self) -> int | None:
    """The newest step submitted and not yet remotely committed."""
    with self._cv:
      steps = [s for s in (self._busy_step, self._pending and self._pending[0]) if s is not None]
      return max(steps) if steps else None

  def holding(self) -> set[int]:
    """The steps whose local directories it is reading or will read: keep them until then."""
    with self._cv:
      return {s for s in (self._busy_step, self._pending and self._pending[0]) if s is not None}

  def committed_size(self, name: str) -> int:
    """The bytes of record `name` (sent by segment) that both this writer's last commit and the
    newest remote step it knows of hold (after a replay, the abandoned future's, which a fresh
    machine takes when nothing else is intact), as its file still holds them; 0 when it knows of none."""
    _, held = self._segments.known.get(name, (None, []))
    sizes = [held[-1].end if held else 0]
    if self._metas:
      want = ((self._metas[max(self._metas)] or {}).get('records') or {}).get(name)
      size = want.get('size') if isinstance(want, Mapping) else None
      sizes.append(size if type(size) is int and size >= 0 else 0)  # pylint: disable=unidiomatic-typecheck
    return min(sizes)

  def durable(self, step: int) -> bool:
    return self.remote_step is not None and self.remote_step >= step

  def wait(self, step: int, timeout: float | None = None) -> bool:
    """Waits until `step` (or a newer one) is committed remotely; False after `timeout` secs or
    when it never will be (the lease was lost, or it was never submitted)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while not self.durable(step) and not self._dead:
        if self.wanted_step is None or self.wanted_step < step:
          return False
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          return False
        self._cv.wait(timeout=left if left is not None else 1.0)
      return self.durable(step)

  def close(self) -> None:
    """Stops the thread after the upload in progress (what is pending is dropped)."""
    with self._cv:
      self._closed = True
      self._cv.notify_all()
    self._thread.join(timeout=5)

  def _run(self) -> None:
    backoff = _BACKOFF[0]
    while True:
      with self._cv:
        while self._pending is None and not self._closed:
          self._cv.wait()
        if self._closed:
          return
        step, step_dir, records, memory = self._pending
        self._pending, self._busy_step, epoch = None, step, self._epoch
      try:
        self._upload(step, step_dir, records, epoch, memory)
        backoff = _BACKOFF[0]
      except LeaseError as e:
        if e.lost:  # to another writer (or a commit changed under it): for good
          self._fail(step, e, fatal=True)
          return
        self._retry((step, step_dir, records, memory), e, backoff, epoch)  # not renewed yet
        backoff = min(backoff * 2, _BACKOFF[1])
      except DamagedLocal as e:  # the local copy will not get better: never retried
        self._fail(step, e)
      except Superseded as e:  # a newer checkpoint is due, or a process stalled: said already
        logging.info('step %d is not committed remotely: %s', step, e)
      except Exception as e:  # noqa: BLE001 - a store error of any kind: retried
        self._retry((step, step_dir, records, memory), e, backoff, epoch)
        backoff = min(backoff * 2, _BACKOFF[1])
      finally:
        with self._cv:
          self._busy_step = None
          self._cv.notify_all()

  def _retry(self, job: tuple[int, Path, Records, Memory], e: Exception, backoff: float,
             epoch: int) -> None:
    step = job[0]
    self._fail(step, e)
    with self._cv:
      if epoch == self._epoch and (self._pending is None or self._pending[0] < step):
        self._pending = job  # retry it, unless a newer one came
      self._cv.wait(timeout=backoff)

  def _newer(self, step: int) -> bool:
    with self._cv:
      return self._pending is not None and self._pending[0] > step

  def _may_write(self, what: str) -> None:
    """Before each write: the lease is fresh; on another process, process 0 has not stopped the
    uploads (asked at most once a second)."""
    if self.lease is not None:
      self.lease.writable(what)
    parts = self._parts
    if parts is not None and not parts.leader and self._busy_step is not None:
      parts.moving(self._busy_step)  # process 0 hears this upload is not stuck
    if parts is not None and not parts.leader and time.monotonic() - self._stop_asked >= 1.0:
      self._stop_asked = time.monotonic()
      stopped = parts.stopped()
      if stopped is not None:
        raise LeaseError('E-STORE-007', f'process 0 stopped the uploads: {stopped}',
                         'this run no longer writes to the prefix')

  def _may_delete(self, what: str) -> None:
    if self.lease is not None:
      self.lease.renewed(f'delete {what}')

  def _may_commit(self, step: int) -> None:
    """Before the commit: every other process's part is there, and the lease is still ours."""
    if self._parts is not None:
      self._parts.wait(step, lambda: self._closed, lambda: self._newer(step), self._heard)
    if self.lease is not None:
      self.lease.renewed(f'commit {self.store.join(step_prefix(step))}')

  def _heard(self, problem: str) -> None:
    with self._cv:
      self.error = problem
    self._on_event('upload_failed', error=problem)

  def _upload(self, step: int, step_dir: Path, records: Records, epoch: int,
              memory: Memory) -> None:
    t0, served = time.monotonic(), _served(memory)  # this attempt's reads from memory only
    parts = self._parts
    if holds(self.store, step_dir):  # downloaded from the remote, or uploaded before: durable
      self._uploaded(step, 0, time.monotonic() - t0, epoch)
      return
    self._on_event('upload_started', step=step)
    if parts is not None and not parts.leader:
      self._stop_asked = -float('inf')
      self._may_write(self.store.url)
      if self.attempt is None:
        self.attempt = parts.attempt()  # the name process 0 chose (it never changes)
      parts.started(step)
      sent, _ = upload(
          self.store,
          step_dir, {},
          attempt=self.attempt,
          files=parts.mine,
          commit=False,
          may_write=self._may_write,
          part_bytes=self._part_bytes,
          memory=memory)
      parts.said(step, OK)
      self._uploaded(step, sent, time.monotonic() - t0, epoch, _served(memory) - served)
      return
    if self.lease is not None:  # a run that could not renew for a while tries now, once
      self.lease.renewed(f'upload of step {step}')
    # What the step's commit was (a replay replaces it) is known again only once this upload
    # committed, or from the store: an upload that fails after its commit landed names other
    # segments than the commit it replaced.
    for known in (self._fields, self._metas, self._seals):
      known.pop(step, None)
    data = {n: (r() if callable(r) else r) for n, r in records.items()}
    if not self._seeded and any(isinstance(r, Appended) for r in data.values()):
      self._seed(data)
    sent, m = upload(
        self.store,
        step_dir,
        data,
        attempt=self.attempt,
        files=None if parts is None else parts.mine,
        may_write=self._may_write,
        may_commit=lambda: self._may_commit(step),
        may_delete=self._may_delete,
        part_bytes=self._part_bytes,
        memory=memory,
        segments=self._segments)
    if parts is not None:
      parts.forget(step)  # committed: the words are not needed again (a retry needs them)
    seconds = time.monotonic() - t0
    self._fields[step], self._seals[step] = manifest_fields(m), m.get('manifest_crc32')
    self._metas[step] = {'attempt': self.attempt, 'records': self._segments.last}
    self._apply_retention(step)
    if self._mirror is not None:  # before `remote_step` moves: a waiter sees the exports too
      try:
        self._mirror.sync()
      except LeaseError:
        raise
      except (CheckpointError, OSError) as e:  # the next commit tries again
        self._on_event('mirror_failed', prefix=self._mirror.prefix, error=str(e))
    self._uploaded(step, sent, seconds, epoch, _served(memory) - served)

  def _seed(self, records: Mapping[str, Any]) -> None:
    """The first upload of this writer sends by segment only what the remote's newest intact
    commit does not hold of its records already (a restart: what was appended since)."""
    remote, _ = steps(self.store)
    for s in sorted(remote, reverse=True):
      _, m, meta, problems = inspect(self.store, s, remote[s])
      if not problems:
        self._fields[s], self._metas[s] = manifest_fields(m), meta
        for name, record in records.items():
          want = ((meta or {}).get('records') or {}).get(name)
          if isinstance(record, Appended) and isinstance(want, Mapping) and 'segments' in want:
            self._segments.seed(name, record, want)
        break
    self._seeded = True  # not before: a seed cut short by the store is tried again

  def _uploaded(self,
                step: int,
                sent: int,
                seconds: float,
                epoch: int,
                from_memory: int = 0) -> None:
    with self._cv:
      if epoch == self._epoch:
        self.remote_step = max(step, self.remote_step or step)
      recovered, self.error = self.error is not None, None
    self._on_event(
        'uploaded',
        step=step,
        bytes=sent,
        from_memory=from_memory,
        seconds=round(seconds, 3),
        url=self.store.join(step_prefix(step).rstrip('/')))
    what = 'its part of step' if self._parts is not None and not self._parts.leader else 'step'
    logging.info('uploaded %s %d to %s: %.1f MB in %.1f s', what, step, self.store.url, sent / 1e6,
                 seconds)
    if recovered:
      logging.warning('remote store %s is back: step %d is durable there', self.store.url, step)

  def _apply_retention(self, newest: int) -> None:
    if self.abandoned is None:
      return
    try:
      remote, unfinished = steps(self.store)  # one listing for both
      for s in remote:
        if s not in self._seals:
          raw, m, meta, _ = inspect(self.store, s, remote[s])
          self._fields[s] = None if m is None else manifest_fields(m)  # None: kept, unknown why
          self._metas[s], self._seals[s] = meta, None if raw is None else seal_of(raw)
      left = {s for s in remote if s in self.abandoned and self._seals[s] == self.abandoned[s]}
      records = {s: self._fields[s] for s in remote if s not in left}
      metric = {
          s: v
          for s, f in records.items()
          if isinstance(v := ((f or {}).get('metrics') or {}).get(self._best_metric), (int, float))
      }
      # What a checkpoint's own manifest says is kept stays kept remotely too; newest-K counts
      # this history (up to the step just committed), never a replay's abandoned future, nor
      # what it abandoned below that step (one its cadence did not save again).
      doomed = [
          s for s in self.retention.to_delete(records, metric, newest=newest, pinned=pins(records))
          if s < newest
      ]
      doomed += [s for s in unfinished if s < newest]  # the parts of abandoned uploads
      # What the run abandoned below this commit (the replay passed it without uploading it
      # again): deleted, unless its own manifest keeps it.
      doomed += [s for s in left if s < newest and not pins({s: self._fields[s]})]
      for s in doomed:
        delete(self.store, s, self._may_delete)
        self._fields.pop(s, None)
        self._seals.pop(s, None)
      # Attempts beside a kept step's commit: a stale writer's, a failed or replaced upload's.
      debris = [
          k for s in remote if s < newest and s not in doomed and self._metas.get(s) is not None
          for k in stale(self.store, s, remote[s], self._metas[s])
      ]
      if debris:
        self.store.delete_many(
            debris, fence=lambda: self._may_delete(self.store.join('checkpoints')))
      unused = self._unused_segments(remote, doomed) if doomed or self._unnamed or \
          not self._swept else []
      if unused:
        self.store.delete_many(unused, fence=lambda: self._may_delete(self.store.join(SEGMENTS)))
        for k in unused:
          del self._unnamed[k]
      if doomed or debris or unused:
        self._on_event('remote_retention', deleted=doomed, debris=len(debris), segments=len(unused))
    except LeaseError:
      raise
    except Exception as e:  # noqa: BLE001 - the step is committed whatever this meets: next time
      self._on_event(
          'remote_retention_failed',
          error=str(e) if isinstance(e, CheckpointError) else f'{type(e).__name__}: {e}')

  def _unused_segments(self, remote: Mapping[int, Any], doomed: list[int]) -> list[str]:
    """The record segments no remaining commit names (merged into longer ones since, or a
    replay's): none while a remaining commit could not be read."""
    self._swept = True
    tables = []
    for s in remote:
      if s not in doomed:
        meta = self._metas.get(s)
        before_attempts = meta is None and REMOTE_META not in remote[s]  # names no segments
        tables.append({} if before_attempts else None if meta is None else meta.get('records', {}))
    now, grace = time.monotonic(), self.lease.ttl if self.lease is not None else 0.0
    found = unnamed(self.store, tables)
    self._unnamed = {k: self._unnamed.get(k, now) for k in found}
    return [k for k, first in self._unnamed.items() if now - first >= grace]

  def _fail(self, step: int, e: Exception, *, fatal: bool = False) -> None:
    message = e.line() if isinstance(e, CheckpointError) else f'{type(e).__name__}: {e}'
    if self._parts is not None:
      try:
        if not self._parts.leader:
          self._parts.said(step, message[:300])  # process 0 shows it in its status
        elif fatal:
          self._parts.stop(message[:300])  # the lease is gone: the others stop writing too
      except Exception:  # noqa: BLE001 - the coordinator is gone: the job is ending anyway
        pass
    with self._cv:
      self.error = message
      if fatal:
        self._dead = True
      self._cv.notify_all()
    self._on_event('lease_lost' if fatal else 'upload_failed', step=step, error=message)
    now = time.monotonic()
    if fatal or now - self._last_warning >= self._warn_every:
      self._last_warning = now
      then = '' if fatal else ('; not retried (the local copy is damaged), training goes on'
                               if isinstance(e, DamagedLocal) else '; retrying, training goes on')
      logging.warning('upload of step %d to %s failed (%s)%s', step, self.store.url, message, then)

  def status(self) -> dict[str, Any]:
    return {'remote_step': self.remote_step, 'remote_error': self.error}


def _served(memory: Memory) -> int:
  return sum(held.served for held in memory.values())
