"""The background uploader: committed local checkpoints become durable in a remote store.

One thread copies the newest submitted checkpoint (`objects.upload`: data first, manifest last),
then applies the retention rules remotely, deleting only steps older than the new remote commit.
The training loop never waits for it. When the store is down, slow or failing, uploads are
retried with backoff (1 s doubling to 30 s); checkpoints submitted meanwhile replace the pending
one, so when the store is back the newest local checkpoint is the one uploaded. A lost lease
stops all remote writes for good.

Across processes (`parts`) every process runs one: each uploads its own part of each checkpoint
and process 0 commits it once all are there (`jaxckpt.checkpoint.remote.parts`).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..atomic import TMP_MARK
from ..errors import CheckpointError
from ..policy import RetentionPolicy
from .objects import PART_BYTES, delete, inspect, step_prefix, steps, upload
from .parts import OK, Parts, Superseded
from .lease import Lease, LeaseError
from .store import Store

Records = Mapping[str, 'bytes | Callable[[], bytes]']
_BACKOFF = (1.0, 30.0)


class Uploader:
  """Uploads committed checkpoints to `store` on its own thread.

  `on_event(name, **fields)` hears `uploaded`, `upload_failed`, `remote_retention` and
  `lease_lost` (called on the uploader's thread). `remote_step` is the newest step known to be
  committed remotely (`start_step` at first: what the store held when the run started); on a
  process other than 0 (`parts`), the newest step whose part from this process is uploaded.
  """

  def __init__(self,
               store: Store,
               *,
               retention: RetentionPolicy = RetentionPolicy(),
               lease: Lease | None = None,
               on_event: Callable[..., None] = lambda name, **fields: None,
               start_step: int | None = None,
               best_metric: str = 'heldout_loss',
               warn_every_secs: float = 60.0,
               part_bytes: int = PART_BYTES,
               mirror: tuple[Path, str] | None = None,
               parts: Parts | None = None):
    self.store, self.retention, self.lease = store, retention, lease
    self._parts = parts
    # (local directory, key prefix) kept equal after each commit: the exports.
    self._mirror, self._mirrored = mirror, {}
    self._on_event, self._best_metric = on_event, best_metric
    self._part_bytes, self._warn_every = part_bytes, warn_every_secs
    self.remote_step = start_step
    self.error: str | None = None
    self._pending: tuple[int, Path, Records] | None = None
    self._busy_step: int | None = None
    self._metrics: dict[int, float | None] = {}
    self._closed = False
    self._dead = False  # the lease was lost: nothing is written any more
    self._last_warning = -float('inf')
    self._cv = threading.Condition()
    self._thread = threading.Thread(target=self._run, name='jaxckpt-upload', daemon=True)
    self._thread.start()

  def submit(self, step: int, step_dir: Path, records: Records | None = None) -> None:
    """Queues the committed checkpoint `step_dir` (it replaces one still waiting). `records` are
    {name: bytes, or a function returning them when the upload runs} uploaded beside it."""
    with self._cv:
      if self._dead:
        return
      if self._pending is None or step >= self._pending[0]:
        self._pending = (step, Path(step_dir), dict(records or {}))
      self._cv.notify_all()

  @property
  def wanted_step(self) -> int | None:
    """The newest step submitted and not yet remotely committed."""
    with self._cv:
      steps = [s for s in (self._busy_step, self._pending and self._pending[0]) if s is not None]
      return max(steps) if steps else None

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
        step, step_dir, records = self._pending
        self._pending, self._busy_step = None, step
      try:
        self._upload(step, step_dir, records)
        backoff = _BACKOFF[0]
      except LeaseError as e:
        self._fail(step, e, fatal=True)
        return
      except Superseded as e:  # a newer checkpoint is due: the next round uploads it
        logging.info('step %d is not committed remotely (%s); a newer one is due', step, e)
      except Exception as e:  # noqa: BLE001 - a store error of any kind: retried
        self._fail(step, e)
        with self._cv:
          if self._pending is None or self._pending[0] < step:
            self._pending = (step, step_dir, records)  # retry it, unless a newer one came
          self._cv.wait(timeout=backoff)
        backoff = min(backoff * 2, _BACKOFF[1])
      finally:
        with self._cv:
          self._busy_step = None
          self._cv.notify_all()

  def _newer(self, step: int) -> bool:
    with self._cv:
      return self._pending is not None and self._pending[0] > step

  def _may_commit(self, step: int) -> None:
    """Before the manifest: every other process's part is there, and the lease is still ours."""
    if self._parts is not None:
      self._parts.wait(step, lambda: self._closed, lambda: self._newer(step), self._heard)
    if self.lease is not None:
      self.lease.renew()

  def _heard(self, problem: str) -> None:
    with self._cv:
      self.error = problem
    self._on_event('upload_failed', error=problem)

  def _upload(self, step: int, step_dir: Path, records: Records) -> None:
    t0 = time.monotonic()
    parts = self._parts
    if parts is not None and not parts.leader:
      stopped = parts.stopped()
      if stopped is not None:
        raise LeaseError('E-STORE-007', f'process 0 stopped the uploads: {stopped}',
                         'this run no longer writes to the prefix')
      parts.started(step)
      sent, _ = upload(
          self.store, step_dir, {}, files=parts.mine, commit=False, part_bytes=self._part_bytes)
      parts.said(step, OK)
      self._uploaded(step, sent, time.monotonic() - t0)
      return
    data = {n: (r() if callable(r) else r) for n, r in records.items()}
    sent, m = upload(
        self.store,
        step_dir,
        data,
        files=None if parts is None else parts.mine,
        may_commit=lambda: self._may_commit(step),
        part_bytes=self._part_bytes)
    if parts is not None:
      parts.forget(step)  # committed: the words are not needed again (a retry needs them)
    seconds = time.monotonic() - t0
    self._metrics[step] = (m.get('metrics') or {}).get(self._best_metric)
    self._apply_retention(step)
    if self._mirror is not None:  # before `remote_step` moves: a waiter sees the exports too
      self._mirror_dir(*self._mirror)
    self._uploaded(step, sent, seconds)

  def _uploaded(self, step: int, sent: int, seconds: float) -> None:
    with self._cv:
      self.remote_step = max(step, self.remote_step or step)
      recovered, self.error = self.error is not None, None
    self._on_event(
        'uploaded',
        step=step,
        bytes=sent,
        seconds=round(seconds, 3),
        url=self.store.join(step_prefix(step).rstrip('/')))
    what = 'its part of step' if self._parts is not None and not self._parts.leader else 'step'
    logging.info('uploaded %s %d to %s: %.1f MB in %.1f s', what, step, self.store.url, sent / 1e6,
                 seconds)
    if recovered:
      logging.warning('remote store %s is back: step %d is durable there', self.store.url, step)

  def _apply_retention(self, newest: int) -> None:
    try:
      remote, abandoned = steps(self.store)  # one listing for both
      for s in remote:
        if s not in self._metrics:
          _, m, _, _ = inspect(self.store, s, remote[s])
          self._metrics[s] = ((m or {}).get('metrics') or {}).get(self._best_metric)
      metric = {s: v for s, v in self._metrics.items() if s in remote and v is not None}
      doomed = [s for s in self.retention.to_delete(remote, metric) if s < newest]
      doomed += [s for s in abandoned if s < newest]  # the parts of abandoned uploads
      for s in doomed:
        delete(self.store, s)
      if doomed:
        self._on_event('remote_retention', deleted=doomed)
    except (CheckpointError, OSError) as e:
      self._on_event('remote_retention_failed', error=str(e))

  def _mirror_dir(self, local: Path, prefix: str) -> None:
    """Uploads the files under `local` that are new or changed since last time and deletes the
    remote ones that are gone locally; names with a temporary mark (a write in progress) are
    left for next time. A failure is an event; the next commit tries again."""
    try:
      files = {
          str(p.relative_to(local)): p
          for p in sorted(local.rglob('*'))
          if p.is_file() and TMP_MARK not in str(p.relative_to(local))
      }
      for rel, path in files.items():
        stat = path.stat()
        if self._mirrored.get(rel) != (stat.st_size, stat.st_mtime_ns):
          self.store.write(prefix + rel, path.read_bytes())
          self._mirrored[rel] = (stat.st_size, stat.st_mtime_ns)
      gone = [k for k in self.store.list(prefix) if k[len(prefix):] not in files]
      self.store.delete_many(gone)
      for key in gone:
        self._mirrored.pop(key[len(prefix):], None)
    except (CheckpointError, OSError) as e:
      self._on_event('mirror_failed', prefix=prefix, error=str(e))

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
      logging.warning('upload of step %d to %s failed (%s)%s', step, self.store.url, message,
                      '' if fatal else '; retrying, training goes on')

  def status(self) -> dict[str, Any]:
    return {'remote_step': self.remote_step, 'remote_error': self.error}
