"""Joining a `jax.distributed` job without a silent hang.

`jax.distributed.initialize` blocks in C++ until every process of the job has registered with
the coordinator (process 0), and then, past its own timeout, aborts the process with a C++ stack
(exit 134). While it blocks, Python runs no signal handler on the thread that called it. So it
runs in a daemon thread here, and the main thread waits for it in short slices:

- every `REPORT_SECS` one line says what this process waits for;
- a stop signal (which the entry point's `PreemptionWatcher` turns into a flag) ends the process
  at once, 128+n, with one line: nothing has started that a stop would have to save;
- past `timeout_secs` (before JAX's own timeout) one line E-DIST-005 names the processes that did
  not join, exit 1.

Which processes have registered is known only to the coordinator, and JAX says nothing of it
until all have; what a waiting process does know: it is here, and (for a process other than 0)
whether anything answers at the coordinator's address. The lines say no more than that.
"""

from __future__ import annotations

import logging as py_logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from absl import logging

from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.errors import UsageError

REPORT_SECS = 10.0
_POLL_SECS = 0.2
# HOST:PORT; HOST a name, an IPv4 address or a bracketed IPv6 address.
_ADDRESS = re.compile(r'^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):([0-9]{1,5})$')


def check_timeouts(**timeouts: float) -> None:
  """E-CONFIG-004 (exit 2) for a timeout flag that is not a positive number of seconds: checked
  on one process as on many."""
  for name, value in timeouts.items():
    check_timeout(name, value)


def check_address(address: str | None) -> None:
  """E-DIST-004 (exit 2) unless `address` is None or HOST:PORT (JAX itself fails with an
  IndexError on a HOST alone)."""
  if address is None:
    return
  m = _ADDRESS.match(address)
  if m is None or not 0 < int(m.group(2)) < 65536:
    raise UsageError(
        'E-DIST-004', f'--coordinator_address={address!r} is not HOST:PORT',
        'pass the address of process 0 and a free port on it, the same on every process, '
        'e.g. --coordinator_address=10.0.0.1:1234 (or [::1]:1234)')


_TIMEOUT_DEFAULTS = {
    'init_timeout_secs': 300, 'heartbeat_timeout_secs': 60, 'barrier_timeout_secs': 600
}

# The watchdog posts a sign of life every 0.2 s at best (`watchdog.Watchdog.period`): a shorter
# silence than this is no sign of a lost process, and a healthy job would stop at once.
_TIMEOUT_FLOORS = {'heartbeat_timeout_secs': 1.0}


def check_timeout(name: str, value: float) -> None:
  """E-CONFIG-004 (exit 2) unless `value` is a positive, finite number of seconds, and at least
  the flag's floor where it has one (`--heartbeat_timeout_secs`: 1 s)."""
  example = f'e.g. --{name}={_TIMEOUT_DEFAULTS.get(name, 300)}'
  if not 0 < value < math.inf:  # NaN and inf are no time to wait
    raise UsageError('E-CONFIG-004', f'--{name}={value:g} is not a positive number of seconds',
                     f'pass a number of seconds > 0, {example}')
  floor = _TIMEOUT_FLOORS.get(name)
  if floor is not None and value < floor:
    raise UsageError(
        'E-CONFIG-004', f'--{name}={value:g} is below its floor of {floor:g} s (the processes '
        'post signs of life every 0.2 s at best: a healthy job would be found lost)',
        f'pass {floor:g} s or more, {example}')


_JOB_FIX = ('pass --coordinator_address=HOST:PORT, --num_processes=N and --process_id=0..N-1 on '
            'every process (or none of them, for one process)')


def check_job(address: str | None, count: int | None, index: int | None) -> None:
  """E-DIST-004 (exit 2) for the job flags (`address`: --coordinator_address, None when not
  given) when they describe no job: a count that is not positive, a process id outside
  0..count-1, or (where JAX detects no cluster to fill them in) some of --coordinator_address
  (or JAX_COORDINATOR_ADDRESS), --num_processes and --process_id without the others."""
  if count is not None and count < 1:
    raise UsageError('E-DIST-004', f'--num_processes={count} is not a process count',
                     'pass the number of processes in the job, 1 or more, the same on every one')
  if index is not None and index < 0:
    last = f'{count - 1}' if count is not None else 'N-1'
    raise UsageError('E-DIST-004', f'--process_id={index} is negative',
                     f"pass this process's place in the job, 0..{last}, each once")
  if count is not None and index is not None and index >= count:
    raise UsageError('E-DIST-004', f'--process_id={index} is not below --num_processes={count}',
                     f'number the processes 0..{count - 1}, each once')
  if _cluster_env():
    return  # JAX fills in what the flags leave out
  flags = (('coordinator_address', address), ('num_processes', count), ('process_id', index))
  given = [f'--{name}={value}' for name, value in flags if value is not None]
  missing = [f'--{name}' for name, value in flags if value is None]
  env_address = os.environ.get('JAX_COORDINATOR_ADDRESS')
  if address is None and env_address:
    given.insert(0, f'JAX_COORDINATOR_ADDRESS={env_address}')
    missing.remove('--coordinator_address')
  if missing:
    raise UsageError('E-DIST-004', f'{" ".join(given)} without {" and ".join(missing)}', _JOB_FIX)


class _Job:
  """What this process knows of the job it joins: for the lines it prints."""

  def __init__(self, address: str | None, count: int | None, index: int | None):
    self.address, self.count, self.index = address, count, index

  def others(self) -> list[int]:
    return [k for k in range(self.count or 0) if k != self.index]

  def coordinator_answers(self) -> bool:
    """Whether anything accepts a connection at the coordinator's address (the service of
    process 0 listens there once that process has started)."""
    host, _, port = self.address.rpartition(':')
    try:
      with socket.create_connection((host.strip('[]'), int(port)), timeout=1.0):
        return True
    except OSError:
      return False

  def waiting(self, elapsed: float, timeout: float) -> str:
    at = f'({elapsed:.0f} s of {timeout:g})'
    if self.address is None or self.count is None or self.index is None:
      return f'waiting to join the jax.distributed job the environment describes {at}'
    if self.index != 0 and not self.coordinator_answers():
      return (f'waiting for process 0 of {self.count} (the coordinator) at {self.address}: '
              f'nothing answers there yet {at}')
    return (f'waiting for {self._missing()} of {self.count} processes to join {self.address} {at}')

  def _missing(self) -> str:
    # Process 0 registers itself as it starts the service: of 2, the one missing is the other.
    others = len(self.others())
    if self.index == 0 and others == 1:
      return '1'
    return f'up to {others} (jax.distributed does not say how many have joined)'

  def not_joined(self, timeout: float) -> str:
    fix = ('start every process of the job, each --process_id once (0..N-1), with the same '
           '--coordinator_address and --num_processes; or raise --init_timeout_secs')
    if self.address is None or self.count is None or self.index is None:
      return (f'E-DIST-005: the jax.distributed job was not joined within {timeout:g} s; '
              f'{fix}')
    if self.index != 0 and not self.coordinator_answers():
      return (f'E-DIST-005: process(es) [0] of {self.count} did not join within {timeout:g} s '
              f'(nothing answers at {self.address}, its address); {fix}')
    some = '' if self.index == 0 and len(self.others()) == 1 else 'some of '
    which = '' if not some else ' (jax.distributed does not say which)'
    taken = '' if self.index == 0 else f', or --process_id={self.index} is taken by another'
    return (f'E-DIST-005: {some}process(es) {self.others()} of {self.count} did not join '
            f'{self.address} within {timeout:g} s{which}{taken}; {fix}')


def join(initialize: Callable[[], None],
         *,
         address: str | None,
         count: int | None,
         index: int | None,
         timeout_secs: float,
         stop_signal: Callable[[], int | None] = lambda: None) -> None:
  """`initialize()` (a `jax.distributed.initialize` whose own timeout is longer than
  `timeout_secs`), waited for as the module docstring says. Its exceptions are raised here."""
  job = _Job(address, count, index)
  if index == 0 and address is not None:
    _check_port_free(address)
  raised: list[BaseException] = []

  def run():
    try:
      initialize()
    except BaseException as e:  # pylint: disable=broad-except  # raised on the main thread
      raised.append(e)

  thread = threading.Thread(target=run, name='jaxckpt-join', daemon=True)
  start = time.monotonic()
  thread.start()
  reported = start
  while True:
    thread.join(_POLL_SECS)  # a signal's handler runs on this thread meanwhile
    if not thread.is_alive():
      break
    now = time.monotonic()
    signum = stop_signal()
    if signum is not None:
      _exit(
          f'{signal.Signals(signum).name} while waiting to join the jax.distributed job '
          f'({now - start:.0f} s): exiting now, nothing had started', 128 + signum)
    if now - start >= timeout_secs:
      _exit(job.not_joined(timeout_secs), 1)
    if now - reported >= REPORT_SECS:
      reported = now
      logging.info('%s', job.waiting(now - start, timeout_secs))
  if raised:
    raise raised[0]


def _check_port_free(address: str) -> None:
  """E-DIST-004 when something listens on the coordinator's port here already. JAX's service
  shares a port with another listener (SO_REUSEPORT): a second process 0 would wait, or abort."""
  port = int(address.rpartition(':')[2])
  try:
    s = socket.socket(socket.AF_INET6)  # '' is then every address, IPv4 ones too
  except OSError:  # a host without IPv6
    s = socket.socket(socket.AF_INET)
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed one's TIME_WAIT is fine
    try:
      s.bind(('', port))
    except OSError as e:
      raise UsageError(
          'E-DIST-004', f'--coordinator_address={address}: port {port} is in use on this host '
          f'({e.strerror}): another process 0 of this job, or another program, listens there',
          'start one process per --process_id; or give the job a free port') from None


LEAVE_SECS = 30.0  # each wait of `leave`: for the others to say so, then JAX's shutdown


def leave(cluster, prefix: str, code: int) -> None:
  """Exit `code` once every process of a job that failed at start is leaving too. Each says so
  under `prefix` and waits (LEAVE_SECS at most: a loaded machine can take seconds to unwind)
  for the others; then all take JAX's own shutdown together, whose barrier passes at once and
  which disconnects each from the coordinator before process 0 (where it lives) goes. Without
  that, a process still connected when process 0 exits aborts with a C++ stack (exit 134).
  Where one never says so, JAX's shutdown would wait for it: this process exits without it."""
  together = False
  try:
    client = cluster.client()
    client.key_value_set(f'{prefix}/{cluster.index}', 'gone', allow_overwrite=True)
    deadline = time.monotonic() + LEAVE_SECS  # one for all: past it, each read is 1 ms
    silent = []
    for k in (k for k in range(cluster.count) if k != cluster.index):
      try:
        client.blocking_key_value_get(f'{prefix}/{k}',
                                      int(max(1, 1000 * (deadline - time.monotonic()))))
      except Exception:  # pylint: disable=broad-except  # not leaving in time: named below
        silent.append(k)
    together = not silent
    if silent:
      print(
          f'jaxckpt: process(es) {silent} of {cluster.count} did not say they were leaving within '
          f"{LEAVE_SECS:g} s: exiting without them (and without JAX's shutdown, which would wait "
          'for them)',
          file=sys.stderr,
          flush=True)
  except Exception:  # pylint: disable=broad-except  # the coordinator is gone: exit anyway
    pass
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  if together:  # bounded: a process that died since it said so would hold the barrier
    shutdown = threading.Thread(target=_jax_shutdown, name='jaxckpt-leave', daemon=True)
    shutdown.start()
    shutdown.join(LEAVE_SECS)
    if shutdown.is_alive():
      print(
          f"jaxckpt: JAX's shutdown barrier did not pass within {LEAVE_SECS:g} s (a process "
          'of this job died as it left): exiting without it',
          file=sys.stderr,
          flush=True)
  os._exit(code)  # pylint: disable=protected-access


def _jax_shutdown() -> None:
  import jax  # pylint: disable=import-outside-toplevel  # joined: imported already
  try:
    jax.distributed.shutdown()
  except Exception:  # pylint: disable=broad-except  # the coordinator went first: exit anyway
    pass


def _exit(line: str, code: int) -> None:
  """One line, then exit: the join thread is inside C++ and cannot be stopped, and JAX's exit
  handlers would wait for the job it never joined."""
  sys.stdout.flush()
  print(f'jaxckpt: {line}', file=sys.stderr, flush=True)
  os._exit(code)  # pylint: disable=protected-access


def cluster_detected() -> bool:
  """Whether JAX sees a cluster it can join by itself (TPU pod VMs, SLURM, Open MPI, ...)."""
  return bool(os.environ.get('JAX_COORDINATOR_ADDRESS')) or _cluster_env()


def _cluster_env() -> bool:
  """Whether the environment is a cluster's that JAX reads the job from (not only an address)."""
  try:
    from jax._src import clusters  # pylint: disable=import-outside-toplevel
    return any(env.is_env_present()
               for env in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
               if not env.opt_in_only_method)
  except Exception:  # pylint: disable=broad-except  # a private API: no detection, no job
    return False


class Prefix(py_logging.Filter):
  """Starts each log line with the process's place in the job."""

  def __init__(self, prefix: str):
    super().__init__()
    self.prefix = prefix

  def filter(self, record: py_logging.LogRecord) -> bool:
    if not str(record.msg).startswith(self.prefix):
      record.msg = self.prefix + str(record.msg)
    return True


def shared_workdir(cluster, workdir: Path, *, remote: bool, config) -> bool:
  """Whether every process sees `workdir` (its checkpoints) as one filesystem. Where it is each
  host's own disk, each host's part of a checkpoint stays there: only with --remote (which holds
  them whole) and jaxckpt's own files (one per process) can the run go on; otherwise E-DIST-007,
  exit 2."""
  if cluster.count == 1:
    return True
  from jaxckpt.checkpoint.multihost import Group  # pylint: disable=import-outside-toplevel
  from jaxckpt.records.workdir import checkpoints_dir  # pylint: disable=import-outside-toplevel
  try:
    if Group(cluster.timeout_secs).open(checkpoints_dir(workdir)):
      return True
  except CheckpointError as e:
    if e.code != 'E-DIST-007':
      raise
    raise UsageError(e.code, f'--workdir={workdir}: {e.what}', e.fix) from None
  storage = config.checkpoint.get('storage', 'auto')
  if not remote or storage == 'orbax':
    why = 'storage=orbax needs one filesystem' if remote else 'there is no --remote'
    raise UsageError(
        'E-DIST-007', f'--workdir={workdir} is not one filesystem across the {cluster.count} '
        f"processes (process 0's files there are not seen by every process) and {why}",
        'put the workdir on a filesystem every host mounts, or add --remote=URL: each host then '
        'keeps and uploads its own part, and a restart resumes from the remote')
  logging.info(
      "the workdir is on each host's own disk: each uploads its own part; a restart "
      'resumes from %s', config.checkpoint.remote)
  return False
