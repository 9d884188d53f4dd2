"""Start-up across real jax.distributed processes (one CPU device each: with several per process
XLA's gloo collectives can hang, openxla/xla#16430): a missing process is named, never a silent
hang; a stop signal while waiting ends the process at once; a failure on one process at start
stops every process at once."""

import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import REPO, TINY, finish_processes, start_processes, subprocess_env

from jaxckpt.errors import UsageError
from jaxckpt.hosts import joining
from jaxckpt.model import data


def argv(workdir, count: int, *flags: str, ids=None):
  """`argv_of` for `start_processes`: process k gets --process_id=ids[k] (default k)."""
  return lambda k, coordinator: [
      sys.executable, '-m', 'jaxckpt.main', f'--config={TINY}', f'--workdir={workdir}', *flags,
      f'--coordinator_address={coordinator}', f'--num_processes={count}',
      f'--process_id={k if ids is None else ids[k]}'
  ]


def start_waiting_process_0(workdir, compile_cache):
  """Process 0 of 2 alone, once it waits for process 1 inside `jax.distributed.initialize`
  (its coordinator service accepts connections at its port): (the process, its command line).
  If nothing listens within 120 s, or the process exits first, it is killed and the test fails
  (a hang is a failure, never a wait)."""
  command, address = [], []

  def argv_of(k, coordinator):
    command[:], address[:] = argv(workdir, 2)(k, coordinator), [coordinator]
    return command

  [proc] = start_processes(argv_of, 1, cache=compile_cache)
  host, _, port = address[0].rpartition(':')
  deadline = time.monotonic() + 120
  while proc.poll() is None and time.monotonic() < deadline:
    try:
      with socket.create_connection((host, int(port)), timeout=1.0):
        return proc, command
    except OSError:
      time.sleep(0.05)
  proc.kill()
  raise AssertionError(f'nothing listens at {address[0]}; exit {proc.wait()}:\n'
                       f'{proc.stdout.read()[-3000:]}')


def test_a_process_that_never_starts_is_named_after_the_init_timeout(tmp_path, compile_cache):
  """Only process 0 of 2: lines while it waits, then E-DIST-005 naming process 1, exit 1."""
  # 14 s: the first waiting line comes at 10 s (`joining.REPORT_SECS`), before the timeout.
  procs = start_processes(argv(tmp_path, 2, '--init_timeout_secs=14'), 1, cache=compile_cache)
  [(code, out)] = finish_processes(procs, timeout=120)
  lines = out.strip().splitlines()
  assert code == 1, out[-3000:]
  assert lines[-1].startswith('jaxckpt: E-DIST-005: process(es) [1] of 2 did not join 127.0.0.1:')
  assert 'within 14 s' in lines[-1] and 'Traceback' not in out
  assert any('waiting for 1 of 2 processes to join 127.0.0.1:' in l and 'of 14)' in l
             for l in lines), out[-3000:]


def test_two_processes_with_the_same_id_are_named_not_a_hang(tmp_path, compile_cache):
  """A second --process_id=0 while the first waits for process 1: one line, exit 2 (JAX's
  service would share the port with it and leave both waiting, or abort one)."""
  first, command = start_waiting_process_0(tmp_path, compile_cache)  # the second: the same
  try:
    second = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(compile_cache))
    [(code, out)] = finish_processes([second], timeout=60)
  finally:
    first.kill()
  assert code == 2, out[-3000:]
  assert out.strip().splitlines()[-1].startswith('jaxckpt: E-DIST-004: --coordinator_address='
                                                 '127.0.0.1:'), out[-3000:]
  assert 'is in use on this host' in out and 'another process 0 of this job' in out


@pytest.mark.parametrize(
    'signum', [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_stop_signal_while_waiting_to_join_exits_at_once(tmp_path, compile_cache, signum):
  proc, _ = start_waiting_process_0(tmp_path, compile_cache)  # it waits, in C++
  try:
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=20)  # the init timeout is 300 s
  finally:
    proc.kill()
  name, lines = signal.Signals(signum).name, out.strip().splitlines()
  assert proc.returncode == 128 + signum, out
  assert lines[-1].startswith(f'jaxckpt: {name} while waiting to join'), out
  assert [l for l in lines if l.startswith('jaxckpt:')] == lines[-1:], out


def test_a_failure_at_start_on_one_process_stops_every_process_at_once(tmp_path, compile_cache):
  """A data source missing on host 1 only (E-DATA-001 there): process 0 stops with E-DIST-009
  quoting it, long before the barrier (600 s) or heartbeat (300 s) timeouts."""
  corpus = tmp_path / 'host0' / 'corpus.txt'
  corpus.parent.mkdir()
  corpus.write_bytes(data.embedded_corpus())
  missing = tmp_path / 'host1' / 'corpus.txt'  # the same file, not on this host's disk
  run = tmp_path / 'run'
  base = argv(run, 2, '--barrier_timeout_secs=600', '--heartbeat_timeout_secs=300')

  def argv_of(k, coordinator):
    return [*base(k, coordinator), f'--config.data.sources.main=("{[corpus, missing][k]}",)']

  procs = start_processes(argv_of, 2, cache=compile_cache)
  (code0, out0), (code1, out1) = finish_processes(procs, timeout=150)
  assert code1 == 2 and out1.strip().splitlines()[-1].startswith(
      f'jaxckpt: E-DATA-001: data source {missing} is not a file'), out1[-3000:]
  last = out0.strip().splitlines()[-1]
  assert code0 == 2, out0[-3000:]
  assert last.startswith('jaxckpt: E-DIST-009: another process stopped: [process 1] '
                         f'E-DATA-001: data source {missing} is not a file'), last
  assert 'Traceback' not in out0 + out1


# ------------------------------------------------------------------------- the pure parts
@pytest.mark.parametrize('address', [
    '127.0.0.1', 'host:', ':1234', '127.0.0.1:99999', '127.0.0.1:0', 'a b:12', '::1:1234',
    '10.0.0.1:12:34'
])
def test_an_address_that_is_not_host_port_is_refused(address):
  with pytest.raises(UsageError) as e:
    joining.check_address(address)
  assert e.value.code == 'E-DIST-004' and repr(address) in e.value.line()


@pytest.mark.parametrize('address', [None, '127.0.0.1:1234', 'host0:1', '[::1]:65535'])
def test_host_port_addresses_are_accepted(address):
  joining.check_address(address)


def test_the_waiting_line_says_what_process_0_knows():
  job = joining._Job('127.0.0.1:4321', 2, 0)
  assert job.waiting(20.2,
                     300) == 'waiting for 1 of 2 processes to join 127.0.0.1:4321 (20 s of 300)'
  assert job.not_joined(300).startswith(
      'E-DIST-005: process(es) [1] of 2 did not join 127.0.0.1:4321 within 300 s; ')
  many = joining._Job('127.0.0.1:4321', 4, 0)  # which of 3 have joined: jax.distributed is silent
  assert 'up to 3 (jax.distributed does not say how many have joined) of 4' in many.waiting(10, 60)
  assert many.not_joined(60).startswith('E-DIST-005: some of process(es) [1, 2, 3] of 4 ')


def test_a_process_whose_coordinator_is_not_there_names_process_0():
  import socket
  with socket.socket() as s:  # a port nothing listens on
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  job = joining._Job(f'127.0.0.1:{port}', 2, 1)
  assert 'waiting for process 0 of 2 (the coordinator)' in job.waiting(10, 300)
  assert job.not_joined(300).startswith('E-DIST-005: process(es) [0] of 2 did not join')


def test_join_raises_what_initialize_raised():

  def fails():
    raise ValueError('bad id')

  with pytest.raises(ValueError, match='bad id'):
    joining.join(fails, address='127.0.0.1:1', count=2, index=0, timeout_secs=5)


def test_a_hung_join_ends_at_the_timeout_with_one_line():
  """A real `join` whose initialize never returns, in a child process: E-DIST-005, exit 1."""
  code = ('import threading; from jaxckpt.hosts import joining; '
          "joining.join(threading.Event().wait, address='127.0.0.1:9', count=2, index=0, "
          'timeout_secs=1)')
  r = subprocess.run([sys.executable, '-c', code],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     timeout=60)
  assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
      'jaxckpt: E-DIST-005: process(es) [1] of 2 did not join 127.0.0.1:9 within 1 s'), r.stderr
