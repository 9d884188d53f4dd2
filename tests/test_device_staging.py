"""Staging on the device: `save()` waits only for a copy on the devices; the checkpoint is the same.

These run on whatever devices jax has (8 forced CPU devices here, a GPU in
`benchmarks/device_run.sh`); the benefit shows only on an accelerator, the correctness anywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import events_of, state_file
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, manifest, pinned, staging


@pytest.fixture(scope='module')
def devices_mesh():
  return Mesh(np.asarray(jax.devices()).reshape(-1, 1), ('data', 'model'))


def sharded_state(mesh, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  rows = 8 * mesh.shape['data']
  return {
      'params': {
          'w': jax.device_put(jax.random.normal(k1, (rows, 16)), NamedSharding(mesh, P('data'))),
          'b': jax.device_put(jax.random.normal(k2, (16,)), NamedSharding(mesh, P())),
      },
      'opt_state': {
          'count':
              jax.device_put(jnp.int32(3), NamedSharding(mesh, P())), 'mu':
                  jax.device_put(
                      jnp.full((rows, 16), -0.0, jnp.bfloat16), NamedSharding(mesh, P('data')))
      },
  }


def host_bytes(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def test_device_staging_writes_the_same_checkpoint_as_host_staging(devices_mesh, tmp_path):
  state = sharded_state(devices_mesh)
  for where in ('host', 'device'):
    with CheckpointManager(tmp_path / where, CheckpointOptions(mode='async', staging=where)) as mgr:
      mgr.save(1, state)
      assert mgr.staging_used == where
  host, device = (tmp_path / w / 'step_00000001' for w in ('host', 'device'))
  assert state_file(host).read_bytes() == state_file(device).read_bytes()
  assert manifest.read(host)['tensors'] == manifest.read(device)['tensors']


def test_a_device_staged_save_holds_its_own_step_while_later_steps_donate(devices_mesh, tmp_path):
  """The next steps donate the saved arrays' buffers and overwrite them; the snapshot is a copy
  they cannot reach, so the checkpoint is the state at the call."""
  state = sharded_state(devices_mesh)
  at_call = host_bytes(state)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  step = jax.jit(
      lambda s: jax.tree.map(lambda x: x * 2 + 1, s), donate_argnums=0, out_shardings=shardings)
  infos = []
  with CheckpointManager(
      tmp_path, CheckpointOptions(mode='async', staging='device'), on_commit=infos.append) as mgr:
    mgr.save(1, state)
    for _ in range(4):
      state = step(state)
    jax.block_until_ready(state)
    mgr.wait_until_finished()
    restored, _ = mgr.restore(
        1, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state))
  assert host_bytes(restored) == at_call
  assert host_bytes(state) != at_call  # the loop did move on
  assert infos[0].staging == 'device'


class FakeDevice:

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_auto_staging_takes_the_device_only_with_room_for_two_copies():
  assert not staging.device_has_room(FakeDevice(None), 1)  # a CPU reports nothing
  assert not staging.device_has_room(FakeDevice({'bytes_in_use': 5}), 1)
  roomy = FakeDevice({'bytes_limit': 100, 'bytes_in_use': 40})
  assert staging.device_has_room(roomy, 60) and not staging.device_has_room(roomy, 61)
  leaves = {'w': jnp.ones((1024,), jnp.float32)}
  expected = 'device' if staging.device_has_room(jax.devices()[0], 2 * 4096) else 'host'
  assert staging.choose_staging('auto', leaves) == expected
  assert staging.choose_staging('device', leaves) == 'device'
  assert staging.choose_staging('device', {'w': np.ones(3)}) == 'host'  # not on a device


def test_the_trainer_with_device_staging_writes_the_same_run(trainer, tmp_path):
  flags = ('--config.train.steps=20', '--checkpoint_every=10', '--checkpoint_mode=async')
  for where in ('host', 'device'):
    r = trainer.train(tmp_path / where, *flags, f'--checkpoint_staging={where}')
    assert r.returncode == 0, r.stderr
    assert {e['staging'] for e in events_of(tmp_path / where, 'checkpoint')} == {where}
  for step in (10, 20):
    host, device = (
        state_file(tmp_path / w / 'checkpoints' / f'step_{step:08d}') for w in ('host', 'device'))
    assert host.read_bytes() == device.read_bytes(), step


def mixed_leaves(mesh) -> dict:
  """A state's leaves as a save stages them: an empty array first, sharded and replicated ones
  (over 8 devices), bfloat16 and int32, and a numpy array."""
  state = sharded_state(mesh)
  return {
      'empty':
          jnp.zeros((0, 4)), **dict(zip(('b', 'w', 'count', 'mu'), jax.tree.leaves(state))), 'host':
          np.arange(5, dtype=np.int16)
  }


def staged_plainly(leaves) -> bytes:
  plain = staging.HostStager(pinned=False)
  try:
    plain.stage(leaves)
    return plain.region.tobytes()
  finally:
    plain.close()


@pytest.mark.parametrize('window, split', [(1, 1 << 30), (1 << 20, 1)])
def test_staging_through_pinned_host_memory_stages_the_same_bytes(devices_mesh, monkeypatch, window,
                                                                  split):
  """The accelerator's way, forced here on CPU devices: one pinned copy per shard, of one replica
  of each (a replicated array's bytes come over once), in windows (one shard each, then all in
  one copied by two threads), each let go once copied; the same buffer as the plain copy, and
  the sources untouched."""
  monkeypatch.setattr(pinned, 'WINDOW', window)
  monkeypatch.setattr(staging, '_SPLIT_MIN_BYTES', split)
  leaves = mixed_leaves(devices_mesh)
  at_call = host_bytes(leaves)
  calls, real = [], pinned._to_pinned  # pylint: disable=protected-access
  monkeypatch.setattr(pinned, '_to_pinned', lambda run: calls.append(real(run)) or calls[-1])
  through = staging.HostStager(pinned=True)
  try:
    staged = through.stage(leaves)
    assert through.region.tobytes() == staged_plainly(leaves)
  finally:
    through.close()
  for name, x in leaves.items():
    np.testing.assert_array_equal(staged[name], np.asarray(x))
  assert host_bytes(leaves) == at_call  # the sources were copied, not deleted
  copies = [x for call in calls for x in call]
  on_devices = [x for x in leaves.values() if isinstance(x, jax.Array)]
  assert sum(x.nbytes for x in copies) == sum(x.nbytes for x in on_devices)  # once each
  assert len(calls) == (len(copies) if window == 1 else 1)
  assert all(x.sharding.memory_kind == 'pinned_host' and x.is_deleted() for x in copies)


def test_staging_goes_on_the_plain_way_when_pinned_memory_fails(devices_mesh, monkeypatch, caplog):
  """A backend that refuses pinned memory part way: the window already copied is let go, the
  save stages the plain way (the same bytes), and later saves do not try again."""
  monkeypatch.setattr(pinned, 'WINDOW', 1)
  leaves = mixed_leaves(devices_mesh)
  calls, real = [], pinned._to_pinned  # pylint: disable=protected-access

  def refuse_the_second(run):
    if calls:
      raise RuntimeError('no pinned memory left')
    calls.append(real(run))
    return calls[-1]

  monkeypatch.setattr(pinned, '_to_pinned', refuse_the_second)
  through = staging.HostStager(pinned=True)
  try:
    through.stage(leaves)
    assert through.region.tobytes() == staged_plainly(leaves)
    assert through.pinned is False and not through._through_pinned(leaves['w'])  # pylint: disable=protected-access
  finally:
    through.close()
  assert calls and all(x.is_deleted() for x in calls[0])
  assert 'staging through pinned host memory failed (RuntimeError: no pinned memory left)' in \
      caplog.text


def test_staging_takes_pinned_memory_only_on_an_accelerator():
  x = jnp.ones((4,))
  expected = x.devices().pop().platform != 'cpu'
  assert pinned.available(x) == expected
  assert staging.HostStager()._through_pinned(x) == expected  # pylint: disable=protected-access
  on_host = jax.device_put(x, x.sharding.with_memory_kind('pinned_host'))
  assert not staging.HostStager(pinned=True)._through_pinned(on_host)  # already there
  assert not staging.HostStager(pinned=True)._through_pinned(np.ones(3))  # not on a device
  sizes = [(f'{n}', (), np.zeros(n, np.uint8)) for n in (0, 3, 3, 10, 1)]
  assert [[p[0] for p in run] for run in pinned.windows(sizes, 6)] == [['0', '3', '3'], ['10'],
                                                                       ['1']]


@pytest.mark.parametrize('through', [None, True, False])
def test_prepare_sets_up_pinned_memory_where_saves_will_take_it(devices_mesh, monkeypatch, through):
  """Where saves stage through pinned memory (an accelerator; forced here), `prepare` has the
  runtime set up the two windows' worth a save holds, so that the first save does not."""
  calls, real = [], pinned.warm
  monkeypatch.setattr(pinned, 'warm', lambda device, n: calls.append(n) or real(device, n))
  leaves = {
      n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
      for n, x in mixed_leaves(devices_mesh).items()
      if isinstance(x, jax.Array)
  }
  stager = staging.HostStager(pinned=through)
  try:
    stager.prepare(leaves)
    stager.wait_prepared()
    assert stager.prepared
  finally:
    stager.close()
  on_accelerator = jax.devices()[0].platform != 'cpu'
  takes = through if through is not None else on_accelerator
  assert len(calls) == int(takes) and all(0 < n <= 2 * pinned.WINDOW for n in calls)
  assert real(jax.devices()[0], 1 << 20)  # a CPU has pinned host memory too
  assert not real('no device', 1 << 20)  # what it cannot set up is the first save's, not an error
