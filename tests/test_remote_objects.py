"""`remote.objects` on its own, against a real path store: what an upload that fails leaves."""

import gc
import os
import warnings

import jax.numpy as jnp
import pytest

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout, manifest
from jaxckpt.checkpoint.remote import Store, objects


def open_descriptors() -> int:
  return len(os.listdir('/proc/self/fd'))


@pytest.mark.skipif(not os.path.isdir('/proc/self/fd'), reason='counts /proc/self/fd')
def test_a_failed_upload_closes_every_file_it_opened(tmp_path):
  """Local retention deleting a checkpoint while it is uploaded: its first file opens, a later
  one is gone. The uploader retries; each retry must give back the descriptors it took."""
  root = tmp_path / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    mgr.save(1, {'w': jnp.arange(1000.0), 'b': jnp.arange(7)}, {'step': 1})
  step_dir = root / layout.step_dirname(1)
  files = list(manifest.read(step_dir)['files'])
  assert len(files) >= 2, files  # one opens before the missing one is tried
  (step_dir / files[-1]).unlink()
  store = Store(str(tmp_path / 'run'))  # tmp_path: the mounted disk
  gc.collect()  # what earlier tests left to the collector closes now, not inside the count
  before = open_descriptors()
  # CPython's refcounting closes a dropped file object at once, but as a leak: with a
  # ResourceWarning (elsewhere, or with a reference kept, the descriptor stays open).
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always', ResourceWarning)
    for _ in range(20):
      with pytest.raises(FileNotFoundError):
        objects.upload(store, step_dir, {})
    gc.collect()
  # Never more: 20 retries that each kept one would be 20 more. Fewer is this process's other
  # connections (the session's servers) closing meanwhile.
  assert open_descriptors() <= before
  assert [str(w.message) for w in caught if w.category is ResourceWarning] == []
  assert objects.committed(store) == {}  # nothing half-uploaded looks committed


def test_an_upload_reads_the_state_from_the_save_memory_until_the_next_save(tmp_path):
  """The state file is sent from the staging buffer it was written from: the disk copy is not
  read (here it is damaged after the commit, and the upload is still the saved bytes). Once the
  next save stages over the buffer, the upload reads the disk, and a damaged file is refused."""
  infos = []
  root = tmp_path / 'checkpoints'
  state = {'w': jnp.arange(100_000.0), 'b': jnp.arange(7)}
  store = Store(str(tmp_path / 'run'))
  with CheckpointManager(
      root, CheckpointOptions(every_steps=1, keep=0), on_commit=infos.append) as mgr:
    mgr.save(1, state, {'step': 1})
    mgr.wait_until_finished()
    step_dir = root / layout.step_dirname(1)
    rel = f'{layout.STATE_DIR}/process_0.safetensors'
    saved = (step_dir / rel).read_bytes()
    held = infos[-1].in_memory[rel]
    with open(step_dir / rel, 'r+b') as f:  # the disk copy changes under the upload
      f.seek(len(saved) - 8)
      f.write(b'\xff' * 8)
    objects.upload(store, step_dir, {}, memory=infos[-1].in_memory)
    assert held.served == len(saved)
    downloaded, _ = objects.download(store, 1, tmp_path / 'down')
    assert (downloaded / rel).read_bytes() == saved

    mgr.save(2, state, {'step': 2})  # stages over the buffer step 1 was written from
    mgr.wait_until_finished()
    assert held.read(0, 8) is None
    with pytest.raises(objects.DamagedLocal, match='E-STORE-013|checksum mismatch'):
      objects.upload(store, step_dir, {}, attempt=objects.new_attempt(), memory=infos[0].in_memory)
