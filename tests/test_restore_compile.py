"""A restart reads its checkpoint while the first step compiles (`restore(..., meanwhile=...)`),
and a fresh machine downloads it meanwhile (`remote_start.fetch_step`).

The state file is read on a thread of its own, each window placed on the devices as it lands,
while `meanwhile` runs on the caller's (the trainer compiles its train step there): a restart
waits for the longer of the two, not their sum, and holds a window of host memory, not the state. Here: the read finishes while
`meanwhile` is still running, the arrays are the saved bytes, a damaged file and a stuck read
are each named, and the compiled train step is the one the first step runs.
"""

import logging
import subprocess
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest
from conftest import REPO, TINY, flip_a_data_byte, subprocess_env
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt.checkpoint import CheckpointError, CheckpointManager, CheckpointOptions, reading


def _mesh_shape() -> tuple[int, int]:
  """Data x model over the 8 CPU devices the tests see; one accelerator alone as (1, 1)."""
  count = len(jax.devices())
  return (count // 2, 2) if count % 2 == 0 else (count, 1)


def _state():
  mesh = Mesh(np.array(jax.devices()).reshape(_mesh_shape()), ('data', 'model'))
  rng = np.random.default_rng(0)
  return {
      'w':
          jax.device_put(
              rng.standard_normal((64, 32), np.float32), NamedSharding(mesh, P('data', 'model'))),
      'b':
          jax.device_put(rng.standard_normal((32,)).astype(np.float16), NamedSharding(mesh, P())),
      'step':
          jax.device_put(np.int32(7), NamedSharding(mesh, P())),
  }


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.fixture
def saved(tmp_path):
  state = _state()
  with CheckpointManager(tmp_path / 'ckpt', CheckpointOptions(mode='sync')) as mgr:
    mgr.save(1, state)
  return tmp_path / 'ckpt', state


@pytest.fixture
def read_done(monkeypatch):
  """Set when the restore's read of the state file returns (the real read, watched)."""
  done = threading.Event()
  real = reading.read_state_file

  def watched(*args, **kwargs):
    try:
      return real(*args, **kwargs)
    finally:
      done.set()

  monkeypatch.setattr(reading, 'read_state_file', watched)
  return done


def test_the_file_is_read_while_meanwhile_runs_and_restores_the_saved_bytes(saved, read_done):
  directory, state = saved
  ran = []

  def meanwhile():
    ran.append(threading.get_ident())
    # A read that waited for this to return would never finish in here.
    assert read_done.wait(30), 'the state file was not read while meanwhile ran'

  with CheckpointManager(directory) as mgr:
    restored, run_state = mgr.restore(1, _abstract(state), meanwhile=meanwhile)
  assert ran == [threading.get_ident()]  # once, on the caller's thread
  assert run_state['step'] == 1
  for name, x in state.items():
    assert restored[name].sharding == x.sharding
    assert np.asarray(restored[name]).tobytes() == np.asarray(x).tobytes()


def test_a_damaged_state_file_is_named_after_meanwhile(saved):
  directory, state = saved
  flip_a_data_byte(directory / 'step_00000001')
  ran = []
  with CheckpointManager(directory) as mgr, pytest.raises(CheckpointError) as e:
    mgr.restore(1, _abstract(state), meanwhile=lambda: ran.append(1))
  assert e.value.code == 'E-CKPT-003' and ran == [1]


def test_an_error_of_meanwhile_is_raised_as_it_is(saved):
  directory, state = saved

  def meanwhile():
    raise ValueError('the compile failed')

  with CheckpointManager(directory) as mgr, pytest.raises(ValueError, match='compile failed'):
    mgr.restore(1, _abstract(state), meanwhile=meanwhile)


def test_a_read_that_does_not_finish_is_named_with_its_thread(saved, monkeypatch):
  directory, state = saved
  release = threading.Event()
  real = reading.read_state_file

  def stuck(*args, **kwargs):  # a hung mount: the read returns when the test lets it
    release.wait(60)
    return real(*args, **kwargs)

  monkeypatch.setattr(reading, 'read_state_file', stuck)
  monkeypatch.setattr(reading, 'READ_WAIT_SECS', 0.5)
  monkeypatch.setattr(reading, 'READ_WAIT_BYTES_PER_SEC', 1e18)
  try:
    with CheckpointManager(directory) as mgr, pytest.raises(CheckpointError) as e:
      mgr.restore(1, _abstract(state), meanwhile=lambda: None)
  finally:
    release.set()
  assert e.value.code == 'E-CKPT-017'
  assert 'jaxckpt-restore' in str(e.value) and 'state' in str(e.value)


def test_orbax_storage_runs_meanwhile_before_its_read(tmp_path, monkeypatch):
  state = _state()
  order = []
  real = reading.orbaxstore.restore

  def watched(*args, **kwargs):
    order.append('read')
    return real(*args, **kwargs)

  monkeypatch.setattr(reading.orbaxstore, 'restore', watched)
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync', storage='orbax')) as mgr:
    mgr.save(1, state)
    restored, _ = mgr.restore(1, _abstract(state), meanwhile=lambda: order.append('meanwhile'))
  assert order == ['meanwhile', 'read']
  assert np.asarray(restored['w']).tobytes() == np.asarray(state['w']).tobytes()


def test_the_first_step_after_compile_train_step_compiles_nothing(caplog):
  from jaxckpt.model import data as data_lib
  from jaxckpt.records import provenance
  from jaxckpt.train.state import build_trainer
  config = provenance.load_config_file(TINY)
  with config.unlocked():  # the data and the model split over the 8 devices
    config.mesh.data, config.mesh.model = _mesh_shape()
  trainer = build_trainer(config)
  state = trainer.init_fn(jax.random.key(0))
  batch = trainer.put_batch(data_lib.from_config(config).batch(0))
  trainer.compile_train_step()
  assert trainer.step_compiled
  jax.config.update('jax_log_compiles', True)
  try:
    with caplog.at_level(logging.DEBUG):
      jax.block_until_ready(trainer.train_step(state, batch))
  finally:
    jax.config.update('jax_log_compiles', False)
  assert not [r.getMessage()[:80] for r in caplog.records if 'jit(train_step)' in r.getMessage()]


def _progress():
  """What a download reports its bytes to (`objects.download`'s `progress`)."""
  from jaxckpt.hosts.remote_start import _Progress
  return _Progress(5)


def test_a_download_beside_the_compile_returns_its_result_or_its_error():
  from jaxckpt.checkpoint.remote import StoreError
  from jaxckpt.hosts.remote_start import _beside
  progress = _progress()
  started, compiled = threading.Event(), threading.Event()

  def download():  # each waits for the other: one after the other, neither would finish
    started.set()
    assert compiled.wait(30), 'meanwhile did not run while the download did'
    progress(2, 2)
    return 'path'

  def meanwhile():
    assert started.wait(30), 'the download did not run while meanwhile did'
    compiled.set()

  assert _beside(download, meanwhile, progress, 'step 5') == 'path'

  def failing():
    raise StoreError('E-STORE-008', 'the store failed')

  with pytest.raises(StoreError, match='the store failed'):
    _beside(failing, lambda: None, progress, 'step 5')


def test_a_failed_compile_waits_for_the_download_then_is_raised():
  from jaxckpt.hosts.remote_start import _beside
  progress = _progress()
  finished = threading.Event()

  def download():
    time.sleep(0.3)
    finished.set()

  def meanwhile():
    raise ValueError('the compile failed')

  with pytest.raises(ValueError, match='compile failed'):
    _beside(download, meanwhile, progress, 'step 5')
  assert finished.is_set()  # no download left running behind the error


def test_a_download_that_moves_no_byte_is_named(monkeypatch):
  from jaxckpt.checkpoint.remote import StoreError
  from jaxckpt.hosts import remote_start
  monkeypatch.setattr(remote_start, 'STALL_SECS', 0.5)
  progress = _progress()
  release = threading.Event()
  progress.plan(8_000_000, 1)  # parts of a byte: no time added for the first to land
  progress(3_000_000, 8_000_000)
  try:
    with pytest.raises(StoreError) as e:
      remote_start._beside(lambda: release.wait(30), lambda: None, progress,
                           'step 5 from s3://bucket/run')
  finally:
    release.set()
  assert e.value.code == 'E-STORE-016'
  assert 'step 5 from s3://bucket/run' in str(e.value) and 'jaxckpt-fetch' in str(e.value)
  assert '3.0 of 8.0 MB' in str(e.value)


def test_when_both_fail_the_compile_is_raised_and_the_download_logged(caplog):
  from jaxckpt.checkpoint.remote import StoreError
  from jaxckpt.hosts.remote_start import _beside

  def download():
    raise StoreError('E-STORE-008', 'the store failed')

  def meanwhile():
    raise ValueError('the compile failed')

  with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match='compile failed'):
    _beside(download, meanwhile, _progress(), 'step 5')
  assert any('jaxckpt-fetch failed too' in r.getMessage() and 'the store failed' in r.getMessage()
             for r in caplog.records)


def test_a_file_of_several_chunks_is_placed_as_it_lands(tmp_path, read_done):
  """Past the reader's 64 MiB chunks, batches land one after another while the caller places
  them: every tensor arrives whole, once, whichever side of `meanwhile` it landed on."""
  rng = np.random.default_rng(1)
  state = {f't{i}': jax.device_put(rng.standard_normal(10_000_000, np.float32)) for i in range(4)}
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(1, state)
    restored, _ = mgr.restore(1, _abstract(state), meanwhile=lambda: None)
  assert read_done.is_set() and sorted(restored) == sorted(state)
  for name, x in state.items():
    assert np.asarray(restored[name]).tobytes() == np.asarray(x).tobytes(), name


HUNG_READ = textwrap.dedent("""
    import runpy, sys, threading
    from jaxckpt.checkpoint import reading, statefile
    from jaxckpt.cli import parser
    reading.READ_WAIT_SECS, reading.READ_WAIT_BYTES_PER_SEC = 1, 1e18
    parser.EXIT_WAIT_SECS = 3
    real, never = statefile.pread_into, threading.Event()

    def hung(*args):  # the reader pool's reads never return, as on a hung mount
      if threading.current_thread().name.startswith('jaxckpt-read'):
        never.wait()
      return real(*args)

    statefile.pread_into = hung
    sys.argv = ['jaxckpt.main', *sys.argv[1:]]
    runpy.run_module('jaxckpt.main', run_name='__main__', alter_sys=True)
""")


def test_a_restart_whose_read_never_returns_exits_instead_of_hanging(trainer, tmp_path):
  """A restart's read stuck in the kernel (a hung mount) is E-CKPT-017; the process then exits
  with its status once EXIT_WAIT_SECS have passed, naming the threads it leaves, where Python's
  exit would join the reader pool's threads forever."""
  done = trainer.train(tmp_path, '--config.train.steps=4', '--checkpoint_every=2')
  assert done.returncode == 0, done.stderr[-3000:]
  flags = trainer.command(tmp_path, '--config.train.steps=8', '--checkpoint_every=2')[3:]
  done = subprocess.run([sys.executable, '-c', HUNG_READ, *flags],
                        cwd=REPO,
                        env=subprocess_env(trainer.cache),
                        capture_output=True,
                        text=True,
                        timeout=180)
  assert done.returncode == 1, done.stderr[-3000:]
  assert 'jaxckpt: E-CKPT-017: reading ' in done.stderr
  assert 'exiting without waiting any longer for thread(s) jaxckpt-read' in done.stderr


def test_the_stuck_bound_across_files_covers_every_byte_the_read_reads(tmp_path, monkeypatch):
  """Beside `meanwhile`, a restore from several files is E-CKPT-017 after 120 s + a second per
  20 MB of `boxrestore.read_bound`: that must cover what the read reads, not what it keeps. A box
  that cuts a shard's columns reads most of its rows: here 4 column strips of a 1 MiB shard."""
  from jaxckpt.checkpoint import boxread, boxrestore, manifest, shardtable
  from jaxckpt.checkpoint.formats import data_file
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ('data', 'model'))
  x = jax.device_put(np.arange(512 * 512, dtype=np.float32).reshape(512, 512))
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(1, {'w': x})
  step_dir = tmp_path / 'step_00000001'
  meta = manifest.read(step_dir)
  shards = shardtable.shard_table(step_dir, meta, data_file(meta))
  want = {
      'w': jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P(None, 'model')))
  }
  read, real = [], boxread.pread_into
  monkeypatch.setattr(boxread, 'pread_into',
                      lambda fd, view, at: read.append(len(view)) or real(fd, view, at))
  monkeypatch.setattr(boxread, 'WINDOW', 64 << 10)  # windows of rows, as for a large shard
  held = boxrestore.held_boxes(want)
  boxes = boxrestore.read_boxes(step_dir, shards, held, checksums=True)
  kept = sum(b.nbytes for b in boxes['w'].values())
  assert kept == x.nbytes  # the 4 strips: the whole array once
  assert kept < sum(read) <= boxrestore.read_bound(shards, held) == 4 * x.nbytes
  restored = boxrestore.place(want, boxes)['w']
  assert np.asarray(restored).tobytes() == np.asarray(x).tobytes()


def test_across_files_a_restore_reads_and_places_a_window_of_arrays_at_a_time(
    tmp_path, monkeypatch):
  """Without `meanwhile`, a restore by boxes reads a window of arrays (at most `PLACE_WINDOW`
  bytes of boxes; a larger array alone) and places it before it reads the next: onto an
  accelerator the host then holds a window, not the state."""
  from jaxckpt.checkpoint import boxrestore, manifest, shardtable
  from jaxckpt.checkpoint.formats import data_file
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ('data', 'model'))
  state = {f'w{i}': jax.device_put(np.full((64, 32), i, np.float32)) for i in range(6)}  # 8 KiB
  state['big'] = jax.device_put(np.arange(128 * 128, dtype=np.float32).reshape(128, 128))
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(1, state)
  step_dir = tmp_path / 'step_00000001'
  meta = manifest.read(step_dir)
  shards = shardtable.shard_table(step_dir, meta, data_file(meta))
  want = {
      n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P('data', 'model')))
      for n, x in state.items()
  }
  monkeypatch.setattr(boxrestore, 'PLACE_WINDOW', 20 << 10)
  events, real_read, real_place = [], boxrestore.read_boxes, boxrestore.place
  monkeypatch.setattr(
      boxrestore, 'read_boxes', lambda _d, _s, held, **kw: (events.append(
          ('read', sorted(held))), real_read(_d, _s, held, **kw))[1])
  monkeypatch.setattr(
      boxrestore, 'place', lambda w, boxes: (events.append(
          ('place', sorted(w))), real_place(w, boxes))[1])
  got = boxrestore.restore(step_dir, shards, want, checksums=True)
  assert all(np.asarray(got[n]).tobytes() == np.asarray(x).tobytes() for n, x in state.items())
  reads = [names for kind, names in events if kind == 'read']
  assert len(reads) >= 4 and ['big'] in reads  # 64 KiB: a window of its own
  assert all(sum(state[n].nbytes for n in names) <= 20 << 10 for names in reads if names != ['big'])
  assert [kind for kind, _ in events
         ] == ['read', 'place'] * len(reads)  # each placed, then the next


@pytest.mark.parametrize('across', [False, True], ids=['one-file', 'across-files'])
def test_beside_meanwhile_each_window_is_placed_as_it_is_read(tmp_path, monkeypatch, across):
  """Beside `meanwhile` (the trainer's compile) the reader places each window on the devices as
  it reads it, on its own thread: while a long compile runs, the host holds a window or two of
  the state, not all of it. One state file (windows of tensors) and a restore by boxes (windows
  of arrays) alike."""
  from jaxckpt.checkpoint import boxrestore, manifest, shardtable, statefile
  from jaxckpt.checkpoint.formats import data_file
  state = {f'w{i}': jax.device_put(np.full((64, 32), i, np.float32)) for i in range(6)}  # 8 KiB
  with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(1, state)
  step_dir = tmp_path / 'step_00000001'
  meta = manifest.read(step_dir)
  shards = shardtable.shard_table(step_dir, meta, data_file(meta)) if across else None
  monkeypatch.setattr(statefile, '_WINDOW', 20 << 10)
  monkeypatch.setattr(boxrestore, 'PLACE_WINDOW', 20 << 10)
  placed, running = [], threading.Event()
  module, name = (boxrestore, 'place') if across else (jax, 'device_put')  # a window's placement
  real_put = getattr(module, name)

  def put(*args, **kwargs):  # the real placement, watched: on which thread, and when
    # A read beside meanwhile waits here for it to begin (the reader may reach its first window
    # before the caller calls it); a read done before meanwhile would wait out the 60 s, then
    # be seen placing outside it.
    running.wait(60)
    placed.append((threading.current_thread().name, running.is_set()))
    return real_put(*args, **kwargs)

  monkeypatch.setattr(module, name, put)

  def meanwhile():
    running.set()
    reader = [t for t in threading.enumerate() if t.name == reading.READER]
    for t in reader:  # the whole read, placements included, ends before this returns
      t.join(60)
    assert reader and not reader[0].is_alive(), 'the read did not finish beside meanwhile'
    running.clear()

  want = reading.targets(_abstract(state))
  got = reading.read_arrays(
      step_dir,
      meta,
      want,
      checksums=True,
      verify=True,
      partial=False,
      shards=shards,
      meanwhile=meanwhile)
  assert all(np.asarray(got[n]).tobytes() == np.asarray(x).tobytes() for n, x in state.items())
  windows = [p for p in placed if p[0] == reading.READER]
  assert len(windows) >= 3 and windows == placed  # several, none left for the caller
  assert all(during for _, during in placed)  # each while meanwhile still ran


def test_beside_meanwhile_a_callers_enable_x64_holds_on_the_reader(tmp_path):
  """`jax.enable_x64` holds on the thread that entered it: the reader, which places what it
  reads, takes the caller's, so a 64-bit counter comes back 64-bit and whole."""
  with jax.enable_x64(True):
    state = {'count': jax.device_put(np.int64(2**40)), 'w': jax.device_put(np.arange(4.0))}
    with CheckpointManager(tmp_path, CheckpointOptions(mode='sync')) as mgr:
      mgr.save(1, state)
      restored, _ = mgr.restore(1, _abstract(state), meanwhile=lambda: None)
    assert restored['count'].dtype == np.int64 and int(restored['count']) == 2**40
    assert restored['w'].dtype == np.float64
