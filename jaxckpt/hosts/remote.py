"""The trainer's side of the remote tier (`--remote=URL`, `config.checkpoint.remote`).

- Before anything is compiled, `RemoteRun.open` checks access (a probe object written, read back
  and deleted under the prefix) and takes the prefix's lease; every failure is one line, exit 2.
- `sync_down` makes the workdir continue from the newest intact checkpoint of either tier: a
  newer remote one is downloaded (CRC-checked) with the run's records of that step (loss history,
  events, samples, bandit, status); see `jaxckpt.hosts.remote_start` for the starts it refuses and the
  damaged local copy it replaces. The checkpoint the run continues from is queued for upload.
- Durable means uploaded (or found there as it is) by this run: the steps of another history
  (the remote's, after `--resume=PATH` or a fallback to an older checkpoint) never count.
- Each checkpoint carries the records as of its `save()` (`capture`, at the call); each commit is
  handed to the background `Uploader` (`on_commit`). The last one of an invocation (the last
  step, a stop) is handed over by `finish`, with the records as they are then: its end record
  (`finished`, `interrupted`, `failed`) travels with it, so a machine that starts from the
  remote never takes a clean end for an interruption. After it (within the same grace, at least
  EVENTS_SECS), process 0 writes the run's events past its remote commits' to
  `URL/run/events.jsonl`: the end reaches the remote even when the last checkpoint does not, or
  was saved before the stop signal came (`remote_start.send_events`). `status.json` shows
  `remote_step`, `remote_lag_steps` and `remote_error`.
- `finish` gives the upload of the last checkpoint its time: `stop_grace_secs` after a stop
  signal, longer at the end of a run, and says on stderr which step is durable where.
- Across processes every one checks access and uploads its own part of each checkpoint; process
  0 holds the lease, writes the records and commits (`jaxckpt.checkpoint.remote.parts`), and
  says in the job's key-value store which step is committed remotely: a step is durable on
  every process only then, not when this process's part is up. With a workdir on each host's
  own disk, the job resumes from the newest checkpoint its disks and the remote hold between
  them, each process reading only the parts its devices need (`jaxckpt.hosts.peer_start`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from absl import logging

from jaxckpt.checkpoint import CheckpointOptions, CommitInfo, RetentionPolicy, layout
from jaxckpt.checkpoint.remote import (Lease, LeaseError, Parts, Store, StoreError, Uploader,
                                       objects, pacing)
from jaxckpt.checkpoint.remote.segments import Appended
from jaxckpt.errors import UsageError
from jaxckpt.hosts import distributed, remote_start
from jaxckpt.hosts.remote_access import check_access, open_store
from jaxckpt.hosts.upload_cadence import UploadCadence
from jaxckpt.hosts.remote_start import APPEND_ONLY, REWRITTEN
from jaxckpt.records.runlog import RunLog
from jaxckpt.records.workdir import EXPORTS

FINISH_SECS = 600.0  # how long the end of a run waits for its last upload
EVENTS_SECS = 5.0  # the least the run's events get after it, whatever the grace left
_REMOTE_STEP = 'jaxckpt/run/remote_step/'  # process 0's newest remote commit, for the others
_ASK_EVERY = 0.2  # seconds between two looks at it (the loop asks at step boundaries)


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
    self.cluster = cluster
    # The job's key-value store: the same one `durable` asks process 0's word in.
    self.parts = Parts(
        cluster.index, cluster.count, client=cluster.client()) if cluster.count > 1 else None
    on = c.get('remote_lease', 'on') == 'on'  # off: no lease object, nothing fences a 2nd writer
    self.lease = Lease(store, ttl_secs=c.remote_lease_secs) if on else None
    self.taken_over: dict[str, Any] | None = None
    self.cadence = UploadCadence(config, cluster)  # which commits go up (`--remote_every`)
    self.replicas = c.get('replicas', 0)
    self.uploader: Uploader | None = None
    self.start_step: int | None = None  # the newest intact remote step when the run started
    self.fetched: dict[str, Any] | None = None
    self.restored: dict[str, Any] | None = None  # what the peer tier supplied (`peer_start`)
    self._records: dict[int, dict[str, Any]] = {}
    self._runlog: RunLog | None = None
    self._last_local: int | None = None  # this run's newest local checkpoint
    self._submitted: Path | None = None  # the checkpoint it continues from, as queued
    self._last_records: set[int] = set()  # steps whose records are taken at `finish`
    self._held: tuple[int, Path, Any] | None = None  # the last commit, uploaded by `finish`
    self._unsent: tuple[int, Path, Any] | None = None  # the last commit, if the cadence passed it
    self._last_sent: int | None = None  # the newest step handed to the uploader
    self._covered = True  # whether the peers hold a confirmed copy of every part of the last
    self._committed: tuple[float, int | None] = (-float('inf'), None)  # process 0's word, when

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
    except BaseException as e:
      distributed.failed_at_start(e)  # the others hear of it before the last upload's grace
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
    # Each process sends its even share of the job's request rate (`--remote_rate`).
    pacing.share(cluster.count, config.checkpoint.get('remote_rate', 'auto'))
    store = open_store(url)
    lease = config.checkpoint.get('remote_lease', 'on') == 'on'
    check_access(store, conditions=lease and cluster.leader)
    run = cls(store, workdir, config, cluster)
    if not run.leader or run.lease is None:
      if run.leader:
        logging.warning('--remote_lease=off: nothing stops another trainer writing to %s too', url)
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

  def sync_down(self,
                ckpt_dir: Path,
                *,
                resume: str = 'latest',
                fetch: bool = True,
                local_too: bool = True,
                meanwhile: Callable[[], Any] | None = None) -> None:
    """Brings the workdir to the newest intact checkpoint of either tier, or refuses to start
    (`remote_start.sync_down`). Without `fetch` it only learns the remote's newest step. A
    download runs beside `meanwhile()` (the first step's compile); without `fetch`, `meanwhile()`
    runs while another process downloads into the same workdir."""
    remote_start.sync_down(
        self, ckpt_dir, resume=resume, fetch=fetch, local_too=local_too, meanwhile=meanwhile)

  def resume_point(self, ckpt_dir: Path) -> Path | None:
    """Where each host's workdir is its own disk and the peer restore found nothing whole: the
    newest intact remote checkpoint, which `sync_down` brought here whole (None: the remote
    holds none, a fresh start)."""
    if self.start_step is None:
      return None
    return ckpt_dir / layout.step_dirname(self.start_step)

  def replace_damaged(self, path: Path, ckpt_dir: Path) -> Path | None:
    """The remote's intact copy of local checkpoint `path`, which failed its checksums while it
    was restored, downloaded over it; None when the remote holds none."""
    replaced = remote_start.replace_damaged(self, path, ckpt_dir)
    if replaced is not None and self._runlog is not None:
      self._runlog.event('fetched', reason='the local copy fails its checksums', **self.fetched)
    return replaced

  def attach(self,
             runlog: RunLog,
             options: CheckpointOptions,
             ckpt_dir: Path,
             resume_dir: Path | None = None) -> None:
    """Starts the uploader, with the local retention rules (`options`); the local checkpoint
    the run continues from (`resume_dir`) is queued at once: until it is up (or found there as
    it is), nothing of this run is durable."""
    self._runlog = self.cadence.runlog = runlog
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
        mirror=(self.workdir / EXPORTS, EXPORTS + '/') if self.leader else None,
        parts=self.parts)
    if self.leader:  # what the run abandons is known at `started`: remote retention waits
      self.uploader.abandoned = None
    self._submit_start(resume_dir, ckpt_dir)
    runlog.event('remote', url=self.store.url, lease='on' if self.lease else 'off')
    runlog.status(remote=self.store.url, **self.status())

  def started(self, resumed_from: Path | None, ckpt_dir: Path, step: int) -> None:
    """The run continues from `resumed_from` (None: a fresh start) at `step`: the checkpoint the
    stop line and the cadence speak of until the next commit. A fallback to another checkpoint
    than the one `attach` queued (the one asked for was damaged) queues that one instead.
    Process 0 records the remote checkpoints above `step` as abandoned (`send_abandoned`):
    neither a fresh machine's start nor remote retention takes them for this history's."""
    if self.leader:
      self.uploader.abandoned = remote_start.send_abandoned(self, step, ckpt_dir)
    if self._submitted != resumed_from:
      self._submit_start(resumed_from, ckpt_dir)

  def _submit_start(self, path: Path | None, ckpt_dir: Path) -> None:
    self._submitted = path
    step = layout.parse_step(path.name) if path is not None else None
    if step is None or path.parent.resolve() != Path(ckpt_dir).resolve():
      self._last_local = None  # a fresh start, or a .bin: no checkpoint of this run yet
      return
    self._last_local = self._last_sent = step
    self.uploader.submit(step, path, self.capture_now())  # found there as it is: no upload
    self.cadence.started()

  def capture_now(self) -> dict[str, Any]:
    """The run's records as of now: {name: bytes, or the prefix written so far of one that only
    grows, sent by segment}."""
    records: dict[str, Any] = {}
    for name in APPEND_ONLY + REWRITTEN:
      path = self.workdir / name
      try:
        if name in APPEND_ONLY:
          records[name] = Appended.of(path)
        else:
          records[name] = path.read_bytes()
      except FileNotFoundError:
        continue
    return records

  def capture(self, step: int, *, last: bool = False) -> None:
    """Called by `save(step)` before the checkpoint is handed over: these records travel with
    it. `last`: no save follows (the last step, a stop): `finish` takes them, after the end
    record, and uploads the checkpoint then: on every process, whatever `--remote_every` says."""
    if last:
      self._last_records.add(step)
    elif self.leader:  # the others upload their part of the state alone
      self._records[step] = self.capture_now()

  def on_commit(self, info: CommitInfo) -> None:
    self._last_local, self._held, self._unsent = info.step, None, None
    for step in [s for s in self._records if s < info.step]:
      del self._records[step]  # a save that failed: its records will not be needed
    last = info.step in self._last_records
    every = self.config.checkpoint.get('keep_every', 0)  # kept for good locally: remotely too
    # A checkpoint of which some part has no confirmed replica (the same word on every process)
    # is not covered by the peers: it goes up, whatever `--remote_every` says.
    self._covered = info.replicas != 0
    if not self._covered:
      logging.warning('step %d: a part has no confirmed replica on another host (see the '
                      "writers' warnings): it is uploaded now", info.step)
      if self._runlog is not None:
        self._runlog.event('replicas_short', step=info.step, replicas=info.replicas)
    always = last or (every > 0 and info.step % every == 0) or not self._covered
    if not self.cadence.take(info.step, always=always):
      self._unsent = (info.step, info.path, info.in_memory)  # `--remote_every`: not this one
      self._records.pop(info.step, None)
      return
    self._last_sent = info.step
    if last:
      self._held = (info.step, info.path, info.in_memory)  # `finish` is moments away: the end
    else:  # record first
      self.uploader.submit(
          info.step, info.path, self._records.pop(info.step, None), memory=info.in_memory)

  def durable(self, step: int) -> bool:
    """Whether `step` is committed remotely: on a process other than 0, its part is up and
    process 0 says it committed the step (the whole checkpoint is there)."""
    if self.uploader is None or not self.uploader.durable(step):
      return False
    return self.leader or (self._leader_step() or -1) >= step

  def _leader_step(self) -> int | None:
    """Process 0's newest remote commit, as it last said (asked at most every `_ASK_EVERY`)."""
    asked, step = self._committed
    if time.monotonic() - asked >= _ASK_EVERY:
      try:
        found = self.cluster.client().key_value_dir_get(_REMOTE_STEP)
        step = max((int(v) for _, v in found), default=step)
      except Exception:  # pylint: disable=broad-except  # the runtime's own error types
        pass  # not said yet, or the coordinator is busy: ask again later
      self._committed = (time.monotonic(), step)
    return step

  def chain(self, committed: Callable[[], bool]) -> Callable[[], bool]:
    """The automatic cadence's test that the last save is durable: `committed()` locally and,
    unless the store is failing (then local commits go on alone), uploaded. With `--replicas`,
    committed alone when the peers hold a confirmed copy of every part, which covers a lost
    host; a commit they do not cover is durable once uploaded, as without replicas."""

    def uploaded() -> bool:
      return self._last_sent is None or self.uploader.error is not None or self.durable(
          self._last_sent)

    if self.replicas:
      return lambda: committed() and (self._covered or uploaded())
    return lambda: committed() and uploaded()

  def status(self) -> dict[str, Any]:
    remote = self.uploader.remote_step if self.uploader else self.start_step
    lag = None if self._last_local is None else self._last_local - (remote or 0)
    return {
        'remote_step': remote, 'remote_lag_steps': lag, 'remote_every': self.cadence.k,
        'remote_error': self.uploader.error if self.uploader else None,
        'lease': 'on' if self.lease else 'off'
    }

  def _on_event(self, name: str, **fields) -> None:
    if name == 'upload_started':  # for the remote cadence's δ_up alone: not a record
      self.cadence.upload_started()
      return
    if name == 'uploaded':
      self.cadence.uploaded(fields.get('seconds', 0.0))
    if self._runlog is not None:
      self._runlog.event(name, **fields)
      self._runlog.status(**self.status())
    if (name == 'uploaded' and self.leader and self.parts is not None
        and self.uploader.remote_step is not None):
      try:  # the others' `durable` waits for this word (after the record: it comes first)
        self.cluster.client().key_value_set(
            f'{_REMOTE_STEP}0', str(self.uploader.remote_step), allow_overwrite=True)
      except Exception as e:  # pylint: disable=broad-except  # the others wait longer, no more
        logging.warning('could not tell the other processes of remote step %s: %s',
                        fields.get('step'), e)

  def finish(self, step: int | None, *, stopping: bool) -> bool:
    """Waits for `step` to be durable remotely (`stop_grace_secs` after a stop signal, else up
    to FINISH_SECS), then (process 0) sends the run's events, says where each step is on
    stderr, releases the lease. True if `step` is durable."""
    if self.uploader is None or step is None:
      self.close()
      return False
    if self._held is not None:  # the end record is written: it travels with the last commit
      held, path, memory = self._held
      self.uploader.submit(held, path, self.capture_now(), memory=memory)
      self._held = None
    elif self._unsent is not None and self._unsent[0] == step:  # an end the loop did not see
      _, path, memory = self._unsent  # (a failure): it goes up too
      self.uploader.submit(step, path, self.capture_now(), memory=memory)
      self._last_sent, self._unsent = step, None
    grace = self.config.checkpoint.stop_grace_secs if stopping else FINISH_SECS
    deadline = time.monotonic() + grace
    if not self.uploader.durable(step):
      logging.info('waiting up to %.0f s for step %d to reach %s', grace, step, self.store.url)
    done = self.uploader.wait(step, timeout=grace)
    # After the last checkpoint's upload (it comes first): the end record, whatever got up.
    left = max(deadline - time.monotonic(), EVENTS_SECS)
    unsent = self.leader and remote_start.send_events(self, left)
    if unsent:
      logging.warning(
          'the end of this start is not in the remote (%s): a machine that starts '
          'from it sees the start end at its last checkpoint', unsent)
    local = self.workdir / 'checkpoints' / layout.step_dirname(step)
    where = self.store.join(objects.step_prefix(step))
    if not self.leader:  # its part; process 0 says where the whole checkpoint is
      line = (f'process {self.parts.index}: its part of step {step} is ' +
              (f'uploaded to {where}' if done else
               f'not uploaded ({self.uploader.error or f"not done within {grace:g} s"})'))
    elif done:
      line = f'step {step} is durable in {where}'
    else:
      held = self.uploader.remote_step  # of this run's history: another's never counts
      line = (f'step {step} is committed locally only ({local}); {self.store.url} holds ' +
              (f'step {held}' if held is not None else 'no step of this run') +
              (f' ({self.uploader.error})' if self.uploader.error else ''))
    print(f'jaxckpt: {line}', file=sys.stderr, flush=True)
    if self._runlog is not None:
      self._runlog.event(
          'remote_final',
          step=step,
          durable=done,
          remote_step=self.uploader.remote_step,
          events_sent=self.leader and not unsent)
      self._runlog.status(**self.status())
    self.close()
    return done

  def close(self) -> None:
    if self.uploader is not None:
      self.uploader.close()
    if self.lease is not None:
      self.lease.release()
