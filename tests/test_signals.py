"""Preemption signals against the real trainer process: exit codes, checkpoints, records."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO, committed_steps, read_events, subprocess_env, wait_for
from jaxckpt.runlog import read_loss_history

STEPS = 400
FLAGS = (f'--config.train.steps={STEPS}', '--checkpoint_every=50', '--config.train.log_every=5',
         '--keep=0')


def training_has_begun(workdir):
  return lambda: (workdir / 'loss.jsonl').exists() and (workdir / 'loss.jsonl').stat().st_size


def status(workdir):
  return json.loads((workdir / 'status.json').read_text())


def assert_stopped_cleanly(workdir, proc, out, signum):
  name = signal.Signals(signum).name
  assert proc.returncode == 128 + signum, out
  st = status(workdir)
  step = st['step']
  assert st['state'] == 'interrupted' and 0 < step < STEPS
  assert max(committed_steps(workdir)) == step  # the interrupted step itself is on disk
  assert max(read_loss_history(workdir)) == step
  assert f'jaxckpt: interrupted by {name} at step {step}' in out
  assert [e['step'] for e in read_events(workdir) if e['event'] == 'interrupted'] == [step]
  return step


def assert_same_command_finishes(trainer, workdir, step, *flags):
  again = trainer.run(workdir, *(flags or FLAGS))
  assert again.returncode == 0, again.stderr
  assert [e['step'] for e in read_events(workdir) if e['event'] == 'resumed'][-1] == step
  assert status(workdir)['state'] == 'finished'
  assert sorted(read_loss_history(workdir)) == list(range(1, STEPS + 1))


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_stop_signal_checkpoints_the_current_step_and_exits_128_plus_n(trainer, tmp_path,
                                                                        signum):
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(training_has_begun(tmp_path), proc)
  proc.send_signal(signum)
  out, _ = proc.communicate(timeout=120)
  step = assert_stopped_cleanly(tmp_path, proc, out, signum)
  assert_same_command_finishes(trainer, tmp_path, step)


def test_sigterm_while_background_saves_run(trainer, tmp_path):
  flags = (*FLAGS[:1], '--checkpoint_every=1', '--checkpoint_mode=async', '--keep=2',
           '--config.train.log_every=5')
  proc = trainer.start(tmp_path, *flags)
  wait_for(lambda: len(committed_steps(tmp_path)) >= 2, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  step = assert_stopped_cleanly(tmp_path, proc, out, signal.SIGTERM)
  assert_same_command_finishes(trainer, tmp_path, step, *flags)


def test_sigterm_and_sighup_together_still_checkpoint(trainer, tmp_path):
  """A machine going down sends both; that is not a 'second signal' and must not skip saving."""
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(training_has_begun(tmp_path), proc)
  proc.send_signal(signal.SIGTERM)
  proc.send_signal(signal.SIGHUP)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode in (128 + signal.SIGTERM, 128 + signal.SIGHUP), out
  st = status(tmp_path)
  assert st['state'] == 'interrupted' and max(committed_steps(tmp_path)) == st['step']


def test_signal_before_the_first_step_loses_nothing(trainer, tmp_path):
  """Stopped while starting up: no step was trained here, so nothing new needs saving."""
  proc = trainer.start(tmp_path, *FLAGS)
  wait_for(lambda: (tmp_path / 'events.jsonl').exists(), proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out
  st = status(tmp_path)
  assert st['state'] == 'interrupted'
  # Either it stopped before step 1 (no checkpoint) or it had trained and saved that step.
  assert committed_steps(tmp_path) == ([st['step']] if st['step'] else [])
  again = trainer.run(tmp_path, *FLAGS)
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
  assert status(tmp_path)['state'] == 'finished'


WATCHER = textwrap.dedent('''
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
''')


@pytest.mark.parametrize('first, second, code, survives', [
    ('SIGTERM', 'SIGTERM', 143, False),
    ('SIGINT', 'SIGTERM', 143, False),
    ('SIGTERM', 'SIGINT', 130, False),
    ('SIGHUP', 'SIGHUP', 0, True),
    ('SIGHUP', 'SIGTERM', 0, True),
    ('SIGTERM', 'SIGHUP', 0, True),
])
def test_second_signal(first, second, code, survives):
  r = subprocess.run([sys.executable, '-c', WATCHER, first, second], capture_output=True,
                     text=True, cwd=REPO, timeout=60, env=subprocess_env(REPO))
  assert r.returncode == code, r.stderr
  assert r.stdout.startswith(f'stop requested by {first}')
  assert ('still running' in r.stdout) == survives
  assert ('exiting now without a checkpoint' in r.stderr) != survives
