"""The trainer's side of the remote tier (`--remote=URL`, `config.checkpoint.remote`).

- Before anything is compiled, `RemoteRun.open` checks access (a probe object written, read back
  and deleted under the prefix) and takes the prefix's lease; every failure is one line, exit 2.
- `sync_down` makes the workdir continue from the newest intact checkpoint of either tier: a
  newer remote one is downloaded (CRC-checked) with the run's records of that step (loss history,
  events, samples, bandit, status); a newer local one is queued for upload.
- Each checkpoint carries the records as of its `save()` (`capture`, at the call); each commit is
  handed to the background `Uploader` (`on_commit`). `status.json` shows `remote_step`,
  `remote_lag_steps` and `remote_error`.
- `finish` gives the upload of the last checkpoint its time: `stop_grace_secs` after a stop
  signal, longer at the end of a run, and says on stderr which step is durable where.
- Across processes every one checks access and uploads its own part of each checkpoint; process
  0 holds the lease, writes the records and commits (`jaxckpt.checkpoint.remote.parts`). With a
  workdir on each host's own disk, every process downloads the checkpoint it resumes from.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from absl import logging

from jaxckpt.checkpoint import (CheckpointError, CheckpointOptions, CommitInfo, RetentionPolicy,
                                atomic, discovery, layout)
from jaxckpt import distributed
from jaxckpt.checkpoint.remote import (Lease, LeaseError, Parts, Store, StoreError, Uploader,
                                       objects)
from jaxckpt.errors import ConfigError, UsageError
from jaxckpt.runlog import RunLog
from jaxckpt.workdir import BANDIT, EVENTS, EXPORTS, LOSSES, SAMPLES, STATUS

APPEND_ONLY = (LOSSES, EVENTS)  # captured as their length at the call: the prefix never changes
REWRITTEN = (SAMPLES, BANDIT, STATUS)  # captured as bytes
FINISH_SECS = 600.0  # how long the end of a run waits for its last upload

# What a failed access check means, by `StoreError.kind`: (code, what, fix). Filled in with the
# store's {bucket}, {url}, {endpoint}, {endpoint_var} and {credentials}.
_ACCESS = {
    'bad_url':
        ('E-STORE-001', '{bucket} is not a valid bucket name', 'fix the bucket name in --remote'),
    'missing_bucket': ('E-STORE-002', 'bucket {bucket} does not exist',
                       'create it, or fix the bucket name in --remote'),
    'credentials': ('E-STORE-003', 'the credentials were refused', 'check {credentials}'),
    'denied': ('E-STORE-003', 'the credentials may not list the bucket',
               'grant them list and read access to the bucket, or check {credentials}'),
    'unreachable': ('E-STORE-005', 'the storage endpoint {endpoint} cannot be reached',
                    'check {endpoint_var} and the network'),
    'failed': ('E-STORE-008', 'the store failed', 'check --remote and the store'),
}
# The permission a probe stage needs, by scheme, for E-STORE-004.
_PERMISSION = {
    's3': {'write': 's3:PutObject', 'read': 's3:GetObject', 'delete': 's3:DeleteObject'},
    'gs': {
        'write': 'storage.objects.create', 'read': 'storage.objects.get',
        'delete': 'storage.objects.delete'
    },
}


def open_store(url: str) -> Store:
  try:
    return Store(url)
  except StoreError as e:  # E-STORE-001: its `what` starts with the URL
    raise ConfigError(e.code, f'--remote={e.what}', e.fix) from None


def check_access(store: Store) -> None:
  """Lists, writes, reads back and deletes a probe object under the prefix; raises `UsageError`
  (exit 2), one line naming the URL, what failed and the fix."""
  probe = f'.jaxckpt-probe-{uuid.uuid4().hex[:12]}'
  data = b'jaxckpt access probe\n'
  stage, unclear = 'list', None
  try:
    try:
      store.list('.jaxckpt-probe-')
    except StoreError as e:
      if e.kind != 'failed':
        raise
      # An answer that says nothing (the GCS emulator's empty 404 for a bucket it does not
      # have): what the write is told may say more.
      unclear = e
    stage = 'write'
    store.write(probe, data)
    stage = 'read'
    if store.read(probe) != data:
      raise StoreError('E-STORE-008', f'{store.join(probe)} read back different bytes',
                       'the store does not keep what it is given')
    stage = 'delete'
    store.delete(probe)
    if unclear is not None:
      stage = 'list'
      raise unclear
  except StoreError as e:
    if unclear is not None and e.kind == 'failed':
      e, stage = unclear, 'list'
    raise _access_error(store, stage, e) from None


def _access_error(store: Store, stage: str, e: StoreError) -> UsageError:
  """The one line for a probe that failed at `stage` with `e`: the URL, what, the store's own
  words (short) and the fix."""
  env = os.environ
  if store.scheme == 's3':
    endpoint_var = 'AWS_ENDPOINT_URL_S3' if env.get('AWS_ENDPOINT_URL_S3') else 'AWS_ENDPOINT_URL'
    endpoint = env.get(endpoint_var) or 'of S3'
    credentials = 'AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the AWS profile in use)'
  elif store.scheme == 'gs':
    endpoint_var = 'STORAGE_EMULATOR_HOST'
    endpoint = env.get('TENSORSTORE_GCS_HTTP_URL') or env.get(endpoint_var) or 'of GCS'
    credentials = ('the application default credentials (GOOGLE_APPLICATION_CREDENTIALS, or '
                   'gcloud auth application-default login)')
  else:
    endpoint_var, endpoint, credentials = 'the mount', store.prefix, 'the permissions of the path'
  code, what, fix = _ACCESS[e.kind]
  refused = e.kind == 'denied' or store.scheme == 'file' and e.kind == 'credentials'
  if refused and (stage != 'list' or store.scheme == 'file'):
    permission = _PERMISSION.get(store.scheme, {}).get(stage, f'{stage} access')
    code, what, fix = ('E-STORE-004', f'no permission to {stage} objects under the prefix',
                       f'grant the credentials {permission} on {store.url}')
  names = dict(
      bucket=store.bucket,
      url=store.url,
      endpoint=endpoint,
      endpoint_var=endpoint_var,
      credentials=credentials)
  what, fix = what.format(**names), fix.format(**names)
  # Without tensorstore's status code, retry count and [http_response_body='...'] payloads.
  lines = str(e.__cause__ or e.what).strip().splitlines()
  reason = re.sub(r'^([A-Z_]+: )+', '', lines[0].split(' [', 1)[0] if lines else '')
  reason = re.sub(r'^All \d+ retry attempts failed: ', '', reason).rstrip(': ').replace(';', ',')
  detail = f' ({stage}: {reason[:200]})' if reason else ''
  return UsageError(code, f'--remote={store.url}: {what}{detail}', fix)


class RemoteRun:
  """The remote tier of one trainer invocation."""

  def __init__(self,
               store: Store,
               workdir: Path,
               config,
               cluster: distributed.Cluster = distributed.Cluster()):
    c = config.checkpoint
    self.store, self.workdir, self.config = store, Path(workdir), config
    self.leader = cluster.leader  # holds the lease, writes the records, commits
    self.parts = Parts(cluster.index, cluster.count) if cluster.count > 1 else None
    self.lease = Lease(store, ttl_secs=c.remote_lease_secs)
    self.taken_over: dict[str, Any] | None = None
    self.uploader: Uploader | None = None
    self.start_step: int | None = None  # the newest intact remote step when the run started
    self.fetched: dict[str, Any] | None = None
    self._records: dict[int, dict[str, Any]] = {}
    self._runlog: RunLog | None = None
    self._last_local: int | None = None

  @classmethod
  @contextlib.contextmanager
  def opened(
      cls, config, workdir: Path, cluster: distributed.Cluster = distributed.Cluster()
  ) -> Iterator['RemoteRun | None']:
    """`open`, and at the end `finish`: the last commit gets `stop_grace_secs` to become durable
    after a stop signal or a failure, `FINISH_SECS` at the end of a run. Across processes every
    one opens it, and a failure on any one stops them all."""
    run = distributed.together(
        'remote_open', lambda: cls.open(config, workdir, cluster), undo=lambda r: r and r.close())
    if run is None:
      yield None
      return
    try:
      yield run
    except BaseException:
      run.finish(run._last_local, stopping=True)
      raise
    run.finish(run._last_local, stopping=False)

  @classmethod
  def open(
      cls, config, workdir: Path,
      cluster: distributed.Cluster = distributed.Cluster()) -> 'RemoteRun | None':
    """Checks access and (process 0) takes the lease, before anything is compiled; None without
    --remote."""
    url = config.checkpoint.get('remote', '')
    if not url:
      return None
    store = open_store(url)
    check_access(store)
    run = cls(store, workdir, config, cluster)
    if not run.leader:
      return run
    try:
      run.taken_over = run.lease.acquire()
    except LeaseError as e:
      raise UsageError(e.code, e.what, e.fix) from None
    except StoreError as e:
      raise UsageError('E-STORE-008', f'--remote={url}: cannot take the lease ({e.what})',
                       e.fix) from None
    run.lease.start()
    return run

  def sync_down(self, ckpt_dir: Path, *, fetch: bool = True) -> None:
    """Brings the workdir to the newest intact checkpoint of either tier (see the module doc).
    Runs before the workdir's records are opened: a download replaces them. A remote checkpoint
    that fails its checksums while it downloads is passed over for the next newest. Without
    `fetch` (a start that names its resume point) it only learns the remote's newest step."""
    local, _ = discovery.latest_intact(ckpt_dir, checksums=False)
    local_step = layout.parse_step(local.name) if local is not None else None
    remote = sorted(objects.committed(self.store).items(), reverse=True)
    for step, keys in remote:
      problems = objects.inspect(self.store, step, keys)[3]
      if problems:
        logging.warning('passing over remote step %d: %s', step, problems[0])
        continue
      if self.start_step is None:
        self.start_step = step
      if not fetch or (local_step is not None and local_step >= step):
        return
      try:
        self._fetch(step, ckpt_dir, local_step)
        return
      except StoreError:
        raise  # the store failed: starting without the remote's newest would fork the run
      except CheckpointError as e:
        logging.warning('passing over remote step %d: %s', step, e.line())
        if self.start_step == step:
          self.start_step = None

  def resume_point(self, ckpt_dir: Path) -> Path | None:
    """Where each host's workdir is its own disk: the newest intact remote checkpoint, which
    `sync_down` brought here (None: the remote holds none, a fresh start). This host's own parts
    of newer checkpoints cannot be restored without the others' and are passed over."""
    if self.start_step is None:
      return None
    return ckpt_dir / layout.step_dirname(self.start_step)

  def _fetch(self, step: int, ckpt_dir: Path, local_step: int | None) -> None:
    t0 = time.monotonic()
    logging.info('fetching step %d from %s (the newest intact checkpoint%s)', step, self.store.url,
                 f'; local has {local_step}' if local_step is not None else '')
    path, records = objects.download(self.store, step, ckpt_dir, progress=_Progress(step))
    for name, data in records.items():
      if name in APPEND_ONLY + REWRITTEN and self.leader:
        atomic.write_file_durably(self.workdir / name, data)
    self.fetched = {
        'step': step, 'url': self.store.join(objects.step_prefix(step)),
        'bytes': sum(p.stat().st_size for p in path.rglob('*') if p.is_file()),
        'seconds': round(time.monotonic() - t0, 3), 'records': sorted(records)
    }
    logging.info('fetched step %d: %.1f MB in %.1f s', step, self.fetched['bytes'] / 1e6,
                 self.fetched['seconds'])

  def attach(self, runlog: RunLog, options: CheckpointOptions, ckpt_dir: Path) -> None:
    """Starts the uploader, with the local retention rules (`options`); a local checkpoint
    newer than the remote's is queued at once."""
    self._runlog = runlog
    retention = RetentionPolicy(options.keep, options.keep_every, options.keep_best)
    if self.taken_over is not None:
      runlog.event('lease_taken_over', url=self.store.url, previous=self.taken_over)
      logging.warning('took over the stale lease of %s on %s', self.taken_over.get('host'),
                      self.store.url)
    if self.fetched is not None:
      runlog.event('fetched', **self.fetched)
    self.uploader = Uploader(
        self.store,
        retention=retention,
        lease=self.lease if self.leader else None,
        on_event=self._on_event,
        start_step=self.start_step,
        mirror=(self.workdir / EXPORTS, EXPORTS + '/') if self.leader else None,
        parts=self.parts)
    local, _ = discovery.latest_intact(ckpt_dir, checksums=False)
    if local is not None:
      step = layout.parse_step(local.name)
      self._last_local = step
      if self.start_step is None or step > self.start_step:
        self.uploader.submit(step, local, self.capture_now())
    runlog.status(remote=self.store.url, **self.status())

  def capture_now(self) -> dict[str, Any]:
    """The run's records as of now: {name: bytes, or a reader of the prefix written so far}."""
    records: dict[str, Any] = {}
    for name in APPEND_ONLY + REWRITTEN:
      path = self.workdir / name
      try:
        if name in APPEND_ONLY:
          records[name] = functools.partial(_prefix, path, path.stat().st_size)
        else:
          records[name] = path.read_bytes()
      except FileNotFoundError:
        continue
    return records

  def capture(self, step: int) -> None:
    """Called by `save(step)` before the checkpoint is handed over: these records travel with
    it."""
    if self.leader:  # the others upload their part of the state alone
      self._records[step] = self.capture_now()

  def on_commit(self, info: CommitInfo) -> None:
    self._last_local = info.step
    self.uploader.submit(info.step, info.path, self._records.pop(info.step, None))
    for step in [s for s in self._records if s < info.step]:
      del self._records[step]  # a save that failed: its records will not be needed

  def durable(self, step: int) -> bool:
    """Whether `step` is committed remotely."""
    return self.uploader is not None and self.uploader.durable(step)

  def chain(self, committed: Callable[[], bool]) -> Callable[[], bool]:
    """The automatic cadence's test that the last save is durable: `committed()` locally and,
    unless the store is failing (then local commits go on alone), uploaded."""
    return lambda: committed() and (self._last_local is None or self.uploader.error is not None or
                                    self.durable(self._last_local))

  def status(self) -> dict[str, Any]:
    remote = self.uploader.remote_step if self.uploader else self.start_step
    lag = None if self._last_local is None else self._last_local - (remote or 0)
    return {
        'remote_step': remote, 'remote_lag_steps': lag,
        'remote_error': self.uploader.error if self.uploader else None
    }

  def _on_event(self, name: str, **fields) -> None:
    if self._runlog is not None:
      self._runlog.event(name, **fields)
      self._runlog.status(**self.status())

  def finish(self, step: int | None, *, stopping: bool) -> bool:
    """Waits for `step` to be durable remotely (`stop_grace_secs` after a stop signal, else up
    to FINISH_SECS), says where each step is on stderr, releases the lease. True if durable."""
    if self.uploader is None or step is None:
      self.close()
      return False
    grace = self.config.checkpoint.stop_grace_secs if stopping else FINISH_SECS
    if not self.uploader.durable(step):
      logging.info('waiting up to %.0f s for step %d to reach %s', grace, step, self.store.url)
    done = self.uploader.wait(step, timeout=grace)
    local = self.workdir / 'checkpoints' / layout.step_dirname(step)
    where = self.store.join(objects.step_prefix(step))
    if not self.leader:  # its part; process 0 says where the whole checkpoint is
      line = (f'process {self.parts.index}: its part of step {step} is ' +
              (f'uploaded to {where}' if done else
               f'not uploaded ({self.uploader.error or f"not done within {grace:g} s"})'))
    elif done:
      line = f'step {step} is durable in {where}'
    else:
      line = (f'step {step} is committed locally only ({local}); {self.store.url} holds step '
              f'{self.uploader.remote_step}' +
              (f' ({self.uploader.error})' if self.uploader.error else ''))
    print(f'jaxckpt: {line}', file=sys.stderr, flush=True)
    if self._runlog is not None:
      self._runlog.event(
          'remote_final', step=step, durable=done, remote_step=self.uploader.remote_step)
      self._runlog.status(**self.status())
    self.close()
    return done

  def close(self) -> None:
    if self.uploader is not None:
      self.uploader.close()
    self.lease.release()


def _prefix(path: Path, size: int) -> bytes:
  with open(path, 'rb') as f:
    return f.read(size)


class _Progress:
  """Logs a long download's progress every 10 seconds."""

  def __init__(self, step: int):
    self.step, self.last = step, time.monotonic()

  def __call__(self, done: int, total: int) -> None:
    if time.monotonic() - self.last >= 10:
      self.last = time.monotonic()
      logging.info('fetching step %d: %.0f%% of %.1f MB', self.step, 100 * done / max(total, 1),
                   total / 1e6)
