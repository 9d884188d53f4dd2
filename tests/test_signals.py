"""Preemption signals against the real trainer process: exit codes, checkpoints, records."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, committed_steps, events_of, subprocess_env, wait_for

from jaxckpt.checkpoint import signals
from jaxckpt.records.runlog import read_loss_history, read_status

STEPS = 160  # the stop lands a few steps past step 5, where the signal is sent: 150 to spare
FLAGS = (f'--config.train.steps={STEPS}', '--checkpoint_every=50', '--config.train.log_every=5',
         '--keep=0')


def training_has_begun(workdir):
  return lambda: (workdir / 'loss.jsonl').exists() and (workdir / 'loss.jsonl').stat().st_size


def assert_stopped_cleanly(workdir, proc, out, signum, steps=STEPS):
  name = signal.Signals(signum).name
  assert proc.returncode == 128 + signum, out
  st = read_status(workdir)
  step = st['step']
  assert st['state'] == 'interrupted' and 0 < step < steps
  assert max(committed_steps(workdir)) == step  # the interrupted step itself is on disk
  assert max(read_loss_history(workdir)) == step
  assert f'jaxckpt: interrupted by {name} at step {step}' in out
  assert [e['step'] for e in events_of(workdir, 'interrupted')] == [step]
  return step


def assert_same_command_finishes(trainer, workdir, step, *flags, steps=STEPS):
  again = trainer.train(workdir, *(flags or FLAGS))
  assert again.returncode == 0, again.stderr
  assert [e['step'] for e in events_of(workdir, 'resumed')][-1] == step
  assert read_status(workdir)['state'] == 'finished'
  assert sorted(read_loss_history(workdir)) == list(range(1, steps + 1))


# One handler serves the three: SIGINT's and SIGHUP's runs are in the slow set (`-m slow`).
@pytest.mark.parametrize('signum', [
    signal.SIGTERM,
    pytest.param(signal.SIGINT, marks=pytest.mark.slow),
    pytest.param(signal.SIGHUP, marks=pytest.mark.slow)
])
def test_stop_signal_checkpoints_the_current_step_and_exits_128_plus_n(trainer, tmp_path, signum):
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(training_has_begun(tmp_path), proc)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=120)
  step = assert_stopped_cleanly(tmp_path, proc, out, signum)
  assert_same_command_finishes(trainer, tmp_path, step)


def test_sigterm_while_background_saves_run(trainer, tmp_path):
  steps = 80  # a checkpoint at every step: the continued run commits each of them
  flags = (f'--config.train.steps={steps}', '--checkpoint_every=1', '--checkpoint_mode=async',
           '--keep=2', '--config.train.log_every=5')
  proc = trainer.start(tmp_path, *flags)
  wait_for(lambda: len(committed_steps(tmp_path)) >= 2, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  step = assert_stopped_cleanly(tmp_path, proc, out, signal.SIGTERM, steps)
  assert_same_command_finishes(trainer, tmp_path, step, *flags, steps=steps)


def test_sigterm_and_sighup_together_still_checkpoint(trainer, tmp_path):
  """A machine going down sends both; that is not a 'second signal' and must not skip saving."""
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(training_has_begun(tmp_path), proc)
  proc.send_signal(signal.SIGTERM)
  proc.send_signal(signal.SIGHUP)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode in (128 + signal.SIGTERM, 128 + signal.SIGHUP), out
  st = read_status(tmp_path)
  assert st['state'] == 'interrupted' and max(committed_steps(tmp_path)) == st['step']


def test_signal_before_the_first_step_loses_nothing(trainer, tmp_path):
  """Stopped while starting up: no step was trained here, so nothing new needs saving."""
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(lambda: (tmp_path / 'events.jsonl').exists(), proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out
  st = read_status(tmp_path)
  assert st['state'] == 'interrupted'
  # Either it stopped before step 1 (no checkpoint) or it had trained and saved that step.
  assert committed_steps(tmp_path) == ([st['step']] if st['step'] else [])
  again = trainer.train(tmp_path, *FLAGS)
  assert again.returncode == 0, again.stderr
  assert sorted(read_loss_history(tmp_path)) == list(range(1, STEPS + 1))


def test_sigusr1_checkpoints_and_keeps_training(trainer, tmp_path):
  flags = (*FLAGS[:1], '--checkpoint_every=0', '--keep=0', '--config.train.log_every=5')
  proc = trainer.start(tmp_path, *flags)
  wait_for(training_has_begun(tmp_path), proc)
  proc.send_signal(signal.SIGUSR1)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 0, out
  steps = committed_steps(tmp_path)
  assert len(steps) == 2 and 0 < steps[0] < STEPS and steps[1] == STEPS
  assert read_status(tmp_path)['state'] == 'finished'


WATCHER = textwrap.dedent("""
    import os, signal, sys, time
    from jaxckpt.checkpoint.signals import PreemptionWatcher
    first, second = (getattr(signal, name) for name in sys.argv[1:])
    with PreemptionWatcher() as w:
      os.kill(os.getpid(), first)
      time.sleep(0.01)
      print('stop requested by', w.stop_name, flush=True)
      os.kill(os.getpid(), second)
      time.sleep(0.01)
      print('still running', flush=True)
""")


@pytest.mark.parametrize('first, second, code, survives', [
    ('SIGTERM', 'SIGTERM', 143, False),
    ('SIGINT', 'SIGTERM', 143, False),
    ('SIGTERM', 'SIGINT', 130, False),
    ('SIGHUP', 'SIGHUP', 0, True),
    ('SIGHUP', 'SIGTERM', 0, True),
    ('SIGTERM', 'SIGHUP', 0, True),
])
def test_second_signal(first, second, code, survives):
  r = subprocess.run([sys.executable, '-c', WATCHER, first, second],
                     capture_output=True,
                     text=True,
                     cwd=REPO,
                     timeout=60,
                     env=subprocess_env(REPO))
  assert r.returncode == code, r.stderr
  assert r.stdout.startswith(f'stop requested by {first}')
  assert ('still running' in r.stdout) == survives
  assert ('exiting now without a checkpoint' in r.stderr) != survives


def take_with_a_sigusr1_before_opcode(k: int) -> tuple[bool, bool, int]:
  """`take_save_request()` with SIGUSR1's handler run just before its k-th bytecode, as Python
  may run it; then a second call. Returns both answers and the bytecodes the first one ran."""
  w = signals.PreemptionWatcher()
  code, ran = signals.PreemptionWatcher.take_save_request.__code__, 0

  def each_opcode(frame, event, arg):
    nonlocal ran
    if event == 'opcode':
      if ran == k:
        w._handle(signal.SIGUSR1, None)  # pylint: disable=protected-access
      ran += 1
    return each_opcode

  def trace(frame, event, arg):
    if frame.f_code is not code:
      return None
    frame.f_trace_opcodes = True
    return each_opcode

  previous = sys.gettrace()
  sys.settrace(trace)
  try:
    first = w.take_save_request()
  finally:
    sys.settrace(previous)
  return first, w.take_save_request(), ran


def test_a_sigusr1_between_any_two_bytecodes_is_not_lost():
  """A True answer means a save after the signal; so wherever the handler runs, this call or
  the next must answer True, and then nothing is left over."""
  k, ran = 0, 1
  while k < ran:
    first, second, ran = take_with_a_sigusr1_before_opcode(k)
    assert first or second, f'the SIGUSR1 delivered before bytecode {k} was lost'
    k += 1
  assert k > 5  # the tracer saw the method's bytecodes


def test_sigusr1s_between_two_polls_ask_for_one_save():
  with signals.PreemptionWatcher() as w:
    assert not w.take_save_request()
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)  # the handler runs at the next bytecode; this only gives it a few
    assert w.take_save_request() and not w.take_save_request()
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    assert w.take_save_request() and w.stop_signal is None


GATED = textwrap.dedent('''
    """The tiny config; the first load waits for GO, with READY saying whether jax is loaded."""
    import pathlib, sys, time
    from configs import tiny

    def get_config():
      ready, go = pathlib.Path({ready!r}), pathlib.Path({go!r})
      if not go.exists():
        ready.write_text('jax imported' if 'jax' in sys.modules else 'no jax yet')
        while not go.exists():
          time.sleep(0.05)
      return tiny.get_config()
''')


def start_held_in_flag_parsing(trainer, tmp_path):
  """Start the trainer on a config whose loading (during absl flag parsing) waits for `go`."""
  ready, go = tmp_path / 'ready', tmp_path / 'go'
  config = tmp_path / 'gated.py'
  config.write_text(GATED.format(ready=str(ready), go=str(go)))
  proc = trainer.start(tmp_path / 'run', f'--config={config}', *FLAGS)
  wait_for(ready.exists, proc, every=0.05)
  assert ready.read_text() == 'no jax yet'
  return proc, go


def pending(pid: int, signum: int) -> bool:
  """The signal is sent but not yet delivered (/proc/PID/status: SigPnd, ShdPnd)."""
  fields = dict(line.split(':', 1) for line in open(f'/proc/{pid}/status').read().splitlines())
  return any(int(fields[f], 16) >> (signum - 1) & 1 for f in ('SigPnd', 'ShdPnd'))


@pytest.mark.parametrize(
    'signum', [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_stop_signal_while_importing_stops_before_the_first_step(trainer, tmp_path, signum):
  """The README's start-up corner case, for a signal that comes before jax is even imported."""
  proc, go = start_held_in_flag_parsing(trainer, tmp_path)
  try:
    proc.send_signal(signum)
    wait_for(lambda: not pending(proc.pid, signum), proc, every=0.05)
    go.touch()
    out, _ = proc.communicate(timeout=120)
  finally:
    proc.kill()
  name, workdir = signal.Signals(signum).name, tmp_path / 'run'
  assert proc.returncode == 128 + signum, out
  assert 'Traceback' not in out
  assert out.strip().splitlines()[-1] == f'jaxckpt: interrupted by {name} at step 0'
  assert read_status(workdir)['state'] == 'interrupted' and read_status(workdir)['step'] == 0
  assert committed_steps(workdir) == [] and not (workdir / 'loss.jsonl').exists()


def test_second_sigterm_while_importing_exits_at_once(trainer, tmp_path):
  proc, go = start_held_in_flag_parsing(trainer, tmp_path)
  try:
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: not pending(proc.pid, signal.SIGTERM), proc, every=0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)  # `go` never comes: only the exit ends the wait
  finally:
    proc.kill()
  assert proc.returncode == 143, out
  assert out.strip().splitlines()[-1] == ('jaxckpt: second SIGTERM: exiting now without a '
                                          'checkpoint')
  assert not go.exists() and not (tmp_path / 'run' / 'checkpoints').exists()


def freeze_once_finished(proc, workdir) -> bool:
  """SIGSTOP the trainer once events.jsonl records `finished`; False if it had exited."""
  events = workdir / 'events.jsonl'
  while not (events.exists() and '"event":"finished"' in events.read_text()):
    if proc.poll() is not None:
      raise AssertionError(f'trainer exited ({proc.returncode}) unfinished:\n{proc.stdout.read()}')
    time.sleep(0.05)
  os.kill(proc.pid, signal.SIGSTOP)
  while proc.poll() is None:
    if open(f'/proc/{proc.pid}/stat').read().rsplit(')', 1)[1].split()[0] in 'Tt':
      return True
    time.sleep(0.05)
  return False


@pytest.mark.parametrize('signum', [
    signal.SIGTERM,
    pytest.param(signal.SIGINT, marks=pytest.mark.slow),
    pytest.param(signal.SIGHUP, marks=pytest.mark.slow), signal.SIGUSR1
])
def test_signal_after_the_last_step_leaves_the_run_finished(trainer, tmp_path, signum):
  """The README's last corner case: exit 0 and `finished`, however late the signal comes."""
  for attempt in range(3):  # caught alive after its last event: nearly always the first time
    workdir = tmp_path / f'run{attempt}'
    proc = trainer.start(workdir, '--config.train.steps=10', '--checkpoint_every=5')
    try:
      caught = freeze_once_finished(proc, workdir)
      if caught:
        proc.send_signal(signum)  # delivered on SIGCONT
    finally:
      if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    if caught:
      break
  else:
    pytest.fail('the trainer always exited before it could be stopped after its last step')
  assert proc.returncode == 0, out
  assert 'Traceback' not in out and 'jaxckpt: ' not in out
  assert read_status(workdir)['state'] == 'finished' and committed_steps(workdir) == [5, 10]


def test_a_stop_signal_during_the_first_compile_stops_before_the_first_step(trainer, tmp_path):
  """A fresh start compiles its step before the loop: a signal that arrives meanwhile stops the
  run with no step trained and no checkpoint (it trained and saved step 1 when the compile was
  the first step's call)."""
  proc = trainer.start(tmp_path, *FLAGS)
  try:
    for line in proc.stdout:
      if 'compiling the train step...' in line:
        proc.send_signal(signal.SIGTERM)
        break
    out = proc.communicate(timeout=120)[0]
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert out.strip().splitlines()[-1] == 'jaxckpt: interrupted by SIGTERM at step 0', out
  assert committed_steps(tmp_path) == [] and read_status(tmp_path)['step'] == 0


HOOKED = textwrap.dedent("""
    import os, signal, sys, time
    from jaxckpt.checkpoint import signals
    signals.on_exit_now(lambda name: open(sys.argv[1], 'w').write(name))
    signals.on_exit_now(lambda name: time.sleep(600))  # a hook that hangs is left behind
    signals.on_exit_now(lambda name: 1 / 0)  # never reached: the one before it hangs
    remove = signals.on_exit_now(lambda name: open(sys.argv[1], 'a').write('removed ran'))
    remove()
    with signals.PreemptionWatcher():
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(60)
""")


def test_a_second_signal_runs_the_exit_hooks_within_their_bound(tmp_path):
  said = tmp_path / 'said'
  t0 = time.monotonic()
  r = subprocess.run([sys.executable, '-c', HOOKED, str(said)],
                     capture_output=True,
                     text=True,
                     cwd=REPO,
                     timeout=60,
                     env=subprocess_env(REPO))
  assert r.returncode == 128 + signal.SIGTERM, r.stderr
  assert said.read_text() == 'SIGTERM'
  assert time.monotonic() - t0 < 30  # the hanging hook was given EXIT_NOW_HOOK_SECS, not 600 s


def test_a_second_stop_signal_marks_the_status_interrupted(trainer, tmp_path):
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(training_has_begun(tmp_path), proc)
  # Two of one signal sent at once can arrive as one; two different ones cannot.
  proc.send_signal(signal.SIGINT)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  second = signal.Signals(proc.returncode - 128).name
  assert second in ('SIGINT', 'SIGTERM'), out
  assert f'jaxckpt: second {second}: exiting now without a checkpoint' in out
  st = read_status(tmp_path)
  assert st['state'] == 'interrupted' and st['signal'] == second, st  # not `running`
  assert f'a second {second}' in st['error'] and st['pid'] == proc.pid
  ends = events_of(tmp_path, 'interrupted')  # the start's end record: a Ctrl-C is no lost machine
  assert [(e['signal'], e['exited_at_once']) for e in ends] == [(second, True)]
