"""The checkpoint library on its own: any pytree, no trainer."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, abstract, make_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt.checkpoint import (CheckpointManager, CheckpointOptions, atomic, committed_steps,
                                layout, staging)
from jaxckpt.errors import CheckpointError


def host(tree):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize('mode, storage', [('async', 'safetensors'), ('sync', 'safetensors'),
                                           ('async', 'orbax'), ('sync', 'orbax')])
def test_round_trip_is_byte_exact(mesh, tmp_path, mode, storage):
  state = make_state(mesh)
  with CheckpointManager(tmp_path, CheckpointOptions(mode=mode, storage=storage)) as mgr:
    mgr.save(5, state, {'data_position': 5})
  mgr = CheckpointManager(tmp_path)
  assert mgr.read_manifest(5)['storage'] == storage
  restored, run_state = mgr.restore(mgr.latest_step(), abstract(state))
  assert host(restored) == host(state)
  assert run_state == {'step': 5, 'data_position': 5}
  assert restored['params']['w'].sharding == state['params']['w'].sharding


@pytest.mark.parametrize('storage', ['safetensors', 'orbax'])
def test_restore_onto_another_mesh(mesh, tmp_path, storage):
  state = make_state(mesh)
  with CheckpointManager(tmp_path, CheckpointOptions(storage=storage)) as mgr:
    mgr.save(1, state)
  one = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(one, P())), state)
  restored, _ = CheckpointManager(tmp_path).restore(1, target)
  assert host(restored) == host(state)
  assert restored['params']['w'].sharding.mesh.devices.size == 1


def test_async_save_copies_the_state_before_returning(mesh, tmp_path):
  """A donated state is overwritten by the next step while the write is still running."""
  state = make_state(mesh)
  expected = host(state)
  step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async')) as mgr:
    mgr.save(1, state)
    for _ in range(3):
      state = step(state)
  restored, _ = CheckpointManager(tmp_path).restore(1, abstract(state))
  assert host(restored) == expected


def test_a_host_copy_split_between_two_threads_is_byte_exact(mesh, tmp_path, monkeypatch):
  """Large states are copied by the caller and a helper thread, one leaf cut between them."""
  monkeypatch.setattr(staging, '_SPLIT_MIN_BYTES', 0)
  state = make_state(mesh)
  later = jax.tree.map(lambda x: x + 1, state)
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async')) as mgr:
    mgr.save(1, state)
    mgr.save(2, later)  # into the same, reused buffers
  reader = CheckpointManager(tmp_path)
  assert host(reader.restore(1, abstract(state))[0]) == host(state)
  assert host(reader.restore(2, abstract(state))[0]) == host(later)


class Unreadable:
  """A leaf whose host copy fails (a device lost mid-save), after the write has begun."""
  shape, dtype, nbytes = (4,), np.dtype(np.float32), 16

  def __array__(self, dtype=None, copy=None):
    raise RuntimeError('device lost')


@pytest.mark.parametrize('split', [False, True])
def test_a_host_copy_that_fails_midway_commits_nothing_and_leaves_no_debris(
    tmp_path, monkeypatch, split):
  """The caller gets the copy's error; nothing is written or committed for that step, and the
  manager saves again as usual."""
  if split:  # the copy split between the caller and a helper thread
    monkeypatch.setattr(staging, '_SPLIT_MIN_BYTES', 0)
  big = np.arange(1 << 20, dtype=np.float32)
  good = {'a': big, 'b': np.ones(4, np.float32), 'c': big + 1}
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async', storage='safetensors')) as mgr:
    mgr.save(1, good)
    with pytest.raises(RuntimeError, match='device lost'):
      mgr.save(2, {'a': big, 'b': Unreadable(), 'c': big + 1})
    mgr.wait_until_finished()  # nothing left over to raise
    assert list(committed_steps(tmp_path)) == [1] and layout.debris(tmp_path) == []
    mgr.save(3, good)
  assert list(committed_steps(tmp_path)) == [1, 3]
  assert CheckpointManager(tmp_path).verify(3) == []


def test_background_failure_is_raised_in_the_caller_and_nothing_half_written_commits(
    mesh, tmp_path):
  root = tmp_path / 'ckpt'
  state = make_state(mesh)
  mgr = CheckpointManager(root, CheckpointOptions(mode='async', keep=1))
  mgr.save(1, state)
  mgr.wait_until_finished()
  # The disk goes away under the run: the location is now a file.
  moved = tmp_path / 'moved'
  os.rename(root, moved)
  root.write_text('')
  mgr.save(2, state)
  with pytest.raises(CheckpointError) as err:
    mgr.wait_until_finished()
  assert err.value.code == 'E-CKPT-001' and 'step 2' in str(err.value)
  mgr.close()
  root.unlink()
  os.rename(moved, root)
  assert committed_steps(root) == {1: root / 'step_00000001'}  # keep=1 did not delete it


def test_background_failure_surfaces_at_the_next_save(mesh, tmp_path):
  root = tmp_path / 'ckpt'
  mgr = CheckpointManager(root, CheckpointOptions(mode='async'))
  mgr.save(1, make_state(mesh))
  mgr.wait_until_finished()
  shutil.rmtree(root)
  root.write_text('')
  mgr.save(2, make_state(mesh))
  with pytest.raises(CheckpointError, match='E-CKPT-001'):
    mgr.save(3, make_state(mesh))
  mgr.close()


def test_retention_keeps_last_k_and_every_p_th(mesh, tmp_path):
  state = make_state(mesh)
  with CheckpointManager(tmp_path, CheckpointOptions(keep=2, keep_every=4)) as mgr:
    for step in range(1, 11):
      mgr.save(step, state)
  assert list(committed_steps(tmp_path)) == [4, 8, 9, 10]
  assert sorted(os.listdir(tmp_path)) == [f'step_{s:08d}' for s in (4, 8, 9, 10)]


def test_time_cadence_with_an_injected_clock(mesh, tmp_path):
  now = [100.0]
  mgr = CheckpointManager(tmp_path, CheckpointOptions(every_secs=30, keep=0), clock=lambda: now[0])
  saved = []
  for step in range(1, 13):
    now[0] += 7.0  # each step takes 7 s
    if mgr.should_save(step):
      mgr.save(step, make_state(mesh))
      saved.append(step)
  mgr.close()
  assert saved == [5, 10]  # 35 s after the start, then 35 s after the save at step 5
  assert list(committed_steps(tmp_path)) == saved


def test_debris_is_invisible_to_readers_and_removed_by_the_next_writer(mesh, tmp_path):
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, make_state(mesh))
  shutil.copytree(tmp_path / 'step_00000001', tmp_path / 'step_00000002')
  (tmp_path / 'step_00000002' / layout.MANIFEST).unlink()
  (tmp_path / 'step_00000003.tmp-00112233aabb').mkdir()
  (tmp_path / 'step_00000001.deleting-00112233aabb').mkdir()
  reader = CheckpointManager(tmp_path, writer=False)
  assert reader.latest_step() == 1
  assert len(os.listdir(tmp_path)) == 4  # a reader never deletes
  with CheckpointManager(tmp_path) as writer:
    assert writer.latest_step() == 1
  assert os.listdir(tmp_path) == ['step_00000001']
  assert len(writer.removed_debris) == 3


@pytest.mark.parametrize('storage', ['safetensors', 'orbax'])
def test_damaged_checkpoint_is_refused(mesh, tmp_path, storage):
  state = make_state(mesh)
  with CheckpointManager(tmp_path, CheckpointOptions(storage=storage)) as mgr:
    mgr.save(1, state)
  manifest = json.loads((tmp_path / 'step_00000001' / layout.MANIFEST).read_text())
  biggest = max(manifest['files'], key=lambda f: manifest['files'][f]['size'])
  path = tmp_path / 'step_00000001' / biggest
  data = bytearray(path.read_bytes())
  # A bit of tensor data: the middle of what follows a safetensors file's header.
  start = 8 + int.from_bytes(data[:8], 'little') if path.suffix == '.safetensors' else 0
  data[(start + len(data)) // 2] ^= 0x01
  path.write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match='E-CKPT-003.*checksum mismatch'):
    CheckpointManager(tmp_path).restore(1, abstract(state))


def test_manifest_cannot_name_files_outside_the_checkpoint(mesh, tmp_path):
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, make_state(mesh))
  path = tmp_path / 'step_00000001' / layout.MANIFEST
  manifest = json.loads(path.read_text())
  manifest['files']['../../etc/passwd'] = {'size': 1, 'crc32': '00000000'}
  path.write_text(json.dumps(manifest))
  problems = CheckpointManager(tmp_path).verify(1)  # reported like `jaxckpt verify`, not followed
  assert any("outside the checkpoint: '../../etc/passwd'" in p for p in problems), problems


def test_restore_refuses_a_different_structure(mesh, tmp_path):
  state = make_state(mesh)
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, state)
  grown = dict(state, extra=jnp.zeros(2))
  with pytest.raises(CheckpointError, match='E-PARAM-001.*new'):
    CheckpointManager(tmp_path).restore(1, abstract(grown))
  reshaped = jax.tree.map(lambda x: x, state)
  reshaped['params']['b'] = jnp.zeros(15)
  with pytest.raises(CheckpointError, match='E-PARAM-002.*params/b'):
    CheckpointManager(tmp_path).restore(1, abstract(reshaped))


def test_saving_a_step_again_replaces_it_only_once_the_new_one_is_written(mesh, tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0)) as mgr:
    mgr.save(1, make_state(mesh, seed=0))
    mgr.save(1, make_state(mesh, seed=1))
  restored, _ = CheckpointManager(tmp_path).restore(1, abstract(make_state(mesh)))
  assert host(restored) == host(make_state(mesh, seed=1))
  assert os.listdir(tmp_path) == ['step_00000001']


def test_run_state_and_metadata_are_captured_at_the_call(mesh, tmp_path):
  """An async save writes what it was handed, even when the caller changes it right after."""
  run_state = {'bandit': {'pulls': [3, 4]}, 'counters': {'step': 7}}
  metadata = {'identity': {'tags': ['a']}}
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async')) as mgr:
    mgr.save(7, make_state(mesh), run_state, metadata=metadata)
    run_state['bandit']['pulls'][0] += 100  # the next steps mutate the live objects in place
    run_state['counters']['step'] = 8
    metadata['identity']['tags'].append('b')
  saved = json.loads((tmp_path / 'step_00000007' / 'run_state.json').read_text())
  assert saved == {'step': 7, 'bandit': {'pulls': [3, 4]}, 'counters': {'step': 7}}
  assert CheckpointManager(tmp_path).read_manifest(7)['identity'] == {'tags': ['a']}


def test_a_run_state_that_is_not_json_fails_in_the_callers_thread(mesh, tmp_path):
  with CheckpointManager(tmp_path) as mgr:
    with pytest.raises(CheckpointError, match='E-CKPT-011'):
      mgr.save(1, make_state(mesh), {'rng': object()})
  assert committed_steps(tmp_path) == {}


def test_continue_from_an_older_step_saves_the_replayed_steps_again(mesh, tmp_path):
  opts = CheckpointOptions(every_steps=10, keep=0)
  with CheckpointManager(tmp_path, opts) as mgr:
    for step in (10, 20, 30):
      mgr.save(step, make_state(mesh))
  mgr = CheckpointManager(tmp_path, opts)
  assert not mgr.should_save(20)  # by default the cadence counts from the newest commit (30)
  mgr.continue_from(10)
  assert [s for s in range(11, 41) if mgr.should_save(s)] == [20, 30, 40]


def test_a_failed_replacement_leaves_the_old_checkpoint_committed_and_intact(
    mesh, tmp_path, monkeypatch):
  old = make_state(mesh, seed=0)
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0)) as mgr:
    mgr.save(1, old)
  before = {p.name: p.read_bytes() for p in (tmp_path / 'step_00000001').rglob('*') if p.is_file()}
  real = atomic.write_file_durably

  def manifest_write_fails(path, data):  # the disk fills up as the new manifest is written
    if path.name == layout.MANIFEST:
      raise OSError(28, 'No space left on device')
    real(path, data)

  monkeypatch.setattr(atomic, 'write_file_durably', manifest_write_fails)
  with pytest.raises(CheckpointError, match='E-CKPT-001'):
    with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
      mgr.save(1, make_state(mesh, seed=1))
  monkeypatch.undo()
  assert os.listdir(tmp_path) == ['step_00000001']
  after = {p.name: p.read_bytes() for p in (tmp_path / 'step_00000001').rglob('*') if p.is_file()}
  assert after == before
  assert CheckpointManager(tmp_path).verify(1) == []


REPLACE_AND_DIE = """
import os, sys
import jax.numpy as jnp
from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, atomic
where, directory, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
real = atomic.exchange
def exchange(a, b):
  if where == 'before':
    os._exit(9)
  real(a, b)
  os._exit(9)  # swapped, the old version not yet removed
atomic.exchange = exchange
with CheckpointManager(directory, CheckpointOptions(keep=0, mode='sync')) as mgr:
  mgr.save(1, {'w': jnp.full((4,), value)})
"""


@pytest.mark.parametrize('where, expect', [('before', 1.0), ('after', 2.0)])
def test_a_crash_while_replacing_a_step_leaves_one_intact_version(tmp_path, where, expect):
  """SIGKILL-like exits on either side of the swap: the step is the old or the new checkpoint."""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO))
  for value in ('1.0', '2.0'):
    code = REPLACE_AND_DIE if value == '2.0' else REPLACE_AND_DIE.replace(
        'atomic.exchange = exchange', '')
    r = subprocess.run(
        [sys.executable, '-c', code, where, str(tmp_path), value],
        env=env,
        capture_output=True,
        text=True,
        timeout=120)
    assert r.returncode == (9 if value == '2.0' else 0), r.stderr
  mgr = CheckpointManager(tmp_path)  # a writer: removes the debris the crash left
  assert mgr.all_steps() == [1] and mgr.verify(1) == []
  target = {'w': jax.ShapeDtypeStruct((4,), jnp.float32)}
  restored, _ = mgr.restore(1, target)
  assert np.asarray(restored['w']).tolist() == [expect] * 4
  mgr.close()
  assert os.listdir(tmp_path) == ['step_00000001']


def test_retention_that_cannot_delete_warns_and_the_commit_stands(mesh, tmp_path, monkeypatch,
                                                                  caplog):
  infos = []
  with CheckpointManager(tmp_path, CheckpointOptions(keep=1), on_commit=infos.append) as mgr:
    mgr.save(1, make_state(mesh))
    # Retention's rename aside fails for real: the destination's directory does not exist.
    monkeypatch.setattr(layout, 'deleting_dir', lambda root, step: root / 'gone' / 'x')
    mgr.save(2, make_state(mesh))
    mgr.wait_until_finished()
  assert committed_steps(tmp_path).keys() == {1, 2}
  assert infos[-1].deleted == () and 'step 1: FileNotFoundError' in infos[-1].retention_errors[0]
  assert 'could not delete step 1' in caplog.text


def test_auto_mode_short_of_memory_writes_inline_without_a_staged_copy(mesh, tmp_path, monkeypatch):
  from jaxckpt.checkpoint import manager as manager_lib
  monkeypatch.setattr(manager_lib, 'available_host_memory', lambda: 1 << 10)
  state = make_state(mesh)
  with CheckpointManager(tmp_path, CheckpointOptions(mode='auto')) as mgr:
    mgr.save(1, state)
    assert mgr.mode_used == 'sync' and mgr._stager.nbytes() == 0  # decided before allocating
    assert committed_steps(tmp_path).keys() == {1}  # written inline, before save returned
  restored, _ = CheckpointManager(tmp_path).restore(1, abstract(state))
  assert host(restored) == host(state)


def test_auto_mode_weighs_memory_available_not_just_free(tmp_path):
  from jaxckpt.checkpoint import manager as manager_lib
  meminfo = tmp_path / 'meminfo'
  meminfo.write_text('MemTotal:       24000000 kB\nMemFree:          100000 kB\n'
                     'MemAvailable:   20000000 kB\nCached:         19000000 kB\n')
  assert manager_lib.available_host_memory(str(meminfo)) == 20000000 * 1024
  assert manager_lib.choose_mode('auto', 8 << 30, 20000000 * 1024) == 'async'
  assert manager_lib.choose_mode('auto', 12 << 30, 20000000 * 1024) == 'sync'
  assert manager_lib.choose_mode('sync', 0, None) == 'sync'
  assert manager_lib.choose_mode('auto', 1 << 40, None) == 'async'  # unknown: assume room
