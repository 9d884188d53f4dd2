"""A save's waits on the devices are bounded (`jaxckpt.checkpoint.bounded`): a step that never
finishes fails the save with E-CKPT-018 naming what it waited for, instead of holding the caller
(and a training loop inside the save, which its step watch leaves alone) for good.

A step that never finishes is stood in for by a long one: a jitted loop of about a second on
this machine, dispatched asynchronously like a train step, against a bound of zero seconds.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.checkpoint import (CheckpointError, CheckpointManager, CheckpointOptions, bounded,
                                single_writer)
from jaxckpt.checkpoint.layout import committed_steps


@jax.jit
def _spin(x, n):
  return jax.lax.fori_loop(0, n, lambda i, v: v * 1.0000001 + 1e-9, x)


def running() -> jax.Array:
  """An array whose computation is still running when this returns (about a second of it)."""
  x = _spin(jnp.ones((1024,), jnp.float32), 10**7)
  assert not x.is_ready()  # dispatched, not done: what a save is handed after a train step
  return x


@pytest.fixture(scope='module', autouse=True)
def _compiled():
  _spin(jnp.ones((1024,), jnp.float32), 1).block_until_ready()


def test_ready_names_the_array_still_computing_after_its_bound():
  x = running()
  with pytest.raises(CheckpointError) as e:
    bounded.ready([('params/w', x), ('opt/count', np.int32(3))], 'save', seconds=0)
  assert e.value.code == 'E-CKPT-018', e.value
  assert e.value.what.startswith('save waited 0 s for params/w on the devices'), e.value
  x.block_until_ready()
  bounded.ready([('params/w', x)], 'save', seconds=0)  # done: no wait at all


def test_a_save_of_a_step_that_does_not_finish_fails_and_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr(bounded, 'DEVICE_WAIT_SECS', 0.0)
  monkeypatch.setattr(bounded, 'COPY_BYTES_PER_SEC', float('inf'))
  x = running()
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async', staging='host')) as mgr:
    with pytest.raises(CheckpointError) as e:
      mgr.save(1, {'w': x})
    assert e.value.code == 'E-CKPT-018' and 'for w on the devices' in e.value.what, e.value
    # Nothing of step 1, not even a temporary directory (the open writer's lock file aside).
    assert [p.name for p in tmp_path.iterdir()] == [single_writer.FILE]
    x.block_until_ready()
    mgr.save(2, {'w': x})  # the manager goes on once the devices do
  assert list(committed_steps(tmp_path)) == [2]


def test_a_save_in_flight_past_its_bound_fails_every_later_save_and_close_returns(
    tmp_path, monkeypatch):
  # The writer copies a snapshot on the devices (staging 'device') whose step is still running;
  # the caller's wait for it gives up at once: E-CKPT-018 naming the step, then the manager
  # refuses more saves (its writer is still held) and closes without waiting for that writer.
  monkeypatch.setattr(bounded, 'save_wait', lambda nbytes, barrier_secs: 0.0)
  x = running()
  mgr = CheckpointManager(tmp_path, CheckpointOptions(mode='async', staging='device'))
  mgr.save(1, {'w': x})
  assert mgr.staging_used == 'device'
  with pytest.raises(CheckpointError) as e:
    mgr.wait_until_finished()
  assert e.value.code == 'E-CKPT-018', e.value
  assert 'the save of step 1 in the background' in e.value.what, e.value
  with pytest.raises(CheckpointError) as again:
    mgr.save(2, {'w': np.zeros(3, np.float32)})
  assert again.value is e.value
  mgr.close()  # returns, raising nothing more: the writer still waiting is not joined
  # That writer may still write here: the directory stays its own until the process ends.
  with pytest.raises(CheckpointError, match='E-CKPT-020'):
    CheckpointManager(tmp_path)
  x.block_until_ready()
