"""A stop fits in a preemption's grace: the loop runs at most two steps ahead of the devices,
so SIGTERM (or SIGUSR1) is honoured within two steps of where the devices were, whatever
`log_every` is. And a start with nothing to train says so.

The steps are made slow (a large batch) and the progress line rare, so that a loop free to run
ahead would dispatch a whole `log_every` of steps before the signal lands: the step a stop is
honoured at, counted from the step the run had reported, tells the two apart.
"""

import signal
import time

from conftest import committed_steps, events_of, wait_for

from jaxckpt.records.runlog import read_status

LOG_EVERY = 8  # a loop free to run ahead would be up to 8 steps ahead; the bound allows 4
SLOW = ('--config.train.steps=3000', '--config.train.batch_size=512',
        f'--config.train.log_every={LOG_EVERY}', '--checkpoint_every=0', '--keep=0')


def reported_step(workdir) -> int:
  try:
    return read_status(workdir).get('step', 0)
  except (OSError, ValueError):
    return 0


def test_sigusr1_and_sigterm_are_honoured_within_two_steps(trainer, tmp_path):
  proc = trainer.start(tmp_path, *SLOW)
  # SIGUSR1 right after a progress line: the checkpoint is of a step at most ~2 further.
  wait_for(lambda: reported_step(tmp_path) >= LOG_EVERY, proc, every=0.02)
  seen = reported_step(tmp_path)
  time.sleep(0.2)  # past the progress line's own writes: the loop is dispatching again
  proc.send_signal(signal.SIGUSR1)
  wait_for(lambda: events_of(tmp_path, 'checkpoint_requested'), proc)
  (requested,) = events_of(tmp_path, 'checkpoint_requested')
  assert seen < requested['step'] <= seen + 4, (seen, requested)
  assert requested['seconds_from_signal'] >= 0
  wait_for(lambda: requested['step'] in committed_steps(tmp_path), proc)

  # The same for a stop, after the next progress line.
  wait_for(lambda: reported_step(tmp_path) >= seen + LOG_EVERY, proc, every=0.02)
  seen = reported_step(tmp_path)
  time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out
  (stop,) = events_of(tmp_path, 'interrupted')
  assert seen < stop['step'] <= seen + 4, (seen, stop)
  assert stop['signal_step'] in (stop['step'], stop['step'] - 1)
  assert stop['seconds_from_signal'] > 0
  assert max(committed_steps(tmp_path)) == stop['step']
  assert f'SIGUSR1: checkpoint of step {requested["step"]} started' in out
  assert (f'jaxckpt: interrupted by SIGTERM at step {stop["step"]} (the signal arrived at step '
          f'{stop["signal_step"]}; checkpoint committed') in out


def test_a_start_with_nothing_to_train_says_why(trainer, tmp_path):
  first = trainer.train(tmp_path, '--config.train.steps=20', '--checkpoint_every=10',
                        '--config.train.eval_every=10')
  assert first.returncode == 0, first.stderr
  assert 'step 10  held-out loss ' in first.stderr

  again = trainer.train(tmp_path, '--config.train.steps=20')
  assert again.returncode == 0, again.stderr
  assert ('the run is finished at step 20 (--config.train.steps=20); to continue it, pass '
          '--config.train.steps above 20') in again.stderr
  assert 'compiling the train step' not in again.stderr  # no step to run: nothing compiled

  fewer = trainer.train(tmp_path, '--config.train.steps=10')
  assert fewer.returncode == 0, fewer.stderr
  assert 'nothing trained: the run is at step 20, past --config.train.steps=10' in fewer.stderr
  status = read_status(tmp_path)
  assert status['step'] == 20 and status['note'].startswith('nothing trained')
  assert [e['step'] for e in events_of(tmp_path, 'nothing_to_train')] == [20, 20]
  assert committed_steps(tmp_path) == [10, 20]
