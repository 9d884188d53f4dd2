"""Chaos: SIGKILL the trainer at random moments, restart it with the same command, repeat.

The end state must equal a never-stopped run byte for byte, and no restart may fail. Kills land
during start-up (restore, compile), during training and while background saves are running
(a checkpoint every 2 steps, async). The CI version kills 4 times; the long one runs with
`pytest -m slow tests/test_chaos.py` (JAXCKPT_CHAOS_KILLS, default 100).
"""

import os
import random
import signal
import time

import pytest

from conftest import assert_same_bytes, committed_steps, read_arrays, read_events, wait_for
from jaxckpt.runlog import read_loss_history

STEPS = 150
FLAGS = (f'--config.train.steps={STEPS}', '--checkpoint_every=2', '--checkpoint_mode=async',
         '--keep=2', '--config.train.log_every=1', '--config.samples.every=50')


def loss_lines(workdir):
  path = workdir / 'loss.jsonl'
  return path.read_text().count('\n') if path.exists() else 0


def chaos(trainer, workdir, straight, kills: int, seed: int) -> dict:
  rng = random.Random(seed)
  stats = {'kills': 0, 'during_startup': 0, 'restarts': 0, 'finished_early': False}
  while stats['kills'] < kills:
    before = loss_lines(workdir)
    proc = trainer.start(workdir, *FLAGS)
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
      time.sleep(rng.uniform(0.0, 1.5))
    if proc.poll() is not None:
      assert proc.returncode == 0, f'a restart failed with {proc.returncode}'
      stats['finished_early'] = True
      break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stats['kills'] += 1
  final = trainer.run(workdir, *FLAGS)
  assert final.returncode == 0, final.stderr
  stats['restarts'] = sum(1 for e in read_events(workdir) if e['event'] == 'resumed')
  assert_same_bytes(read_arrays(workdir / 'checkpoints' / f'step_{STEPS:08d}'),
                    read_arrays(straight / 'checkpoints' / f'step_{STEPS:08d}'))
  assert ({s: r['loss'] for s, r in read_loss_history(workdir).items()}
          == {s: r['loss'] for s, r in read_loss_history(straight).items()})
  return stats


@pytest.fixture(scope='module')
def straight(trainer, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('straight')
  r = trainer.run(workdir, *FLAGS)
  assert r.returncode == 0, r.stderr
  return workdir


def test_chaos_short(trainer, straight, tmp_path):
  stats = chaos(trainer, tmp_path, straight, kills=4, seed=0)
  print('chaos:', stats)
  assert stats['restarts'] >= 2  # the kills landed after commits, not only before the first


@pytest.mark.slow
def test_chaos_long(trainer, straight, tmp_path):
  kills = int(os.environ.get('JAXCKPT_CHAOS_KILLS', '100'))
  # Long enough that the kills, not the end of training, stop the loop.
  stats = chaos(trainer, tmp_path, straight, kills=kills, seed=1)
  print('chaos:', stats)
  assert stats['kills'] == kills or stats['finished_early']
