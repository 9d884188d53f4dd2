"""Elastic restore: a run written on 8 devices (data 4 x model 2) continues on 1, by resharding."""

import signal

import numpy as np
from conftest import (STRAIGHT_FLAGS, STRAIGHT_MESHES, STRAIGHT_STEPS, committed_steps, events_of,
                      losses, wait_for)

# The run of tests/test_resume.py: its straight run on 8 devices (`straight_runs`) is this one's.
STEPS = STRAIGHT_STEPS
FLAGS = STRAIGHT_FLAGS
MESH = {8: STRAIGHT_MESHES[8], 1: ('--config.mesh.data=1', '--config.mesh.model=1')}


def stop_after_a_commit(trainer, workdir, devices):
  """Run on `devices` until it commits a checkpoint of its own, then SIGTERM it."""
  before = max(committed_steps(workdir), default=0)
  proc = trainer.start(workdir, *FLAGS, *MESH[devices], devices=devices)
  wait_for(lambda: max(committed_steps(workdir), default=0) > before, proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 143, out


def test_eight_devices_to_one(trainer, straight_runs, tmp_path):
  straight = straight_runs[8]  # FLAGS on 8 devices, never stopped
  workdir = tmp_path / 'run'
  stop_after_a_commit(trainer, workdir, 8)
  r = trainer.train(workdir, *FLAGS, *MESH[1], devices=1)
  assert r.returncode == 0, r.stderr

  resumed = events_of(workdir, 'resumed')
  assert len(resumed) == 1
  assert 'devices 8 -> 1' in resumed[0]['changes']
  assert any(line.startswith('mesh ') for line in resumed[0]['changes'])

  ref = losses(straight)
  got = losses(workdir)
  assert sorted(got) == list(range(1, STEPS + 1))
  first_resume = resumed[0]['step']
  # Up to the first resume the runs are the same program: identical. After it the mesh differs,
  # sums are added in another order, and the trajectory drifts only at rounding level.
  assert all(got[s] == ref[s] for s in range(1, first_resume + 1))
  drift = max(abs(got[s] - ref[s]) / ref[s] for s in got)
  print(f'elastic 8 -> 1: max relative loss drift {drift:.2e}')
  assert drift < 1e-3
  assert np.mean([got[s] for s in range(STEPS - 9, STEPS + 1)]) < got[1]
