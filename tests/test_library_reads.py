"""The checkpoint library's options, dtypes, races with retention and restore targets, at the
edges: what is refused at the call, what a reader racing a writer's retention is told, and what
a target of numpy arrays restores into."""

import math
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxckpt.checkpoint import (ArgumentError, CheckpointError, CheckpointManager,
                                CheckpointOptions, formats, manifest, orbaxstore, reading, staging,
                                statefile)


def _saved(directory: Path, state, **options) -> Path:
  """`state` committed as step 1 under `directory` (written inline); its step directory."""
  with CheckpointManager(directory, CheckpointOptions(mode='sync', keep=0, **options)) as mgr:
    mgr.save(1, state, run_state={'data_position': 1})
    return mgr.step_dir(1)


def _retire(step_dir: Path) -> None:
  """What a writer's retention does to a step: renamed aside, then deleted."""
  gone = step_dir.with_name(step_dir.name + '.deleting-0123456789ab')
  os.rename(step_dir, gone)
  shutil.rmtree(gone)


STATE = {'w': jnp.arange(12.0).reshape(3, 4), 'v': jnp.arange(5, dtype=jnp.int32)}


# -------------------------------------------------------------------- A: options checked whole
@pytest.mark.parametrize('field, value', [
    ('barrier_timeout_secs', math.nan),
    ('barrier_timeout_secs', -400),
    ('barrier_timeout_secs', 0),
    ('barrier_timeout_secs', math.inf),
    ('barrier_timeout_secs', '600'),
    ('keep', 2.5),
    ('keep', '3'),
    ('keep', None),
    ('keep', True),
    ('keep', -1),
    ('keep_every', 1.0),
    ('keep_best', np.float32(2)),
    ('replicas', np.bool_(True)),
    ('every_steps', 2.5),
    ('every_secs', math.nan),
    ('every_secs', math.inf),
    ('every_secs', -1.0),
    ('every_secs', '60'),
    ('every_secs', True),
])
def test_an_option_out_of_range_is_refused_naming_it(field, value):
  with pytest.raises(ArgumentError) as e:
    CheckpointOptions(**{field: value})
  assert e.value.code == 'E-CONFIG-004'
  assert field in e.value.what and repr(value) in e.value.what
  assert '\n' not in str(e.value)


def test_numpy_counts_are_taken_as_ints_and_whole_seconds_as_seconds():
  o = CheckpointOptions(
      every_steps=np.int64(10),
      keep=np.int32(2),
      keep_every=np.uint8(0),
      keep_best=0,
      replicas=np.int16(1),
      every_secs=np.float32(1.5),
      barrier_timeout_secs=30)
  assert (o.every_steps, o.keep, o.replicas, o.every_secs, o.barrier_timeout_secs) == \
      (10, 2, 1, 1.5, 30.0)
  assert all(type(getattr(o, f)) is int for f in ('every_steps', 'keep', 'keep_every', 'replicas'))
  assert type(o.every_secs) is float and type(o.barrier_timeout_secs) is float


# ------------------------------------------------------------------- B: dtypes and orbax's limits
@pytest.mark.parametrize('mode, where', [('sync', 'host'), ('async', 'host'), ('async', 'device')])
def test_orbax_saves_what_safetensors_has_no_code_for(tmp_path, mode, where):
  state = {
      'z': jnp.array([1 + 2j, -3.5j, np.nan + 0j], jnp.complex64),
      'q': jnp.array([1, -2, 7, -8], jnp.int4), 'w': jnp.ones(3, jnp.bfloat16)
  }
  with CheckpointManager(tmp_path, CheckpointOptions(storage='orbax', mode=mode,
                                                     staging=where)) as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    back, _ = mgr.restore(1, state)
  for name, x in state.items():
    assert back[name].dtype == x.dtype
    assert np.asarray(back[name]).tobytes() == np.asarray(x).tobytes()


def test_safetensors_still_refuses_complex_naming_the_leaf(tmp_path):
  with pytest.raises(CheckpointError, match='E-CKPT-013.*z: dtype complex64'):
    staging.check_storable('safetensors', {'z': np.zeros(2, np.complex64)})
  with pytest.raises(CheckpointError, match='E-CKPT-013.*complex64'):
    with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
      mgr.save(1, {'z': jnp.zeros(2, jnp.complex64)})
  assert not list(tmp_path.glob('step_*'))


@pytest.mark.parametrize('leaves, words', [
    ({'a': np.zeros((0, 3), np.float32), 'b': np.ones(2, np.float32)}, 'zero-size array: a'),
    ({}, 'empty state'),
    ({'u': np.zeros(2, ml_dtypes.uint4)}, 'dtype uint4'),
])
def test_what_orbax_cannot_save_is_one_line_before_anything_is_written(tmp_path, leaves, words):
  with pytest.raises(ArgumentError) as e:
    staging.check_storable('orbax', leaves)
  assert e.value.code == 'E-CKPT-013' and words in str(e.value) and '\n' not in str(e.value)
  with pytest.raises(ArgumentError, match=words):
    orbaxstore.save(tmp_path / 'state', leaves)
  assert not (tmp_path / 'state').exists()
  staging.check_storable('safetensors', leaves if 'u' not in leaves else {})  # fine there


def test_a_zero_size_array_with_orbax_says_why_not_what_orbax_said(tmp_path):
  with pytest.raises(CheckpointError, match='orbax cannot save a zero-size array: a'):
    with CheckpointManager(tmp_path, CheckpointOptions(storage='orbax', mode='sync')) as mgr:
      mgr.save(1, {'a': jnp.zeros((0, 2)), 'b': jnp.ones(2)})


# -------------------------------------------------------------- C: a step removed while it is read
def _reader_restore(directory: Path, target=STATE, **kw):
  return CheckpointManager(directory, writer=False).restore(1, target, **kw)


def _assert_removed(e: pytest.ExceptionInfo) -> None:
  assert isinstance(e.value, CheckpointError) and e.value.code == 'E-CKPT-010', e.value
  assert 'removed while' in e.value.what and 'damaged' not in str(e.value)


def test_removed_before_its_files_are_audited_is_not_damage(tmp_path, monkeypatch):
  _saved(tmp_path, STATE)
  real = manifest.audit

  def audit(step_dir, *a, **kw):
    _retire(step_dir)
    return real(step_dir, *a, **kw)

  monkeypatch.setattr(manifest, 'audit', audit)
  with pytest.raises(CheckpointError) as e:
    _reader_restore(tmp_path)
  _assert_removed(e)


@pytest.mark.parametrize('meanwhile', [None, lambda: None])
@pytest.mark.parametrize('when', ['before the state file is found', 'after its header is read'])
def test_removed_while_its_state_file_is_read_is_not_a_raw_error(tmp_path, monkeypatch, when,
                                                                 meanwhile):
  step_dir = _saved(tmp_path, STATE)
  if when == 'before the state file is found':
    real = reading.read_state_file

    def read_state_file(*a, **kw):
      _retire(step_dir)
      return real(*a, **kw)

    monkeypatch.setattr(reading, 'read_state_file', read_state_file)
  else:
    real = statefile.read_header

    def read_header(*a, **kw):
      out = real(*a, **kw)
      _retire(step_dir)  # the next open of the file finds nothing
      return out

    monkeypatch.setattr(statefile, 'read_header', read_header)
  with pytest.raises(CheckpointError) as e:
    _reader_restore(tmp_path, meanwhile=meanwhile)
  _assert_removed(e)


@pytest.mark.parametrize('meanwhile', [None, lambda: None])
def test_a_device_out_of_memory_while_the_step_is_removed_is_said_as_it_is(
    tmp_path, monkeypatch, meanwhile):
  """The read runs out of device memory (a real allocation past it) while retention removes the
  step: the reader is told of the memory, its own problem, not that the step was removed (taking
  the newest again would fail the same way)."""
  step_dir = _saved(tmp_path, STATE)

  def read_state_file(*_, **__):
    _retire(step_dir)
    return jnp.zeros((2**45,), jnp.uint8).block_until_ready()  # 32 TiB

  monkeypatch.setattr(reading, 'read_state_file', read_state_file)
  with pytest.raises(jax.errors.JaxRuntimeError, match='RESOURCE_EXHAUSTED'):
    _reader_restore(tmp_path, meanwhile=meanwhile)


@pytest.mark.parametrize('meanwhile', [None, lambda: None])
def test_a_step_saved_again_while_it_is_read_is_not_damage(tmp_path, monkeypatch, meanwhile):
  """A writer that went back saves the step again, swapping its new commit in (as `publish_dir`
  does) after the reader took the old manifest: the files it then reads fail the old CRCs."""
  from jaxckpt.checkpoint import atomic
  step_dir = _saved(tmp_path / 'run', STATE)
  again = _saved(tmp_path / 'again', {n: x + 1 for n, x in STATE.items()})
  real = statefile.read_header

  def read_header(*a, **kw):
    out = real(*a, **kw)
    if again.exists():
      atomic.publish_dir(again, step_dir)  # the replay's commit, in one exchange
    return out

  monkeypatch.setattr(statefile, 'read_header', read_header)
  with pytest.raises(CheckpointError) as e:
    _reader_restore(tmp_path / 'run', meanwhile=meanwhile)
  assert e.value.code == 'E-CKPT-010' and 'replaced by another commit' in e.value.what, e.value
  monkeypatch.undo()
  state, _ = _reader_restore(tmp_path / 'run')  # restored again: the new commit, whole
  assert all(np.array_equal(state[n], STATE[n] + 1) for n in STATE)


def test_removed_while_orbax_reads_it_is_not_a_raw_error(tmp_path, monkeypatch):
  _saved(tmp_path, STATE, storage='orbax')
  real = orbaxstore.restore

  def restore(directory, *a, **kw):
    _retire(directory.parent)
    return real(directory, *a, **kw)

  monkeypatch.setattr(orbaxstore, 'restore', restore)
  with pytest.raises(CheckpointError) as e:
    _reader_restore(tmp_path)
  _assert_removed(e)


def test_run_state_of_a_removed_step_is_removed_not_missing(tmp_path):
  step_dir = _saved(tmp_path, STATE)
  assert reading.read_run_state(step_dir) == {'step': 1, 'data_position': 1}
  _retire(step_dir)
  with pytest.raises(CheckpointError) as e:
    reading.read_run_state(step_dir)
  _assert_removed(e)


def test_a_file_missing_from_a_checkpoint_still_there_is_damage(tmp_path):
  step_dir = _saved(tmp_path, STATE)
  (step_dir / 'state' / statefile.file_name(0)).unlink()
  with pytest.raises(CheckpointError) as e:
    _reader_restore(tmp_path)
  assert e.value.code == 'E-CKPT-003' and 'missing' in str(e.value)
  with pytest.raises(CheckpointError) as e:  # no audit: the read finds it gone
    _reader_restore(tmp_path, verify=False)
  assert e.value.code in ('E-CKPT-003', 'E-CKPT-012') and 'damaged' in str(e.value)
  (step_dir / 'run_state.json').unlink()
  with pytest.raises(CheckpointError) as e:
    reading.read_run_state(step_dir)
  assert e.value.code == 'E-CKPT-004'


# ------------------------------------------------------------- D: targets without a sharding
@pytest.mark.parametrize('storage', ['safetensors', 'orbax'])
@pytest.mark.parametrize('meanwhile', [None, lambda: None])
@pytest.mark.parametrize('kind', ['numpy', 'ShapeDtypeStruct without sharding'])
def test_a_target_without_sharding_lands_on_the_default_device(tmp_path, storage, meanwhile, kind):
  state = {'w': np.arange(12.0, dtype=np.float32).reshape(3, 4), 's': np.float32(2.5)}
  _saved(tmp_path, state, storage=storage)
  target = state if kind == 'numpy' else {
      n: jax.ShapeDtypeStruct(np.shape(x), x.dtype) for n, x in state.items()
  }
  back, run_state = _reader_restore(tmp_path, target=target, meanwhile=meanwhile)
  assert run_state['step'] == 1
  for name, x in state.items():
    assert isinstance(back[name], jax.Array)
    assert back[name].sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(back[name]), x)


def test_a_target_leaf_that_is_not_an_array_is_named_before_anything_is_read(tmp_path, monkeypatch):
  _saved(tmp_path, {'w': np.ones(3, np.float32), 'n': np.ones(2, np.float32)})

  def never(*a, **kw):
    raise AssertionError('the state file was read')

  monkeypatch.setattr(reading, 'read_state_file', never)
  monkeypatch.setattr(formats, 'read_state_file', never)
  with pytest.raises(ArgumentError) as e:
    _reader_restore(tmp_path, target={'w': np.ones(3, np.float32), 'n': 'weights'})
  assert "'n'" in e.value.what and 'str' in e.value.what and '\n' not in str(e.value)
