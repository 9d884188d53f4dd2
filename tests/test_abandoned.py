"""A run that went back to an older checkpoint stays on its history: the checkpoints it left above
that one are never the newest (a stop or crash before the replay reaches them resumes where this
history is), retention neither counts nor deletes them, and the replay replaces them."""

import json
import shutil

import jax.numpy as jnp
import pytest
from conftest import committed_steps, events_of, jaxckpt_cli, remote_steps

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, abandoned, discovery, layout
from jaxckpt.checkpoint.remote import Store

FLAGS = ('--checkpoint_every=10', '--keep=0')


def _save(mgr, *steps):
  for step in steps:
    mgr.save(step, {'w': jnp.full((8,), step, jnp.float32)}, {'step': step})
  mgr.wait_until_finished()


def _newest(root):
  path, skipped = discovery.latest_intact(root)
  return layout.parse_step(path.name), [(p.name, why.split(':')[0]) for p, why in skipped]


def test_checkpoints_above_the_one_a_run_went_back_to_are_never_the_newest(tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20, 30, 35, 40)
  opts = CheckpointOptions(keep=3, mode='sync')
  with CheckpointManager(tmp_path, opts) as mgr:
    mgr.continue_from(20)  # --resume=step_00000020
    assert sorted(abandoned.steps(tmp_path)) == [30, 35, 40]
    assert json.loads((tmp_path / abandoned.FILE).read_text())['from_step'] == 20
    assert _newest(tmp_path) == (20, [('step_00000040', 'abandoned'),
                                      ('step_00000035', 'abandoned'),
                                      ('step_00000030', 'abandoned')])
    assert mgr.latest_step() == 20
    _save(mgr, 25)  # a stop lands here, before the replay reaches step 30
    assert _newest(tmp_path)[0] == 25
    assert sorted(layout.committed_steps(tmp_path)) == [10, 20, 25, 30, 35, 40]
    _save(mgr, 30)  # the replay replaces step 30: it is this history's now
    assert sorted(abandoned.steps(tmp_path)) == [35, 40]
    assert _newest(tmp_path)[0] == 30
    _save(mgr, 38)  # the replay passed 35 without saving it: not counted in keep, deleted
    assert sorted(layout.committed_steps(tmp_path)) == [25, 30, 38, 40]  # keep=3: 25, 30, 38
  with CheckpointManager(tmp_path, opts) as mgr:  # the next start continues from 38
    mgr.continue_from(_newest(tmp_path)[0])
    assert sorted(abandoned.steps(tmp_path)) == [40]  # above 38: kept for the replay
    assert 35 in abandoned.recorded(tmp_path)  # deleted here; --remote may still hold it
    _save(mgr, 35, 40, 50)
    assert abandoned.steps(tmp_path) == set() and _newest(tmp_path) == (50, [])
    mgr.continue_from(50)
    assert not (tmp_path / abandoned.FILE).exists()  # nothing abandoned: no record


def test_abandoned_checkpoints_are_taken_when_nothing_else_is_intact(tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20, 30)
    mgr.continue_from(10)
  (tmp_path / 'step_00000010' / layout.MANIFEST).write_text('{')  # the one it went back to
  path, skipped = discovery.latest_intact(tmp_path)
  assert path.name == 'step_00000030' and [p.name for p, _ in skipped] == []


@pytest.mark.parametrize(
    'record', ['{', '[]', '{"abandoned": {"x": "1"}}', '{"abandoned": 3}', '[' * 100_000])
def test_a_record_that_is_not_one_is_ignored(tmp_path, record):
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20)
  (tmp_path / abandoned.FILE).write_text(record)
  assert abandoned.steps(tmp_path) == set() and _newest(tmp_path) == (20, [])


def test_a_run_stopped_before_its_replay_resumes_its_own_history(trainer, tmp_path):
  first = trainer.train(tmp_path, '--config.train.steps=50', *FLAGS)
  assert first.returncode == 0, first.stderr
  back = tmp_path / 'checkpoints' / 'step_00000020'
  # It went back to step 20 and stopped at 25 (its last step here), before replaying 30-50.
  second = trainer.train(tmp_path, '--config.train.steps=25', *FLAGS, f'--resume={back}')
  assert second.returncode == 0, second.stderr
  assert committed_steps(tmp_path) == [10, 20, 25, 30, 40, 50]
  third = trainer.train(tmp_path, '--config.train.steps=50', *FLAGS)  # the same command again
  assert third.returncode == 0, third.stderr
  assert [e['step'] for e in events_of(tmp_path, 'resumed')] == [20, 25]  # not 50
  assert 'passing over' in third.stderr and 'abandoned' in third.stderr
  assert abandoned.steps(tmp_path / 'checkpoints') == set()  # the replay replaced 30, 40, 50


def test_a_run_stopped_before_its_replay_passes_over_the_remote_s_abandoned_steps(
    trainer, tmp_path, s3_server):
  url = s3_server.bucket()
  remote = (f'--remote={url}', '--remote_lease=off')
  first = trainer.train(tmp_path, '--config.train.steps=30', *FLAGS, *remote)
  assert first.returncode == 0, first.stderr
  # The uploader copies the newest checkpoint: 20 is passed over for 30 where its upload had not
  # begun when 30 committed; 10 (the first) and 30 (waited for at the end) are always there.
  assert remote_steps(Store(url)) in ([10, 20, 30], [10, 30])
  back = tmp_path / 'checkpoints' / 'step_00000010'
  second = trainer.train(tmp_path, '--config.train.steps=15', *FLAGS, *remote, f'--resume={back}')
  assert second.returncode == 0, second.stderr
  # A fresh machine (this disk lost) with the same command takes step 15, not the remote's 30.
  fresh = trainer.train(tmp_path / 'fresh', '--config.train.steps=15', *FLAGS, *remote)
  assert fresh.returncode == 0, fresh.stderr
  assert [e['step'] for e in events_of(tmp_path / 'fresh', 'resumed')] == [10, 15], fresh.stderr
  assert 'fetching step 15' in fresh.stderr and 'fetching step 30' not in fresh.stderr
  shutil.rmtree(tmp_path / 'checkpoints' / 'step_00000030')  # `jaxckpt delete`: the remote's stays
  third = trainer.train(tmp_path, '--config.train.steps=30', *FLAGS, *remote)
  assert third.returncode == 0, third.stderr
  assert [e['step'] for e in events_of(tmp_path, 'resumed')] == [10, 15]  # not the remote's 30
  assert 'fetching step 30' not in third.stderr  # not downloaded only to be passed over


def test_inspect_and_delete_of_a_run_see_the_history_it_is_on(tmp_path):
  root = tmp_path / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20, 30)
    mgr.continue_from(10)
    _save(mgr, 15)
  shown = jaxckpt_cli('inspect', str(tmp_path))
  assert shown.returncode == 0 and f'inspecting the newest committed one, {root}/step_00000015' \
      in shown.stderr, shown.stderr
  refused = jaxckpt_cli('delete', str(root / 'step_00000015'))
  assert refused.returncode == 2 and 'E-DELETE-002' in refused.stderr and \
      'resume from step 10' in refused.stderr, refused.stderr
  gone = jaxckpt_cli('delete', str(root / 'step_00000030'))  # abandoned: no --newest needed
  assert gone.returncode == 0, gone.stderr
  assert sorted(layout.committed_steps(root)) == [10, 15, 20]


def test_a_replay_that_skips_a_step_number_deletes_it_unless_its_manifest_keeps_it(tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, keep_every=40, mode='sync')) as mgr:
    _save(mgr, 10, 20, 25, 30, 40, 50)
    mgr.continue_from(20)
    _save(mgr, 25, 50)  # the replay's cadence: 25 steps; 30 and 40 are the old history's
    # Passed without being saved again: 30 goes; 40's manifest keeps it (keep_every), it stays.
    assert sorted(layout.committed_steps(tmp_path)) == [10, 20, 25, 40, 50]
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    mgr.continue_from(50)  # the next start resumes the newest, 50
    assert sorted(abandoned.steps(tmp_path)) == [40]
    (tmp_path / 'step_00000050' / layout.MANIFEST).write_text('{')  # damaged
    assert _newest(tmp_path)[0] == 25  # not the old history's 40


def test_an_abandoned_checkpoint_deleted_here_stays_recorded(tmp_path):
  """`--remote` may still hold it: its record goes only once the replay rewrote the step."""
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20, 30)
    mgr.continue_from(10)
    shutil.rmtree(tmp_path / 'step_00000030')  # `jaxckpt delete`
    _save(mgr, 15)
    assert sorted(abandoned.recorded(tmp_path)) == [20, 30]
    _save(mgr, 20, 30)  # the replay rewrote both: nothing is abandoned
    assert not (tmp_path / abandoned.FILE).exists()


def test_a_damaged_abandoned_fallback_is_not_taken_twice(tmp_path):
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20)
    mgr.continue_from(5)  # a .bin resume at step 5: 10 and 20 are abandoned
  bad = tmp_path / 'step_00000020'
  path, _ = discovery.latest_intact(tmp_path, known_bad={bad: 'checksum mismatch'})
  assert path.name == 'step_00000010'  # the restore found 20 damaged: never 20 again


def test_the_peer_tier_does_not_offer_abandoned_checkpoints(tmp_path):
  from jaxckpt.checkpoint import peers
  with CheckpointManager(tmp_path, CheckpointOptions(keep=0, mode='sync')) as mgr:
    _save(mgr, 10, 20, 30)
    mgr.continue_from(10)
  assert sorted(peers.held(tmp_path)) == ['10']
