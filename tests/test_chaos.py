"""Chaos: SIGKILL the trainer at random moments, restart it with the same command, repeat.

The end state must equal a never-stopped run byte for byte, and no restart may fail. Kills land
during start-up (restore, compile), during training and while background saves are running
(a checkpoint every 2 steps, async). The CI version kills 3 times; the long one runs with
`pytest -m slow tests/test_chaos.py` (JAXCKPT_CHAOS_KILLS, default 100).
"""

import os
import random
import signal
import time

import pytest
from conftest import assert_same_bytes, checkpoint_arrays, events_of, losses, wait_for

SHORT_STEPS = 150
LONG_STEPS = 3000  # enough that 100 short lives do not reach the end


def flags(steps: int) -> tuple[str, ...]:
  return (f'--config.train.steps={steps}', '--checkpoint_every=2', '--checkpoint_mode=async',
          '--keep=2', '--config.train.log_every=1', '--config.samples.every=50', '--export_every=0')


def loss_lines(workdir):
  path = workdir / 'loss.jsonl'
  return path.read_text().count('\n') if path.exists() else 0


def chaos(trainer, workdir, straight, kills: int, seed: int, steps: int, max_life: float) -> dict:
  """Kill and restart until `kills` kills (or the run ends); then finish and compare."""
  run_flags = flags(steps)
  rng = random.Random(seed)
  stats = {'kills': 0, 'during_startup': 0, 'restarts': 0, 'finished_early': False}
  while stats['kills'] < kills:
    before = loss_lines(workdir)
    proc = trainer.start(workdir, *run_flags)
    if rng.random() < 0.2:
      time.sleep(rng.uniform(0.0, 2.5))  # somewhere in start-up: imports, restore, compile
      stats['during_startup'] += 1
    else:
      try:
        wait_for(lambda: loss_lines(workdir) > before, proc)  # this process is training
      except AssertionError as e:
        assert proc.returncode == 0, f'a restart failed: {e}'
        stats['finished_early'] = True
        break
      time.sleep(rng.uniform(0.0, max_life))
    if proc.poll() is not None:
      assert proc.returncode == 0, f'a restart failed with {proc.returncode}'
      stats['finished_early'] = True
      break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stats['kills'] += 1
  final = trainer.train(workdir, *run_flags)
  assert final.returncode == 0, final.stderr
  stats['restarts'] = len(events_of(workdir, 'resumed'))
  assert_same_bytes(checkpoint_arrays(workdir, steps), checkpoint_arrays(straight, steps))
  assert losses(workdir) == losses(straight)
  return stats


def straight_run(trainer, workdir, steps):
  r = trainer.train(workdir, *flags(steps))
  assert r.returncode == 0, r.stderr
  return workdir


def test_chaos_short(trainer, tmp_path):
  straight = straight_run(trainer, tmp_path / 'straight', SHORT_STEPS)
  stats = chaos(
      trainer, tmp_path / 'run', straight, kills=3, seed=0, steps=SHORT_STEPS, max_life=1.5)
  print('chaos:', stats)
  assert stats['restarts'] >= 2  # the kills landed after commits, not only before the first


@pytest.mark.slow
def test_chaos_long(trainer, tmp_path):
  kills = int(os.environ.get('JAXCKPT_CHAOS_KILLS', '100'))
  straight = straight_run(trainer, tmp_path / 'straight', LONG_STEPS)
  stats = chaos(
      trainer, tmp_path / 'run', straight, kills=kills, seed=1, steps=LONG_STEPS, max_life=0.5)
  print('chaos:', stats)
  assert stats['kills'] == kills  # the kills, not the end of training, ended the loop
