"""What a checkpoint's own manifest keeps stays kept; retention never deletes what it just committed.

End to end through `python -m jaxckpt.main` and `jaxckpt delete`, and the uploader's remote
retention on a path store.
"""

import json

import jax.numpy as jnp
from conftest import committed_steps, events_of, flip_a_data_byte, jaxckpt_cli, read_events

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, RetentionPolicy, layout
from jaxckpt.checkpoint.remote import Store, Uploader, objects
from jaxckpt.records.workdir import WorkdirLock


def _ckpt(workdir, step):
  return workdir / 'checkpoints' / layout.step_dirname(step)


def test_kept_checkpoints_outlive_a_run_that_drops_keep_every(trainer, tmp_path):
  first = trainer.train(tmp_path, '--config.train.steps=20', '--checkpoint_every=5', '--keep=1',
                        '--keep_every=10')
  assert first.returncode == 0, first.stderr
  assert committed_steps(tmp_path) == [10, 20]
  manifest = json.loads((_ckpt(tmp_path, 10) / 'manifest.json').read_text())
  assert manifest['retention'] == {'kept': ['keep_every'], 'keep_every': 10}
  # Continued without repeating --keep_every (as a pivot's new phase may be).
  second = trainer.train(tmp_path, '--config.train.steps=40', '--checkpoint_every=5', '--keep=1')
  assert second.returncode == 0, second.stderr
  assert committed_steps(tmp_path) == [10, 20, 40]
  assert [e['changes'] for e in events_of(tmp_path, 'retention_changed')
         ] == [['keep_every 10 -> 0']]
  lines = [line for line in second.stderr.splitlines() if 'keep_every' in line]
  assert len(
      lines) == 1 and 'retention changed since the checkpoint: keep_every 10 -> 0' in lines[0]

  # Deleting a kept checkpoint is an explicit command, never a side effect.
  refused = jaxckpt_cli('delete', str(_ckpt(tmp_path, 10)))
  assert refused.returncode == 2, refused.stderr
  assert refused.stderr.startswith('jaxckpt: E-DELETE-001: ') and 'kept: keep_every' in \
      refused.stderr and len(refused.stderr.splitlines()) == 1, refused.stderr
  assert committed_steps(tmp_path) == [10, 20, 40]
  newest = jaxckpt_cli('delete', str(_ckpt(tmp_path, 40)))
  assert newest.returncode == 2 and 'E-DELETE-002' in newest.stderr, newest.stderr
  with WorkdirLock(tmp_path):  # a trainer running here: nothing is deleted under it
    busy = jaxckpt_cli('delete', str(_ckpt(tmp_path, 10)), '--kept')
  assert busy.returncode == 2 and 'E-LOCK-001' in busy.stderr, busy.stderr
  done = jaxckpt_cli('delete', str(_ckpt(tmp_path, 10)), '--kept')
  assert done.returncode == 0, done.stderr
  assert committed_steps(tmp_path) == [20, 40]
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == [
      layout.step_dirname(20), layout.step_dirname(40)
  ]  # nothing half-deleted left
  assert [e['step'] for e in events_of(tmp_path, 'checkpoint_deleted')] == [10]


def test_a_replay_keeps_what_it_commits_below_a_damaged_newer_step(trainer, tmp_path):
  """{10, 20, 25 (damaged)} with --keep=1 --keep_every=10: `latest` passes over 25 and the run
  continues from 20; each replayed commit is the newest of this history and survives it."""
  flags = ('--keep=1', '--keep_every=10')
  first = trainer.train(tmp_path, '--config.train.steps=25', '--checkpoint_every=5', *flags)
  assert first.returncode == 0, first.stderr
  assert committed_steps(tmp_path) == [10, 20, 25]
  flip_a_data_byte(_ckpt(tmp_path, 25))
  again = trainer.train(tmp_path, '--config.train.steps=24', '--checkpoint_every=2', *flags)
  assert again.returncode == 0, again.stderr
  assert [e['step'] for e in events_of(tmp_path, 'resumed')] == [20]
  events = read_events(tmp_path)
  resumed_at = max(i for i, e in enumerate(events) if e['event'] == 'resumed')
  commits = [(e['step'], e['deleted']) for e in events[resumed_at:] if e['event'] == 'checkpoint']
  assert commits == [(22, []), (24, [22])]  # never the step just committed
  assert committed_steps(tmp_path) == [10, 20, 24, 25]  # 25: the abandoned history, untouched


def test_remote_retention_keeps_what_the_manifests_keep(tmp_path):
  root = tmp_path / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(keep=0, keep_every=2, mode='sync')) as mgr:
    for step in (1, 2, 3, 4):
      mgr.save(step, {'w': jnp.full((8,), step, jnp.float32)}, {'step': step})
  store = Store(str(tmp_path / 'remote'))
  # The uploader runs with the flags of a later invocation: no --keep_every.
  uploader = Uploader(store, retention=RetentionPolicy(keep=1))
  try:
    for step in (1, 2, 3, 4):
      uploader.submit(step, root / layout.step_dirname(step))
      assert uploader.wait(step, timeout=30)
  finally:
    uploader.close()
  assert sorted(objects.committed(store)) == [2, 4]


def test_a_replay_under_other_flags_keeps_what_the_replaced_checkpoint_kept(tmp_path):
  state = {'w': jnp.arange(8.0)}
  with CheckpointManager(tmp_path, CheckpointOptions(keep=1, keep_every=10)) as mgr:
    mgr.save(10, state)
  # A replay of step 10 without --keep_every, then newer steps with keep=1: 10 stays kept.
  with CheckpointManager(tmp_path, CheckpointOptions(keep=1)) as mgr:
    mgr.save(10, state)
    mgr.wait_until_finished()
    assert mgr.read_manifest(10)['retention']['kept'] == ['keep_every']
    mgr.save(20, state)
    mgr.save(30, state)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [10, 30]
