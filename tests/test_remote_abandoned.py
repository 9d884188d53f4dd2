"""The checkpoints a run abandoned, as the remote knows them (`URL/run/abandoned.json`): a fresh
machine, a tool reading the run's URL and remote retention all take the history the run is on,
and an abandoned checkpoint only when nothing else is intact. Against a path store (a mounted
disk) and moto's S3 server."""

import jax.numpy as jnp
import pytest
from conftest import wait_for

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, RetentionPolicy, abandoned, layout
from jaxckpt.checkpoint.remote import Store, Uploader, objects
from jaxckpt.checkpoint.remote import abandoned as remote_abandoned
from jaxckpt.cli import remote_args


def _checkpoints(root, value, *steps):
  with CheckpointManager(root, CheckpointOptions(keep=0, mode='sync')) as mgr:
    for step in steps:
      mgr.save(step, {'w': jnp.full((64,), value + step, jnp.float32)}, {'step': step})
  return root


@pytest.fixture(scope='module')
def histories(tmp_path_factory):
  """(the first history's steps 10-40, the replay's 25-35 after it went back to step 20)."""
  tmp = tmp_path_factory.mktemp('histories')
  return _checkpoints(tmp / 'old', 0, 10, 20, 30, 40), _checkpoints(tmp / 'new', 1000, 25, 30, 35)


@pytest.fixture(params=['path', 's3'])
def store(request, tmp_path):
  if request.param == 's3':
    return Store(request.getfixturevalue('s3_server').bucket())
  return Store(f'file://{tmp_path}/run')


def _up(store, root, *steps):
  for step in steps:
    objects.upload(store, root / layout.step_dirname(step), {})


def test_a_fresh_machine_and_the_tools_take_the_history_the_run_is_on(store, histories, tmp_path):
  old, new = histories
  _up(store, old, 10, 20, 30, 40)
  # The run went back to step 20 (its workdir's record names 30 and 40) and stopped at 25.
  gone = remote_abandoned.send(store, 20, {})
  assert sorted(gone) == [30, 40] and remote_abandoned.recorded(store) == gone
  _up(store, new, 25)
  committed = objects.committed(store)
  assert remote_abandoned.newest_first(store, committed) == ([25, 20, 10, 40, 30], {30, 40})
  assert objects.latest_intact(store, last={30, 40}) == (25, [])
  assert remote_args.newest(store) == 25  # `jaxckpt export URL` and the like
  with remote_args.local_checkpoint(store.url) as path:
    assert path.name == 'step_00000025'
  with remote_args.local_run(store.url) as run:  # `jaxckpt inspect URL`: its newest is 25
    assert abandoned.steps(run / 'checkpoints') == {30, 40}
  # The replay uploads step 30 again: another seal, this history's now; 40 still abandoned.
  _up(store, new, 30)
  assert remote_args.newest(store) == 30
  assert remote_abandoned.held(store, objects.committed(store)) == {40}
  # Nothing of the history the run is on intact: what it abandoned is better than nothing.
  for step in (10, 20, 25, 30):
    objects.delete(store, step, lambda what: None)
  assert remote_args.newest(store) == 40


def test_a_later_start_keeps_what_the_replay_skipped_and_writes_only_a_change(store, histories):
  old, new = histories
  _up(store, old, 10, 20, 30, 40)
  first = remote_abandoned.send(store, 20, {})
  _up(store, new, 25, 35)  # the replay's cadence skipped 30
  # The next start continues from 35: 40 is above it, and 30 is still the old history's.
  assert remote_abandoned.send(store, 35, {}) == first
  assert remote_abandoned.held(store, objects.committed(store)) == {30, 40}
  # A workdir's record names a seal the remote does not hold: nothing of it is taken.
  assert remote_abandoned.send(store, 35, {10: '00000000'}) == first
  written = []
  remote_abandoned.send(store, 35, {}, may_write=written.append)
  assert written == []  # unchanged: not written again (the lease is asked only for a write)


@pytest.mark.parametrize('record', [b'{', b'[]', b'{"abandoned": {"x": "1"}}', b'[' * 100_000])
def test_a_remote_record_that_is_not_one_is_ignored(histories, tmp_path, record):
  store = Store(str(tmp_path / 'run'))
  _up(store, histories[0], 10, 20)
  store.write(remote_abandoned.KEY, record)
  assert remote_abandoned.recorded(store) == {}
  assert remote_args.newest(store) == 20


def test_remote_retention_counts_not_what_the_run_abandoned_and_deletes_what_it_passed(
    s3_server, histories):
  old, new = histories
  store = Store(s3_server.bucket())
  _up(store, old, 10, 20, 30, 40)
  uploader = Uploader(store, retention=RetentionPolicy(keep=2))
  try:
    uploader.abandoned = remote_abandoned.send(store, 20, {})  # what process 0's start does
    for step in (25, 35):  # the replay uploads 25 and 35; its cadence skips 30
      uploader.submit(step, new / layout.step_dirname(step))
      assert uploader.wait(step, timeout=60)
  finally:
    uploader.close()
  # keep=2 counts this history's 25 and 35, not the old 30 between them, which the replay
  # passed without uploading it again: it goes; the old 40, above the newest, stays.
  wait_for(lambda: sorted(objects.committed(store)) == [25, 35, 40], timeout=10)


def test_a_start_with_nothing_above_it_reads_the_record_and_writes_nothing(histories, tmp_path):
  from types import SimpleNamespace

  from jaxckpt.hosts import remote_start
  old, new = histories
  store = Store(f'file://{tmp_path}/run')
  _up(store, old, 10, 20, 30, 40)
  gone = remote_abandoned.send(store, 20, {})
  _up(store, new, 25)
  record = tmp_path / 'run' / remote_abandoned.KEY
  before = record.stat().st_mtime_ns
  # A fresh machine resumed from 25, the remote's newest of the history the run is on: no
  # record of its own, nothing to add; retention still needs what the remote's record names.
  fresh = SimpleNamespace(store=store, start_step=25, lease=None)
  assert remote_start.send_abandoned(fresh, 25, tmp_path / 'empty') == gone
  assert record.stat().st_mtime_ns == before
  # An explicit older resume point below the remote's newest: the steps above it are recorded.
  back = SimpleNamespace(store=store, start_step=25, lease=None)
  assert sorted(remote_start.send_abandoned(back, 10, tmp_path / 'empty')) == [20, 25, 30, 40]


def test_a_local_abandoned_fallback_does_not_hide_the_remote_s_intact_history(
    histories, tmp_path, monkeypatch):
  """The workdir holds only what the run abandoned intact (its own history's step damaged): the
  remote's intact copy of that history's step is fetched, not passed over for the local one."""
  import shutil
  from types import SimpleNamespace

  from jaxckpt.checkpoint import discovery
  from jaxckpt.hosts import remote_start
  old, new = histories
  store = Store(f'file://{tmp_path}/run')
  _up(store, old, 10, 20, 30)
  remote_abandoned.send(store, 20, {})  # the run went back to 20: 30 abandoned
  _up(store, new, 25)
  work = tmp_path / 'work' / 'checkpoints'
  for step in (20, 30):
    shutil.copytree(old / layout.step_dirname(step), work / layout.step_dirname(step))
  abandoned.record(work, 20)  # continue_from(20); the replay then saved 25
  shutil.copytree(new / layout.step_dirname(25), work / layout.step_dirname(25))
  for step in (20, 25):  # this history's local checkpoints, damaged
    (work / layout.step_dirname(step) / 'manifest.json').write_text('{')
  assert discovery.latest_intact(work, checksums=False)[0].name == 'step_00000030'
  fetched = []
  monkeypatch.setattr(remote_start, 'fetch_step', lambda run, step, *a, **k: fetched.append(step))
  run = SimpleNamespace(store=store, start_step=None, fetched=None)
  remote_start.sync_down(run, work, resume='latest', fetch=True)
  assert run.start_step == 25 and fetched == [25]


def test_a_start_from_an_abandoned_checkpoint_makes_it_the_history_again(histories, tmp_path):
  from types import SimpleNamespace

  from jaxckpt.hosts import remote_start
  old, _ = histories
  store = Store(f'file://{tmp_path}/run')
  _up(store, old, 20, 30)
  remote_abandoned.send(store, 20, {})
  objects.delete(store, 20, lambda what: None)  # nothing else intact: 30 is taken after all
  fresh = SimpleNamespace(store=store, start_step=30, lease=None)
  assert remote_start.send_abandoned(fresh, 30, tmp_path / 'empty') == {}
  assert remote_abandoned.recorded(store) == {}  # its base is no abandoned checkpoint now


def test_a_local_entry_neither_here_nor_remote_is_forgotten(histories, tmp_path):
  """Else every later start would list the bucket for a step nothing holds any more."""
  import shutil
  from types import SimpleNamespace

  from jaxckpt.hosts import remote_start
  old, _ = histories
  store = Store(f'file://{tmp_path}/run')
  _up(store, old, 10, 20)  # 30 never went up
  work = tmp_path / 'work' / 'checkpoints'
  for step in (10, 20, 30):
    shutil.copytree(old / layout.step_dirname(step), work / layout.step_dirname(step))
  abandoned.record(work, 10)  # 20 and 30 abandoned
  shutil.rmtree(work / layout.step_dirname(30))  # `jaxckpt delete`
  run = SimpleNamespace(store=store, start_step=20, lease=None)
  assert sorted(remote_start.send_abandoned(run, 10, work)) == [20]
  assert sorted(abandoned.recorded(work)) == [20]  # 30: neither here nor in the remote


def test_a_step_saved_again_here_but_not_uploaded_stays_abandoned_remotely(histories, tmp_path):
  """The replay saved step 30 again in the workdir (its record dropped 30: replaced here), and
  the upload did not get up before the stop. The next start continues from that local 30: the
  remote's 30 is still the old history's until the new one replaces it there."""
  import shutil
  from types import SimpleNamespace

  from jaxckpt.hosts import remote_start
  old, new = histories
  store = Store(f'file://{tmp_path}/run')
  _up(store, old, 10, 20, 30)
  assert sorted(remote_abandoned.send(store, 20, {})) == [30]  # the run went back to 20
  work = tmp_path / 'work' / 'checkpoints'
  for step in (25, 30):  # the replay's, here only
    shutil.copytree(new / layout.step_dirname(step), work / layout.step_dirname(step))
  run = SimpleNamespace(store=store, start_step=20, lease=None)
  assert sorted(remote_start.send_abandoned(run, 30, work)) == [30]
  # A fresh machine (this disk lost before the upload) takes 20, not the old history's 30.
  assert remote_args.newest(store) == 20
  _up(store, new, 30)  # the upload the start queued gets up: the remote's 30 is this history's
  assert remote_args.newest(store) == 30
  run = SimpleNamespace(store=store, start_step=30, lease=None)
  assert remote_start.send_abandoned(run, 30, work) == {}
  assert remote_abandoned.recorded(store) == {}
