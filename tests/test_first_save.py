"""`CheckpointManager.prepare`: the staging buffer faulted in before the first save, which then
writes the same checkpoint; a different tree, or a close during the prepare, stays correct.

How much faster the first save is, is measured by `benchmarks/first_save.py`, not here.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import abstract, assert_same_bytes, make_state, read_arrays, state_file

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, staging
from jaxckpt.checkpoint.tree import named_leaves


def big_state(mesh):
  """Above the size at which two threads copy the state (the helper thread `prepare` starts)."""
  n = staging._SPLIT_MIN_BYTES // 4 + 1000
  return {**make_state(mesh), 'big': jnp.arange(n, dtype=jnp.float32) * 0.5}


def host_bytes(tree):
  return {name: np.asarray(x) for name, x in named_leaves(tree).items()}


@pytest.mark.parametrize('size', ['small', 'split'])
def test_a_prepared_first_save_writes_the_same_checkpoint(mesh, tmp_path, size):
  state = make_state(mesh) if size == 'small' else big_state(mesh)
  for prepared in (False, True):
    with CheckpointManager(tmp_path / str(prepared), CheckpointOptions(mode='async')) as mgr:
      if prepared:
        assert mgr.prepare(abstract(state))
      mgr.save(1, state, {'data_position': 1})
      mgr.wait_until_finished()
      restored, run_state = mgr.restore(1, abstract(state))
    assert run_state['data_position'] == 1
    assert_same_bytes(host_bytes(restored), host_bytes(state))
  assert state_file(tmp_path / 'True' / 'step_00000001').read_bytes() == \
      state_file(tmp_path / 'False' / 'step_00000001').read_bytes()


def test_prepare_for_another_tree_still_saves_the_tree_given(mesh, tmp_path):
  state = make_state(mesh)
  other = {'w': jax.ShapeDtypeStruct((3, 5), jnp.float32), 'n': jax.ShapeDtypeStruct((), 'int32')}
  bigger = {**state, 'extra': jnp.linspace(0, 1, 10_000)}  # a larger buffer than prepared
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async', keep=0)) as mgr:
    assert mgr.prepare(other)
    mgr.save(1, state)
    mgr.save(2, bigger)
    assert mgr.prepare(other)  # smaller again: a save in flight is waited for first
    mgr.save(3, state, exclude=lambda n: n.startswith('opt_state/'))
    mgr.wait_until_finished()
    for step, tree in ((1, state), (2, bigger)):
      restored, _ = mgr.restore(step, abstract(tree))
      assert_same_bytes(host_bytes(restored), host_bytes(tree))
    restored, _ = mgr.restore(
        3, {'params': abstract(state['params'])}, only=lambda n: n.startswith('params/'))
    assert_same_bytes(host_bytes(restored), host_bytes({'params': state['params']}))
  assert sorted(read_arrays(tmp_path / 'step_00000003')) == ['params/b', 'params/w']


def test_close_during_a_prepare_stops_it(tmp_path):
  # 2 GiB of pages to fault: close comes well before that is done, and must not wait for it all.
  huge = {'w': jax.ShapeDtypeStruct((1 << 29,), jnp.float32)}
  mgr = CheckpointManager(tmp_path, CheckpointOptions(mode='async'))
  assert mgr.prepare(huge)
  closing = threading.Thread(target=mgr.close)
  closing.start()
  closing.join(120)  # a bound for a hang, not a speed goal
  assert not closing.is_alive(), 'close() did not return with a prepare running'
  assert not [t for t in threading.enumerate() if t.name == 'jaxckpt-prepare' and t.is_alive()]


def test_prepare_allocates_nothing_when_auto_would_write_without_a_staged_copy(tmp_path):
  # More than this host has twice over: auto writes inline from the arrays, so no buffer.
  vast = {'w': jax.ShapeDtypeStruct((1 << 44,), jnp.float32)}
  with CheckpointManager(tmp_path) as mgr:
    assert not mgr.prepare(vast)
    assert mgr._stager.nbytes() == 0


def test_a_prepared_buffer_is_free_memory_to_the_first_saves_mode():
  # The save would have been inline without the prepare (1.5 MB free for 1 MB twice over): the
  # prepared buffer's pages count as free, so it stays inline; once used, the buffer is room.
  stager = staging.HostStager()
  stager.prepare({'w': jax.ShapeDtypeStruct((1 << 18,), jnp.float32)})
  stager.wait_prepared()
  held = stager.nbytes()
  assert stager.prepared and held == 1 << 20
  assert staging.auto_mode(held, stager, held // 2) == 'sync'
  assert staging.auto_mode(held, stager, 2 * held) == 'async'
  stager.stage({'w': np.ones(1 << 18, np.float32)})
  assert not stager.prepared and staging.auto_mode(held, stager, held // 2) == 'async'
  stager.close()
