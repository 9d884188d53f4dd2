"""The checkpoint library refuses, at the call, what it could not restore, and a closed or
read-only manager writes nothing: one `ArgumentError` naming the thing, nothing on disk."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, abandoned, layout
from jaxckpt.checkpoint.errors import ArgumentError, CheckpointError

TREE = {'w': jnp.arange(4, dtype=jnp.float32)}


def _nothing_written(root):
  return sorted(p.name for p in root.iterdir() if not p.name.startswith('.jaxckpt')) == []


@pytest.mark.parametrize(
    'key', ['files', 'tensors', 'step', 'format', 'manifest_crc32', 'retention', 'storage'])
def test_metadata_cannot_stand_in_for_the_manifest_s_own_fields(tmp_path, key):
  # {'files': {}} used to commit a checkpoint whose verify() found nothing to check.
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    with pytest.raises(ArgumentError, match=f'E-CKPT-021: metadata key.*{key}'):
      mgr.save(1, TREE, metadata={key: {}, 'mine': 1})
    assert _nothing_written(tmp_path)
    mgr.save(2, TREE, metadata={'user': {'files': {}}})  # nested under a key of its own
  assert CheckpointManager(tmp_path, writer=False).read_manifest(2)['user'] == {'files': {}}


@pytest.mark.parametrize(
    'tree', [
        {'a/b': jnp.ones(2), 'a': {'b': jnp.zeros(3)}},
        {'': {'': jnp.ones(1)}, '/': jnp.ones(1)},
        {'__metadata__': jnp.ones(1)},
    ],
    ids=['slash', 'empty', 'metadata'])
def test_two_leaves_of_one_name_are_refused(tmp_path, tree):
  # One of the two used to be dropped: a committed checkpoint that restore() could not fill.
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    with pytest.raises(ArgumentError, match='E-CKPT-021: leaf name'):
      mgr.save(1, tree)
  assert _nothing_written(tmp_path)


@pytest.mark.parametrize('mode', ['sync', 'async'])
def test_a_deleted_array_is_refused_not_a_crash(tmp_path, mode):
  x = jnp.arange(10.0)
  x.delete()  # as a donated buffer is: is_ready() on it crashed the process
  with CheckpointManager(tmp_path, CheckpointOptions(mode=mode)) as mgr:
    with pytest.raises(ArgumentError, match="E-CKPT-021: leaf 'x' was deleted"):
      mgr.save(1, {'x': x})
  assert _nothing_written(tmp_path)


@pytest.mark.parametrize('leaf', [True, 3, 2.5, 'text'], ids=['bool', 'int', 'float', 'str'])
def test_a_leaf_that_is_not_an_array_is_named(tmp_path, leaf):
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    with pytest.raises(ArgumentError, match="E-CKPT-021: leaf 'n' is a .*, not an array"):
      mgr.save(1, {'n': leaf, 'w': TREE['w']})


@pytest.mark.parametrize('step', [-1, 3.0, '7', True, None])
def test_a_step_that_is_no_step_number_is_refused(tmp_path, step):
  # -1 used to write step_-0000001/, which no listing shows and no writer removes.
  with CheckpointManager(tmp_path, CheckpointOptions(mode='async')) as mgr:
    with pytest.raises(ArgumentError, match='E-CKPT-021: step .* is not a step number'):
      mgr.save(step, TREE)
  assert _nothing_written(tmp_path)


def test_a_numpy_step_is_a_step(tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(np.int64(5), TREE, {'k': 1})
  reader = CheckpointManager(tmp_path, writer=False)
  assert reader.all_steps() == [5]
  state, run_state = reader.restore(np.int32(5), TREE)
  assert run_state == {'step': 5, 'k': 1} and np.array_equal(state['w'], TREE['w'])


def test_a_closed_manager_writes_nothing(tmp_path):
  mgr = CheckpointManager(tmp_path, CheckpointOptions(mode='sync'))
  mgr.close()
  other = CheckpointManager(tmp_path)  # it holds the directory now
  for call in (lambda: mgr.save(1, TREE), lambda: mgr.prepare(TREE), lambda: mgr.continue_from(0)):
    with pytest.raises(
        ArgumentError, match='E-CKPT-022: .* on a CheckpointManager that was '
        'closed'):
      call()
  assert _nothing_written(tmp_path)
  other.close()


def test_a_reader_does_not_record_abandoned_checkpoints(tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync', keep=0)) as mgr:
    for step in (5, 9):
      mgr.save(step, TREE)
  reader = CheckpointManager(tmp_path, writer=False)
  with pytest.raises(CheckpointError, match='E-CKPT-008: continue_from'):
    reader.continue_from(5)  # it used to hide step 9 from every reader and writer
  assert not (tmp_path / abandoned.FILE).exists() and reader.latest_step() == 9


def test_restoring_a_step_that_is_not_there_names_what_is(tmp_path):
  reader = CheckpointManager(tmp_path, writer=False)
  with pytest.raises(ArgumentError, match='E-CKPT-021: step None'):
    reader.restore(reader.latest_step(), TREE)  # nothing saved yet: a TypeError from pathlib
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(3, TREE)
    mgr.save(4, TREE)
  with pytest.raises(
      ArgumentError,
      match=r'E-CKPT-010: step 7 is not a committed checkpoint '
      r'under .* \(steps 3..4\)'):
    reader.restore(7, TREE)
  assert reader.restore(4, TREE)[1] == {'step': 4}


def test_the_body_s_error_is_the_one_a_with_block_raises(tmp_path):
  """A background failure found at the exit is said with it, not raised over it."""

  def failing(info):
    raise RuntimeError('callback broke')

  with pytest.raises(KeyError) as raised:
    with CheckpointManager(tmp_path, CheckpointOptions(mode='async'), on_commit=failing) as mgr:
      mgr.save(1, TREE)
      raise KeyError('from the loop')
  assert any('E-CKPT-009' in note for note in raised.value.__notes__)
  assert layout.committed_steps(tmp_path).keys() == {1}  # committed before its callback


@pytest.mark.parametrize('replicas', [1, 7])
def test_replicas_one_process_cannot_hold_are_refused_not_ignored(tmp_path, replicas):
  # It used to save process 0's part alone, without a word: no copy anywhere.
  with pytest.raises(
      ArgumentError, match=f'E-CONFIG-010: replicas={replicas} needs several '
      'processes'):
    CheckpointManager(tmp_path, CheckpointOptions(replicas=replicas))
  assert not (tmp_path / '.jaxckpt-writer').exists()
  CheckpointManager(tmp_path, CheckpointOptions(replicas=replicas), writer=False)  # a reader


def test_replicas_with_orbax_files_are_refused():
  from jaxckpt.checkpoint import replicas
  with pytest.raises(ArgumentError, match="E-CONFIG-010: replicas=1 with storage='orbax'"):
    replicas.check(1, 3, False, 'orbax')
  replicas.check(1, 3, False, 'safetensors')
