"""A checkpoint survives the edges of its commit: a replace on a filesystem that cannot swap two
names (NFS, FUSE, an old libc), an fsync that fails once the manifest is in place, and a delete
of the checkpoint a start would resume from.

The filesystem's limits are stood in for where this machine has none: `atomic.exchange` made to
answer False (as it does where renameat2 is refused), a rename or an fsync made to fail with EIO.
"""

import errno
import os
import subprocess

import numpy as np
import pytest
from conftest import flip_a_data_byte, jaxckpt_cli, read_arrays

from jaxckpt.checkpoint import CheckpointError, CheckpointManager, CheckpointOptions, atomic, layout


def state(value: float) -> dict[str, np.ndarray]:
  return {'w': np.full((4096,), value, np.float32)}


def save(root, step: int, value: float) -> None:
  with CheckpointManager(root, CheckpointOptions(mode='sync', keep=0)) as mgr:
    mgr.save(step, state(value))


def test_a_replace_cut_short_between_its_renames_is_put_back_at_the_next_open(tmp_path):
  # What a crash between the fallback's two renames leaves: the committed step set aside, whole,
  # and no step of that number.
  save(tmp_path, 5, 1.0)
  step_dir = tmp_path / layout.step_dirname(5)
  aside = step_dir.with_name(step_dir.name + atomic.ASIDE_MARK + '0123456789ab')
  os.rename(step_dir, aside)
  (tmp_path / (step_dir.name + '.tmp-00000000000a')).mkdir()  # the new version, never renamed
  with CheckpointManager(tmp_path) as mgr:
    assert mgr.all_steps() == [5]
  assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir.name]
  np.testing.assert_array_equal(read_arrays(step_dir)['w'], state(1.0)['w'])


def test_a_set_aside_copy_of_a_step_committed_since_is_debris(tmp_path):
  save(tmp_path, 5, 1.0)
  step_dir = tmp_path / layout.step_dirname(5)
  aside = step_dir.with_name(step_dir.name + atomic.ASIDE_MARK + '0123456789ab')
  os.rename(step_dir, aside)
  save(tmp_path, 5, 2.0)  # the new version committed; the old one aside is removed at open
  with CheckpointManager(tmp_path) as mgr:
    assert mgr.all_steps() == [5]
  assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir.name]
  np.testing.assert_array_equal(read_arrays(step_dir)['w'], state(2.0)['w'])


def test_a_replace_whose_second_rename_fails_keeps_the_old_version(tmp_path, monkeypatch):
  save(tmp_path, 5, 1.0)
  step_dir = tmp_path / layout.step_dirname(5)
  monkeypatch.setattr(atomic, 'exchange', lambda a, b: False)
  rename = os.rename

  def failing(src, dst):
    if '.tmp-' in str(src) and str(dst) == str(step_dir):
      raise OSError(errno.EIO, 'Input/output error')
    rename(src, dst)

  monkeypatch.setattr(atomic.os, 'rename', failing)
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync', keep=0)) as mgr:
    with pytest.raises(CheckpointError) as e:
      mgr.save(5, state(2.0))
  assert e.value.code == 'E-CKPT-001' and 'nothing was committed for step 5' in e.value.fix
  monkeypatch.undo()
  with CheckpointManager(tmp_path) as mgr:
    assert mgr.all_steps() == [5]
  assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir.name]
  np.testing.assert_array_equal(read_arrays(step_dir)['w'], state(1.0)['w'])


def test_a_replace_without_exchange_swaps_the_versions(tmp_path, monkeypatch):
  save(tmp_path, 5, 1.0)
  monkeypatch.setattr(atomic, 'exchange', lambda a, b: False)
  save(tmp_path, 5, 2.0)
  step_dir = tmp_path / layout.step_dirname(5)
  assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir.name]
  np.testing.assert_array_equal(read_arrays(step_dir)['w'], state(2.0)['w'])


def test_an_fsync_failing_after_the_manifest_is_in_place_is_not_called_nothing_committed(
    tmp_path, monkeypatch):
  step_dir = tmp_path / layout.step_dirname(3)
  fsync_dir = atomic.fsync_dir

  def failing(path):
    if str(path) == str(step_dir) and (step_dir / layout.MANIFEST).exists():
      raise OSError(errno.EIO, 'Input/output error')
    fsync_dir(path)

  monkeypatch.setattr(atomic, 'fsync_dir', failing)
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    with pytest.raises(CheckpointError) as e:
      mgr.save(3, state(1.0))
  assert e.value.code == 'E-CKPT-001', e.value
  assert 'is in place but its durability was not confirmed' in e.value.what, e.value
  assert 'nothing was committed' not in e.value.fix and 'a reader sees it' in e.value.fix


def test_delete_refuses_the_checkpoint_a_start_would_resume_from(tmp_path):
  root = tmp_path / 'checkpoints'
  save(root, 1, 1.0)
  save(root, 2, 2.0)
  flip_a_data_byte(root / layout.step_dirname(2))  # step 2 damaged: a start resumes from 1
  r = jaxckpt_cli('delete', str(root / layout.step_dirname(1)))
  assert r.returncode == 2, r.stderr
  assert r.stderr.startswith('jaxckpt: E-DELETE-002: ') and 'newest intact' in r.stderr, r.stderr
  assert (root / layout.step_dirname(1) / layout.MANIFEST).is_file()
  r = jaxckpt_cli('delete', str(root / layout.step_dirname(1)), '--newest')
  assert r.returncode == 0, r.stderr
  assert not (root / layout.step_dirname(1)).exists()


def test_a_checkpoint_directory_that_cannot_be_written_is_refused_at_open(tmp_path):
  (tmp_path / 'file').write_text('')
  with pytest.raises(CheckpointError) as e:
    CheckpointManager(tmp_path / 'file' / 'checkpoints')
  assert e.value.code == 'E-CKPT-019' and 'cannot be written' in e.value.what, e.value
  if os.geteuid() != 0:
    return  # a read-only mount (below) needs root; permission bits do not stop root
  disk = tmp_path / 'ro'
  disk.mkdir()
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=64k,ro', 'tmpfs', str(disk)], check=True)
  try:
    with pytest.raises(CheckpointError) as e:
      CheckpointManager(disk)
    assert e.value.code == 'E-CKPT-019' and 'Read-only file system' in e.value.what, e.value
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False)
