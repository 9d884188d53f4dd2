"""The remote tier's library parts against real servers on loopback: moto's S3 server, a GCS
emulator, and a path. Uploads land manifest last; downloads are byte-identical and CRC-checked;
the lease admits one writer; the uploader survives a store that goes away."""

import concurrent.futures
import os
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import wait_for

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.checkpoint.remote import Lease, LeaseError, Store, StoreError, Uploader, objects


def _state(seed=0, n=300_000):
  rng = np.random.default_rng(seed)
  return {'w': jnp.asarray(rng.standard_normal(n, dtype=np.float32)), 'b': jnp.arange(7)}


@pytest.fixture(scope='module')
def local_checkpoint(tmp_path_factory):
  root = tmp_path_factory.mktemp('local') / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    for step in (1, 2):
      mgr.save(step, _state(step), {'step': step}, metadata={'metrics': {'heldout_loss': 3 - step}})
  return root


@pytest.fixture(params=['s3', 'gs', 'path'])
def store(request, tmp_path):
  if request.param == 's3':
    return Store(request.getfixturevalue('s3_server').bucket())
  if request.param == 'gs':
    return Store(request.getfixturevalue('gcs_server').bucket())
  return Store(str(tmp_path / 'run'))  # tmp_path: the mounted disk


def test_upload_then_download_is_byte_identical(store, local_checkpoint, tmp_path):
  step_dir = local_checkpoint / layout.step_dirname(2)
  objects.upload(store, step_dir, {'loss.jsonl': b'{"step":1}\n'}, part_bytes=256 << 10)
  keys = store.list('checkpoints/')
  assert any('.part-' in k for k in keys)  # the 1.2 MB state file went in parts
  assert objects.latest_intact(store) == (2, [])
  got, records = objects.download(store, 2, tmp_path / 'fresh')
  assert records == {'loss.jsonl': b'{"step":1}\n'}
  for path in step_dir.rglob('*'):
    if path.is_file():
      assert (got / path.relative_to(step_dir)).read_bytes() == path.read_bytes(), path
  assert not [p for p in (tmp_path / 'fresh').iterdir() if p.name != got.name]  # no debris


def test_a_manifest_without_its_objects_is_not_intact(store, local_checkpoint):
  objects.upload(store, local_checkpoint / layout.step_dirname(1), {}, part_bytes=256 << 10)
  objects.upload(store, local_checkpoint / layout.step_dirname(2), {}, part_bytes=256 << 10)
  part = next(k for k in store.list('checkpoints/step_00000002/') if '.part-' in k)
  store.delete(part)
  step, skipped = objects.latest_intact(store)
  assert step == 1 and skipped[0][0] == 2 and 'missing' in skipped[0][1]


def test_download_checks_every_byte(s3_server, local_checkpoint, tmp_path):
  store = Store(s3_server.bucket())
  objects.upload(store, local_checkpoint / layout.step_dirname(2), {}, part_bytes=256 << 10)
  part = next(k for k in store.list('checkpoints/step_00000002/') if '.part-00002' in k)
  data = bytearray(store.read(part))
  data[1000] ^= 1
  store.write(part, bytes(data))
  with pytest.raises(CheckpointError, match='E-STORE-012.*checksum mismatch'):
    objects.download(store, 2, tmp_path / 'fresh')
  assert not list((tmp_path / 'fresh').iterdir())  # nothing half-downloaded is left


def test_lease_admits_one_writer_and_stale_ones_are_taken_over(s3_server):
  url = s3_server.bucket()
  first = Lease(Store(url), ttl_secs=1.0)
  assert first.acquire() is None
  second = Lease(Store(url), ttl_secs=1.0)
  with pytest.raises(LeaseError, match=f'E-STORE-006: {url} is in use by another trainer: .* pid'):
    second.acquire()
  time.sleep(1.2)  # first stops renewing: its lease goes stale
  assert second.acquire()['id'] == first.me['id']  # taken over, naming the old holder
  with pytest.raises(LeaseError, match='E-STORE-007: lost the lease'):
    first.renew()  # the old holder finds out at its next renewal, and stops
  second.release()
  assert Store(url).read('LEASE') is None


def test_uploader_retries_until_the_store_is_back(s3_server, local_checkpoint):
  url = s3_server.bucket()
  store = Store(url)
  events = []
  uploader = Uploader(store, on_event=lambda name, **f: events.append(name))
  try:
    s3_server.stop()
    uploader.submit(1, local_checkpoint / layout.step_dirname(1))
    wait_for(lambda: 'upload_failed' in events, timeout=30)
    uploader.submit(2, local_checkpoint / layout.step_dirname(2))  # supersedes step 1
    s3_server.start()
    assert uploader.wait(2, timeout=60)
  finally:
    uploader.close()
  assert sorted(objects.committed(store)) == [2]  # the newest went up; step 1 was skipped
  assert uploader.error is None


def test_remote_retention_deletes_only_after_a_newer_commit(s3_server, local_checkpoint):
  from jaxckpt.checkpoint import RetentionPolicy
  store = Store(s3_server.bucket())
  # The parts of an upload abandoned before its commit: debris once a newer step commits.
  objects.upload(store, local_checkpoint / layout.step_dirname(1), {}, commit=False)
  assert objects.steps(store) == ({}, [1])  # no step committed; step 1's parts there
  uploader = Uploader(store, retention=RetentionPolicy(keep=1))
  try:
    uploader.submit(1, local_checkpoint / layout.step_dirname(1))
    assert uploader.wait(1, timeout=30)
    assert sorted(objects.committed(store)) == [1]
    uploader.submit(2, local_checkpoint / layout.step_dirname(2))
    assert uploader.wait(2, timeout=30)
  finally:
    uploader.close()
  wait_for(lambda: sorted(objects.committed(store)) == [2], timeout=10)
  assert not store.list('checkpoints/step_00000001/')


def test_each_process_uploads_its_own_state_file_and_process_0_the_rest():
  from jaxckpt.checkpoint.remote import Parts
  files = ['run_state.json'] + [f'state/process_{k}.safetensors' for k in range(4)]
  # A checkpoint of 4 processes, uploaded by 2: process 0 also takes the parts nobody runs.
  assert Parts(
      0, 2, client=object()).mine(files) == [
          'run_state.json', 'state/process_0.safetensors', 'state/process_2.safetensors',
          'state/process_3.safetensors'
      ]
  assert Parts(1, 2, client=object()).mine(files) == ['state/process_1.safetensors']


@pytest.mark.parametrize('url, kind', [('az://x/y', 'E-STORE-001'), ('s3:///x', 'E-STORE-001')])
def test_unknown_schemes_are_refused(url, kind):
  with pytest.raises(StoreError, match=kind):
    Store(url)


def test_a_mounted_path_that_does_not_answer_fails_the_request_naming_it(tmp_path, monkeypatch):
  # A named pipe with no writer: opening it waits for good, as a read on a hung mount does.
  from jaxckpt.checkpoint.remote import store as store_lib
  monkeypatch.setattr(store_lib, 'FILE_OP_SECS', 1.0)
  (tmp_path / 'bucket').mkdir()
  store = Store(f'file://{tmp_path}/bucket/run')
  store.write('ok', b'1')
  os.mkfifo(tmp_path / 'bucket' / 'run' / 'hung')
  assert store.read('ok') == b'1' and store.list() == ['hung', 'ok']
  waiter = concurrent.futures.ThreadPoolExecutor(3)  # a request without a bound fails, not hangs
  for request in (lambda: store.read('hung'), lambda: store.read_range('hung', 0, 4),
                  lambda: store.start_read('hung').result()):
    with pytest.raises(StoreError) as e:
      waiter.submit(request).result(timeout=60)
    assert e.value.code == 'E-STORE-010' and e.value.what.startswith(
        f'read file://{tmp_path}/bucket/run/hung failed'), e.value
    assert 'a mount that does not answer' in e.value.fix, e.value
  waiter.shutdown(wait=False)


def test_deletes_stop_at_the_first_batch_their_fence_refuses(tmp_path):
  # The lease check runs before each batch: once it raises, nothing more is deleted.
  from jaxckpt.checkpoint.remote import store as store_lib
  (tmp_path / 'bucket').mkdir()
  store = Store(f'file://{tmp_path}/bucket/run')
  keys = [f'k{i:04d}' for i in range(store_lib.DELETE_BATCH * 3)]
  store.write_many({k: b'x' for k in keys})
  checks = []

  def fence():
    checks.append(len(store.list()))
    if len(checks) == 2:
      raise LeaseError('E-STORE-007', 'not written: the lease was lost', 'stop')

  with pytest.raises(LeaseError):
    store.delete_many(keys, fence=fence)
  assert checks == [len(keys), len(keys) - store_lib.DELETE_BATCH]
  assert store.list() == keys[store_lib.DELETE_BATCH:]


def _copy(step_dir, tmp_path):
  import shutil
  root = tmp_path / 'copy' / 'checkpoints'
  root.mkdir(parents=True)
  return Path(shutil.copytree(step_dir, root / step_dir.name))


@pytest.mark.parametrize('part_bytes', [64 << 20, 256 << 10], ids=['one-object', 'in-parts'])
def test_a_rotted_local_copy_is_never_uploaded(s3_server, local_checkpoint, tmp_path, part_bytes):
  from conftest import flip_a_data_byte, state_file
  store = Store(s3_server.bucket())
  good = local_checkpoint / layout.step_dirname(2)
  objects.upload(store, good, {}, part_bytes=part_bytes)  # the remote copy is intact
  rotted = _copy(good, tmp_path)
  flip_a_data_byte(rotted)  # same size, one bit different: only its CRC-32 tells
  with pytest.raises(
      CheckpointError, match=f'E-STORE-013: {state_file(rotted)}: checksum mismatch'):
    objects.upload(store, rotted, {}, part_bytes=part_bytes)
  assert objects.latest_intact(store) == (2, [])  # the intact remote copy stays the commit
  assert objects.holds(store, good)
  got, _ = objects.download(store, 2, tmp_path / 'fresh')
  assert state_file(got).read_bytes() == state_file(good).read_bytes()

  events = []  # the uploader: an event naming the file, and no retry (it cannot get better)
  uploader = Uploader(
      Store(s3_server.bucket()), on_event=lambda name, **f: events.append((name, f)))
  try:
    uploader.submit(2, rotted)
    assert not uploader.wait(2, timeout=30)
  finally:
    uploader.close()
  assert [name for name, _ in events] == ['upload_started', 'upload_failed']
  assert events[1][1]['error'][:11] == 'E-STORE-013'
  assert not objects.committed(uploader.store)


def _exports(tmp_path, sizes):
  rng = np.random.default_rng(0)
  local = tmp_path / 'exports'
  for rel, size in sizes.items():
    (local / rel).parent.mkdir(parents=True, exist_ok=True)
    (local / rel).write_bytes(rng.bytes(size))
  return local


def test_a_large_export_goes_up_in_parts_and_comes_back_whole(store, local_checkpoint, tmp_path):
  local = _exports(tmp_path, {'step_00000002/model.safetensors': 700_000, 'small.txt': 1000})
  uploader = Uploader(store, part_bytes=256 << 10, mirror=(local, 'exports/'))
  try:
    uploader.submit(2, local_checkpoint / layout.step_dirname(2))
    assert uploader.wait(2, timeout=60)
  finally:
    uploader.close()
  keys = store.list('exports/')
  big = 'exports/step_00000002/model.safetensors'
  assert big not in keys and f'{big}.part-00002' in keys  # never one object over the part size
  assert 'exports/small.txt' in keys
  from jaxckpt.checkpoint.remote.mirror import download_file
  for rel in ('step_00000002/model.safetensors', 'small.txt'):
    assert download_file(store, 'exports/' + rel, tmp_path / 'got')
    assert (tmp_path / 'got').read_bytes() == (local / rel).read_bytes()
  part = bytearray(store.read(f'{big}.part-00001'))
  part[7] ^= 1
  store.write(f'{big}.part-00001', bytes(part))
  with pytest.raises(CheckpointError, match='E-STORE-012.*checksum mismatch'):
    download_file(store, big, tmp_path / 'got')


def test_the_mirror_deletes_only_what_this_run_dropped(s3_server, local_checkpoint, tmp_path):
  """A fresh machine (an empty exports/) keeps the exports of the machine before it; its own
  export retention's deletions are mirrored."""
  store = Store(s3_server.bucket())
  earlier = {'exports/step_00000001/model.safetensors': b'from the machine before'}
  store.write_many(earlier)
  local = _exports(tmp_path, {'step_00000002/model.safetensors': 1000})
  uploader = Uploader(store, mirror=(local, 'exports/'))
  try:
    uploader.submit(1, local_checkpoint / layout.step_dirname(1))
    assert uploader.wait(1, timeout=60)
    assert 'exports/step_00000002/model.safetensors' in store.list('exports/')
    (local / 'step_00000002' / 'model.safetensors').unlink()  # this run's retention dropped it
    uploader.submit(2, local_checkpoint / layout.step_dirname(2))
    assert uploader.wait(2, timeout=60)
  finally:
    uploader.close()
  assert store.list('exports/') == list(earlier)
  assert store.read(next(iter(earlier))) == next(iter(earlier.values()))
