"""`python -m jaxckpt.main` as one run of 2 and 4 real jax.distributed processes (CPU, gloo).

Each process has one CPU device; the mesh spans them all (data parallel), and process 0 writes
the run's records while every process writes its shards of each checkpoint.
"""

import json
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import (TINY, TWO_PROCESS_FLAGS, assert_same_bytes, committed_steps, events_of,
                      finish_processes, losses, start_processes, wait_for)


def launch(cache, workdir, count: int, *flags: str):
  return start_processes(
      lambda k, coordinator: [
          sys.executable, '-m', 'jaxckpt.main', f'--config={TINY}', f'--workdir={workdir}',
          '--config.train.log_every=5', *flags, f'--coordinator_address={coordinator}',
          f'--num_processes={count}', f'--process_id={k}'
      ],
      count,
      cache=cache)


def train(cache, workdir, count: int, *flags: str, timeout: float = 240):
  results = finish_processes(launch(cache, workdir, count, *flags), timeout)
  for k, (code, out) in enumerate(results):
    assert code == 0, f'process {k} exited {code}:\n{out[-3000:]}'
  return results


def launch_training(cache, workdir):
  """2 processes of a long run, returned once they are past step 5."""
  procs = launch(cache, workdir, 2, '--config.train.steps=100000', '--checkpoint_every=0')
  status = Path(workdir) / 'status.json'
  wait_for(
      lambda: status.exists() and json.loads(status.read_text()).get('step', 0) >= 5,
      procs[0],
      timeout=180)
  return procs


def arrays(workdir, step: int):
  from jaxckpt.checkpoint.formats import read_host_arrays
  return read_host_arrays(Path(workdir) / 'checkpoints' / f'step_{step:08d}')


def manifest(workdir, step: int) -> dict:
  return json.loads((Path(workdir) / 'checkpoints' / f'step_{step:08d}/manifest.json').read_text())


@pytest.fixture(scope='module')
def ten_steps(tmp_path_factory, compile_cache) -> Path:
  """A run of 10 steps on 2 processes, a checkpoint every 5. Each test works on its own copy."""
  workdir = tmp_path_factory.mktemp('ten-steps')
  train(compile_cache, workdir, 2, '--config.train.steps=10', '--checkpoint_every=5')
  return workdir


def test_sigkill_of_every_process_then_the_same_command_is_bit_identical(
    tmp_path, compile_cache, straight_two_processes):
  flags = ('--config.train.steps=60', '--checkpoint_every=5')
  # The straight run is the session's: these flags and `launch`'s log_every=5, never stopped.
  assert sorted(('--config.train.log_every=5', *flags)) == sorted(TWO_PROCESS_FLAGS)
  straight, results = straight_two_processes
  stopped = tmp_path / 'stopped'
  assert all(f'[{k}/2] step 60/60' in out for k, (_, out) in enumerate(results))
  procs = launch(compile_cache, stopped, 2, *flags)
  wait_for(lambda: committed_steps(stopped), procs[0], timeout=180)
  for p in procs:
    p.kill()
  finish_processes(procs)
  killed_at = max(committed_steps(stopped))
  again = train(compile_cache, stopped, 2, *flags)
  assert events_of(stopped, 'resumed')[0]['step'] == killed_at < 60
  # Each process says it reads its byte ranges while its first step compiles (that it does:
  # tests/test_multihost.py).
  assert all('compiling the train step while the checkpoint is read' in out for _, out in again)
  assert_same_bytes(arrays(stopped, 60), arrays(straight, 60))
  assert losses(stopped) == losses(straight)
  assert manifest(
      stopped, 60)['state_files'] == ['state/process_0.safetensors', 'state/process_1.safetensors']
  assert json.loads((stopped / 'status.json').read_text())['processes'] == 2


def test_sigterm_to_one_process_stops_all_after_the_same_step(tmp_path, compile_cache):
  procs = launch_training(compile_cache, tmp_path)
  procs[1].send_signal(signal.SIGTERM)
  results = finish_processes(procs, timeout=120)
  lines = [
      [l for l in out.splitlines() if 'interrupted by SIGTERM at step' in l] for _, out in results
  ]
  assert [code for code, _ in results] == [143, 143], [out[-2000:] for _, out in results]
  steps = {re.search(r'interrupted by SIGTERM at step (\d+)', line[-1])[1] for line in lines}
  assert len(steps) == 1, lines
  step = int(steps.pop())
  assert committed_steps(tmp_path) == [step]  # one checkpoint, of that step, from both
  assert len(manifest(tmp_path, step)['state_files']) == 2
  assert events_of(tmp_path, 'interrupted')[-1]['step'] == step
  assert json.loads((tmp_path / 'status.json').read_text())['state'] == 'interrupted'


def test_two_processes_then_one_continue_the_run(tmp_path, compile_cache, ten_steps):
  """The trainer resumes on another process count (4 -> 2 -> 1 processes, at the library's
  level: tests/test_multihost.py)."""
  tmp_path = shutil.copytree(ten_steps, tmp_path / 'run')  # 10 steps on 2 processes
  saved = arrays(tmp_path, 10)
  assert len(manifest(tmp_path, 10)['state_files']) == 2
  train(compile_cache, tmp_path, 1, '--config.train.steps=20', '--checkpoint_every=10')
  assert_same_bytes(arrays(tmp_path, 10), saved)  # untouched by the resume
  started = events_of(tmp_path, 'started')
  assert [(e['step'], e['processes']) for e in started] == [(0, 2), (10, 1)]
  assert committed_steps(tmp_path) == [5, 10, 20]  # 5 and 10 from 2 processes, 20 from 1
  assert 'state_files' not in manifest(tmp_path, 20)  # one process: the single file, as ever
  assert sorted(losses(tmp_path)) == list(range(1, 21))


def test_sigkill_of_one_process_stops_the_others_and_the_rerun_resumes(tmp_path, compile_cache):
  flags = ('--config.train.steps=100000', '--checkpoint_every=5', '--heartbeat_timeout_secs=3')
  procs = launch(compile_cache, tmp_path, 2, *flags)
  wait_for(lambda: committed_steps(tmp_path), procs[0], timeout=180)
  procs[1].kill()
  killed = time.monotonic()
  (code, out), _ = finish_processes(procs, timeout=60)
  assert code != 0 and time.monotonic() - killed < 30, out[-3000:]
  assert 'E-DIST-006: process(es) [1] of 2 lost' in out, out[-3000:]
  from jaxckpt.checkpoint import discovery
  steps = committed_steps(tmp_path)
  for step in steps:  # whatever was committed is whole: both parts, every checksum
    step_dir = tmp_path / 'checkpoints' / f'step_{step:08d}'
    assert discovery.problems(step_dir) == [] and len(manifest(tmp_path, step)['state_files']) == 2
  assert json.loads((tmp_path / 'status.json').read_text())['state'] == 'failed'
  train(compile_cache, tmp_path, 2, '--config.train.steps=' + str(max(steps) + 5),
        '--checkpoint_every=5')
  assert events_of(tmp_path, 'resumed')[-1]['step'] == max(steps)


def test_a_shard_damaged_on_disk_is_passed_over_by_every_process(tmp_path, compile_cache,
                                                                 ten_steps):
  tmp_path = shutil.copytree(ten_steps, tmp_path / 'run')  # 10 steps on 2 processes
  from jaxckpt.checkpoint import statefile
  path = tmp_path / 'checkpoints/step_00000010/state/process_1.safetensors'
  header_len, entries, _ = statefile.read_header(path)
  with open(path, 'r+b') as f:  # one bit of process 1's largest shard, as a bad disk would
    begin, end = max((e['data_offsets'] for e in entries.values()), key=lambda o: o[1] - o[0])
    f.seek(header_len + (begin + end) // 2)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0x10]))
  train(compile_cache, tmp_path, 2, '--config.train.steps=15', '--checkpoint_every=5')
  assert [e['step'] for e in events_of(tmp_path, 'resumed')] == [5]  # once, by all, from 5
  assert 15 in committed_steps(tmp_path)


@pytest.mark.slow  # orbax across processes: tests/test_multihost.py, at the library's level
def test_orbax_storage_across_two_processes_saves_and_resumes(tmp_path, compile_cache):
  flags = ('--config.checkpoint.storage=orbax', '--checkpoint_every=5')
  train(compile_cache, tmp_path, 2, '--config.train.steps=10', *flags)
  assert manifest(tmp_path, 10)['storage'] == 'orbax'
  saved = arrays(tmp_path, 10)
  train(compile_cache, tmp_path, 2, '--config.train.steps=15', *flags)
  assert events_of(tmp_path, 'resumed')[-1]['step'] == 10
  assert_same_bytes(arrays(tmp_path, 10), saved)
  assert manifest(tmp_path, 15)['storage'] == 'orbax'


@pytest.mark.slow  # the same rounds as SIGTERM to one process, below
def test_sigusr1_to_one_process_checkpoints_on_all_and_training_goes_on(tmp_path, compile_cache):
  procs = launch_training(compile_cache, tmp_path)
  procs[1].send_signal(signal.SIGUSR1)
  wait_for(lambda: committed_steps(tmp_path), procs[0], timeout=120)
  procs[0].send_signal(signal.SIGTERM)
  results = finish_processes(procs, timeout=120)
  assert [code for code, _ in results] == [143, 143], [out[-2000:] for _, out in results]
  saved, stopped = committed_steps(tmp_path)  # SIGUSR1's, then the stop's: both from both
  assert saved < stopped == events_of(tmp_path, 'interrupted')[-1]['step']
  assert all(len(manifest(tmp_path, s)['state_files']) == 2 for s in (saved, stopped))


def test_a_cadence_in_seconds_saves_whole_checkpoints_whatever_the_clocks(tmp_path, compile_cache):
  train(compile_cache, tmp_path, 2, '--config.train.steps=120', '--checkpoint_every=0',
        '--checkpoint_secs=0.3', '--keep=0')
  from jaxckpt.checkpoint import discovery
  steps = committed_steps(tmp_path)
  assert len(steps) >= 2 and steps[-1] == 120
  for step in steps:  # each one agreed by both processes: both parts, every checksum
    assert len(manifest(tmp_path, step)['state_files']) == 2
    assert discovery.problems(tmp_path / 'checkpoints' / f'step_{step:08d}') == []
  assert not list((tmp_path / 'checkpoints').glob('*.tmp-*'))


def launch_then_stop_process_1(cache, workdir, *flags: str):
  """2 processes of a long run; once past step 5, process 1 is stopped (SIGSTOP): process 0
  hangs for real in the next step's collective, every process alive as far as its sockets know
  (one CPU device per process: with several, gloo can hang by itself, openxla/xla#16430)."""
  procs = launch(cache, workdir, 2, '--config.train.steps=100000', '--checkpoint_every=0',
                 '--heartbeat_timeout_secs=300', *flags)  # the watchdog of lost ones waits
  status = Path(workdir) / 'status.json'
  wait_for(
      lambda: status.exists() and json.loads(status.read_text()).get('step', 0) >= 5,
      procs[0],
      timeout=180)
  procs[1].send_signal(signal.SIGSTOP)
  return procs


def test_a_hung_step_ends_the_run_with_every_stack_in_the_log(tmp_path, compile_cache):
  procs = launch_then_stop_process_1(compile_cache, tmp_path, '--step_timeout_secs=10')
  try:
    [(code, out)] = finish_processes(procs[:1], timeout=120)
  finally:
    procs[1].kill()
    procs[1].communicate()
  line = out.strip().splitlines()[-1]
  assert code == 1, out[-3000:]
  assert line.startswith('jaxckpt: E-DIST-010: step ') and 'did not complete within' in line, line
  assert 'most recent call first' in out and ' in _loop' in out  # the main thread, in the loop
  status = json.loads((tmp_path / 'status.json').read_text())
  assert status['state'] == 'failed' and status['error'] == line[len('jaxckpt: '):]
  assert events_of(tmp_path, 'failed')[-1]['error'] == status['error']


def test_a_second_sigterm_ends_a_process_stuck_in_a_step(tmp_path, compile_cache):
  """The first SIGTERM waits for a step boundary that never comes; the second exits at once."""
  procs = launch_then_stop_process_1(compile_cache, tmp_path)  # the step timeout: 600 s
  try:
    for _ in range(2):
      procs[0].send_signal(signal.SIGTERM)
      wait_for(lambda: not signal_pending(procs[0].pid, signal.SIGTERM), procs[0], timeout=10)
    [(code, out)] = finish_processes(procs[:1], timeout=30)
  finally:
    for p in procs:
      p.kill()
      p.communicate()
  assert code == 143, out[-3000:]
  assert out.strip().splitlines()[-1] == 'jaxckpt: second SIGTERM: exiting now without a checkpoint'


def signal_pending(pid: int, signum: int) -> bool:
  """The signal is sent but not yet delivered (/proc/PID/status: SigPnd, ShdPnd)."""
  fields = dict(line.split(':', 1) for line in open(f'/proc/{pid}/status').read().splitlines())
  return any(int(fields[f], 16) >> (signum - 1) & 1 for f in ('SigPnd', 'ShdPnd'))
