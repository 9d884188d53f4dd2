"""One run across many processes (`jax.distributed`): start-up, one lock, agreed stops.

    # on each of N hosts (or let JAX find the cluster: TPU VMs, SLURM, Open MPI)
    python -m jaxckpt.main --config=... --workdir=/shared/run \\
        --coordinator_address=host0:1234 --num_processes=N --process_id=K

- Start-up: `initialize` joins the job; the mesh then spans every process's devices. Each
  process's log lines start with `[K/N]`.
- Records: process 0 holds the workdir lock and writes `status.json`, `events.jsonl`, the loss
  history and the phase satellites (`run_log`); the others wait for its lock and write none.
- Agreement (`jaxckpt.hosts.agreement`): stops and saves happen after the same step on every process.
- A lost process (`jaxckpt.hosts.watchdog`): each process leaves a sign of life in the key-value
  store, process 0 reads them all; one silent for `--heartbeat_timeout_secs` is lost, and every
  other process stops within that time with E-DIST-006 naming it (process 0's verdict). A save in flight is never committed without its part.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Callable

from absl import logging

from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.errors import JaxckptError, UsageError, exit_code
from jaxckpt.hosts import joining
from jaxckpt.hosts.watchdog import _AT_START, _PREFIX, Watchdog, _peer_stopped, _records
from jaxckpt.records.runlog import RunLog
from jaxckpt.records.workdir import WorkdirLock


@dataclasses.dataclass(frozen=True)
class Cluster:
  """This process's place in the job: `index` of `count` processes."""
  index: int = 0
  count: int = 1
  timeout_secs: float = 600.0  # waits for the other processes (a save's barrier, a round)
  heartbeat_secs: float = 60.0  # a process silent this long is lost

  @property
  def leader(self) -> bool:
    return self.index == 0

  def client(self):
    from jaxckpt.checkpoint.multihost import client  # pylint: disable=import-outside-toplevel
    return client()


_cluster = Cluster()
_watchdog: 'Watchdog | None' = None
_closing: list[Callable[[], None]] = []  # threads of this process that talk to the coordinator
_failed = False  # this process stops for an error: the others need not wait for it
_starting = False  # within `startup()`, before `started()`
_exit_code: int | None = None  # this process failed at start, and exits with this


def current() -> Cluster:
  return _cluster


def leader() -> bool:
  """Whether this process writes the run's records (process 0, or the only one)."""
  return _cluster.leader


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               *,
               heartbeat_timeout_seconds: float = 60.0,
               timeout_secs: float = 600.0,
               init_timeout_secs: float = 300.0,
               stop_signal: Callable[[], int | None] = lambda: None,
               on_lost: Callable[[str], None] | None = None) -> Cluster:
  """Join the `jax.distributed` job the flags (or the cluster's environment) describe.

  Without flags and outside a detected cluster this is one process, as always. Call it before
  anything touches the devices. While the other processes are awaited (`jaxckpt.hosts.joining`): a
  line every 10 s, E-DIST-005 and exit 1 past `init_timeout_secs`, and a stop signal (that
  `stop_signal()` returns) ends the process at once.
  """
  global _cluster
  joining.check_timeouts(  # on one process too: the flags' names, for their errors
      init_timeout_secs=init_timeout_secs,
      barrier_timeout_secs=timeout_secs,
      heartbeat_timeout_secs=heartbeat_timeout_seconds)
  asked = any(v is not None for v in (coordinator_address, num_processes, process_id))
  if not asked and not joining.cluster_detected():
    return _cluster
  address = coordinator_address or os.environ.get('JAX_COORDINATOR_ADDRESS')
  joining.check_address(address)
  joining.check_job(coordinator_address, num_processes, process_id)
  import jax  # pylint: disable=import-outside-toplevel
  # Stops are agreed here (`Agreement`); JAX's own preemption service would take SIGTERM away
  # from the trainer's handler.
  jax.config.update('jax_enable_preemption_service', False)
  if jax.config.jax_cpu_collectives_implementation in (None, '', 'none'):
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')  # CPU hosts talk via gloo
  try:
    # JAX's own heartbeat is the backstop: the watchdog below names a lost process first. Its
    # join timeout too: past it, it aborts; `joining` says who is missing before that.
    joining.join(
        lambda: jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            heartbeat_timeout_seconds=int(2 * heartbeat_timeout_seconds + 10),
            initialization_timeout=int(init_timeout_secs + 60)),
        address=address,
        count=num_processes,
        index=process_id,
        timeout_secs=init_timeout_secs,
        stop_signal=stop_signal)
  except (ValueError, TypeError, RuntimeError) as e:
    raise UsageError(
        'E-DIST-004', f'cannot join the jax.distributed job: {" ".join(str(e).split())}',
        'pass --coordinator_address=HOST:PORT, --num_processes and --process_id on '
        'every process (or run where JAX detects the cluster)') from None
  _cluster = Cluster(jax.process_index(), jax.process_count(), timeout_secs,
                     heartbeat_timeout_seconds)
  logging.get_absl_handler().addFilter(joining.Prefix(f'[{_cluster.index}/{_cluster.count}] '))
  if _cluster.count > 1:
    global _watchdog
    _watchdog = Watchdog(_cluster, on_lost)
    _watchdog.start()
    atexit.register(_shutdown)  # after JAX's own: runs before it, while the client still works
  return _cluster


def _shutdown() -> None:
  """Stop this process's threads that talk to the coordinator, then say how it ended: 'done'
  (the others never count it lost) or 'failed' (they stop at once, naming it)."""
  for close in _closing:
    close()
  if _watchdog is not None:
    _watchdog.finish(_failed)
    if _exit_code is not None:  # failed at start: no orderly end (`joining.leave`)
      joining.leave(_cluster, f'{_PREFIX}/gone', _exit_code)


def on_exit(close: Callable[[], None]) -> None:
  """Call `close` (which stops a thread that talks to the coordinator) before JAX shuts down."""
  _closing.append(close)


def explain(error: BaseException) -> None:
  """Called when `error` stopped the run. A collective whose peer died fails at once, with the
  transport's words: when a process was lost, wait (a heartbeat timeout at most) for the
  watchdog to say which, and stop with E-DIST-006; otherwise return."""
  global _failed
  _failed = True
  if _watchdog is not None and not isinstance(error, (JaxckptError, KeyboardInterrupt)):
    _watchdog.lost.wait(_cluster.heartbeat_secs + 3 * _watchdog.period)


@contextlib.contextmanager
def startup():
  """Start-up, from the lock to the first step. Any error here (not only a CheckpointError: ENOSPC,
  PermissionError, ValueError) is this process's last word: the others stop at once with
  E-DIST-009 quoting it, wherever they wait, not at --barrier_timeout_secs."""
  global _starting
  _starting = True
  try:
    yield
  except BaseException as e:
    failed_at_start(e)
    raise
  finally:
    _starting = False


def failed_at_start(e: BaseException) -> None:
  """Within `startup()`: tell the others now that `e` stops this process (once; before slow
  clean-up such as a last upload's grace)."""
  global _exit_code
  if _starting and _exit_code is None:
    _exit_code = exit_code(e) if isinstance(e, CheckpointError) else 1  # as the entry point
    echo = isinstance(e, CheckpointError) and e.code == 'E-DIST-009'  # stopped by another
    line = e.line() if isinstance(e, CheckpointError) else f'{type(e).__name__}: {e}'
    failing('' if echo else _AT_START + ' '.join(line.split())[:300])


def started() -> None:
  """Start-up is over: a failure from here on is a lost process to the others (E-DIST-006)."""
  global _starting
  _starting = False


def failing(why: str = '') -> None:
  """This process stops for an error: it tells the others now (they stop at once), not at exit."""
  global _failed
  _failed = True
  if _watchdog is not None:
    _watchdog.finish(True, why)


# ----------------------------------------------------------------------------- records
class _FollowerLog(RunLog):
  """The run log of a process other than 0: it reads what process 0 writes, writes nothing."""

  def _append(self, name, rows, *, sync):
    pass

  def status(self, **fields: Any) -> None:
    pass


def run_log(workdir: str | os.PathLike) -> RunLog:
  """The run's records: written by process 0 (or the only process), by no other."""
  log = RunLog(workdir) if leader() else _FollowerLog(workdir)
  if _cluster.count > 1:
    _records[:] = [log]
  return log


class _Follower:
  """What a process other than 0 holds instead of the lock: process 0's word that it has it."""
  previous_holder = None

  def __init__(self, workdir: Path):
    self.workdir = workdir

  def __enter__(self):
    word = wait_word(_cluster, f'{_PREFIX}/lock', "the workdir lock (process 0's word)")
    if word != 'ok':
      raise UsageError('E-LOCK-001', f'process 0 could not take the lock of {self.workdir}: {word}',
                       'one workdir has one run (of any number of processes)')
    return self

  def __exit__(self, *exc):
    pass


class _Leader(WorkdirLock):
  """Process 0's lock, and its word to the others."""

  def __enter__(self):
    try:
      lock = super().__enter__()
    except JaxckptError as e:
      _cluster.client().key_value_set(f'{_PREFIX}/lock', e.line(), allow_overwrite=True)
      raise
    _cluster.client().key_value_set(f'{_PREFIX}/lock', 'ok', allow_overwrite=True)
    return lock


def run_lock(workdir: str | os.PathLike):
  """`WorkdirLock(workdir)`; across processes process 0 takes it and the others wait for it."""
  if _cluster.count == 1:
    return WorkdirLock(workdir)
  return _Leader(workdir) if leader() else _Follower(Path(workdir))


def first_problem(name: str,
                  problem: str | None,
                  timeout: float | None = None,
                  cluster: Cluster | None = None) -> str | None:
  """This process's `problem` (None: none) or, across processes, the first any one of them
  reports under `name`: the same answer on every process. `timeout`: how long a process waits
  for the others (default `--barrier_timeout_secs`)."""
  cluster = cluster or _cluster
  if cluster.count == 1:
    return problem
  first = lambda values: next((v for v in values if v), '')
  return _decide(name, problem or '', first, timeout, cluster) or None


def _decide(name: str,
            value: str,
            decide: Callable[[list[str]], str],
            timeout: float | None = None,
            cluster: Cluster | None = None) -> str:
  """Post this process's `value` under `name`; `decide(every process's, in process order)`, the
  same on every process. Process 0 gathers the values and posts its decision: each other
  process sends one value and reads one answer, whatever the process count. One deadline for
  all the values process 0 waits for."""
  cluster = cluster or _cluster
  client, key = cluster.client(), f'{_PREFIX}/{name}'
  deadline = time.monotonic() + (timeout or cluster.timeout_secs)
  if not cluster.leader:
    client.key_value_set(f'{key}/{cluster.index}', value, allow_overwrite=True)
    return wait_word(cluster, f'{key}/answer', f"{name} (process 0's answer)", deadline)
  values = [value] + [
      wait_word(cluster, f'{key}/{k}', f'{name} (process {k})', deadline)
      for k in range(1, cluster.count)
  ]
  answer = decide(values)
  client.key_value_set(f'{key}/answer', answer, allow_overwrite=True)
  return answer


def together(name: str,
             fn: Callable[[], Any],
             undo: Callable[[Any], None] = lambda r: None,
             timeout: float | None = None):
  """`fn()` on every process. An error on any one stops them all at once, instead of leaving
  the others waiting for it: that process raises its own, the others E-DIST-009 quoting it
  (after `undo(what fn returned)` on them). `timeout`: as `first_problem`'s (a longer `fn`)."""
  try:
    result, problem = fn(), None
  except CheckpointError as e:
    result, problem = None, e
  other = first_problem(name, problem and problem.line(), timeout)
  if problem is not None:
    raise problem
  if other is not None:
    undo(result)
    raise UsageError('E-DIST-009', f'another process stopped: {other}',
                     'fix what that line says, then start every process again')
  return result


_SAME_CHECKPOINTS = ("every host's workdir must hold the same checkpoints: one shared filesystem, "
                     'or --remote (README: Many hosts)')


def agree(name: str, value: str, what: str, fix: str = _SAME_CHECKPOINTS) -> None:
  """E-DIST-008 unless every process has the same `value` of `what`."""
  if _cluster.count == 1:
    return

  def differences(values: list[str]) -> str:  # on process 0: '' when all agree
    return '' if len(set(values)) == 1 else ', '.join(
        f'process {k}: {v}' for k, v in enumerate(values))

  disagree = _decide(name, value, differences)
  if disagree:
    raise JaxckptError('E-DIST-008', f'the processes disagree on {what}: {disagree}', fix)


DOWNLOAD_FLOOR = 10e6  # bytes/s: the slowest download a wait for process 0's is sized for


def download_secs(nbytes: int) -> float:
  """How long the other processes wait for process 0's start-up download of an `nbytes` state:
  `--barrier_timeout_secs` plus that state at DOWNLOAD_FLOOR (a download that stops moving is
  the download's own error, E-STORE-016, long before)."""
  return _cluster.timeout_secs + nbytes / DOWNLOAD_FLOOR


def shared_workdir(workdir: Path, *, remote: bool, config) -> bool:
  """Whether every process sees `workdir` as one filesystem (`joining.shared_workdir`)."""
  return joining.shared_workdir(_cluster, workdir, remote=remote, config=config)


def wait_word(cluster: Cluster, key: str, what: str, deadline: float | None = None) -> str:
  """The value another process posts at `key` (`what`: which process, and what of), waited for
  until `deadline` (a `time.monotonic()`; default `cluster.timeout_secs` from now), in slices: a
  process that failed at start (`Watchdog`) ends the wait at once. E-DIST-005 names `what`, how
  long it was waited for and why the wait ended."""
  began = time.monotonic()
  deadline = began + cluster.timeout_secs if deadline is None else deadline
  while True:
    if _peer_stopped:
      raise UsageError('E-DIST-009', _peer_stopped[0],
                       'fix what that line says, then start every process again')
    left = deadline - time.monotonic()
    try:
      return cluster.client().blocking_key_value_get(key, int(max(0.05, min(0.5, left)) * 1000))
    except Exception as e:  # pylint: disable=broad-except  # the runtime's own error types
      if 'DEADLINE_EXCEEDED' in str(e) and left > 0.5:
        continue
      error = e
      break
  waited = time.monotonic() - began
  why = 'no answer in time' if 'DEADLINE_EXCEEDED' in str(error) else 'the store failed'
  raise JaxckptError(
      'E-DIST-005', f'waited {waited:.1f} s for {what} ({why}: '
      f'{" ".join(str(error).split())[:160]})', 'start every process of the job (same flags but '
      '--process_id); a lost one is named by the others; a slow one: raise --barrier_timeout_secs')
