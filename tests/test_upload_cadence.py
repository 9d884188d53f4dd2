"""`--remote_every`: which local checkpoints go to the remote (the second cadence of
`--replicas`), and the local retention that leaves a checkpoint alone while it is uploaded.

The 3-process run with `--replicas=1 --remote_every=3` is in test_peers_training.py."""

import dataclasses

import jax.numpy as jnp
import pytest
from conftest import committed_steps, events_of, remote_steps, tiny_config

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, cadence
from jaxckpt.checkpoint.remote import Store
from jaxckpt.errors import ConfigError
from jaxckpt.hosts import distributed
from jaxckpt.hosts.remote import RemoteRun
from jaxckpt.hosts.upload_cadence import UploadCadence
from jaxckpt.records.runlog import RunLog, read_status
from jaxckpt.train.config import validate_config


def test_every_third_checkpoint_one_kept_for_good_and_the_last_go_up(trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  workdir = tmp_path / 'run'
  r = trainer.train(workdir, '--config.train.steps=70', '--checkpoint_every=10', '--keep=2',
                    '--keep_every=40', '--remote_every=3', f'--remote={url}')
  assert r.returncode == 0, r.stderr
  # 30: the third; 40: kept for good (K counts from it); 70: the last.
  assert [e['step'] for e in events_of(workdir, 'uploaded')] == [30, 40, 70]
  assert remote_steps(Store(url)) == [40, 70]  # the remote's retention follows --keep=2
  assert committed_steps(workdir) == [40, 60, 70]
  assert read_status(workdir)['remote_every'] == 3
  assert 'upload every 3 checkpoints' in r.stderr  # the progress line
  assert f'step 70 is durable in {url}' in r.stderr


@pytest.mark.parametrize('field, value', [('remote_every', 0), ('remote_every', 'often'),
                                          ('remote_every', 1.5), ('remote_mtbi', '-3d')])
def test_a_bad_remote_cadence_is_a_config_error(field, value):
  with pytest.raises(ConfigError) as e:
    validate_config(tiny_config(**{f'checkpoint.{field}': value}))
  assert e.value.code == 'E-CONFIG-004' and f'--{field}' in e.value.what


def test_k_counts_from_the_start_checkpoint_and_the_last_always_goes_up():
  up = UploadCadence(tiny_config(**{'checkpoint.remote_every': 3}), distributed.Cluster())
  assert [up.take(s) for s in (10, 20, 30, 40)] == [False, False, True, False]
  up.started()  # a restart: the checkpoint it continues from was handed over
  assert [up.take(s) for s in (50, 60, 70)] == [False, False, True]
  assert up.take(80, always=True)  # the last step of an invocation, a stop, or kept for good
  assert [up.take(s) for s in (90, 100, 110)] == [False, False, True]  # counted from it


def test_auto_with_replicas_uploads_every_kth_checkpoint_by_daly(tmp_path):
  config = tiny_config(
      **{'checkpoint.every': 'auto', 'checkpoint.replicas': 1, 'checkpoint.remote_mtbi': '3d'})
  runlog = RunLog(tmp_path)
  up = UploadCadence(config, distributed.Cluster(), runlog)
  up.uploaded(2.0)
  local = cadence.plan(delta_s=0.2, mtbi_s=3600.0, step_s=0.1)
  up.replan(local, 500, state_bytes=1_000_000_000)  # δ_up guessed at 2 s
  remote = cadence.plan(delta_s=2.0, mtbi_s=3 * 86400.0, step_s=0.1, durable_s=2.0)
  assert up.k == round(remote.interval_s / local.interval_s) > 1
  event = events_of(tmp_path, 'cadence')[-1]
  assert event['tier'] == 'remote' and event['every_checkpoints'] == up.k
  assert event['upload_s'] == 2.0 and not event['delta_measured']
  # Without --replicas a lost host has only the remote: every checkpoint goes up.
  alone = UploadCadence(tiny_config(**{'checkpoint.every': 'auto'}), distributed.Cluster())
  alone.replan(local, 500, state_bytes=1_000_000_000)
  assert alone.k == 1 and all(alone.take(s) for s in (1, 2, 3))


def test_retention_leaves_a_held_checkpoint_until_it_is_let_go(tmp_path):
  state = {'w': jnp.arange(8.0)}
  held = {10}
  with CheckpointManager(tmp_path, CheckpointOptions(keep=1)) as mgr:
    mgr.held = lambda: held  # e.g. an upload of step 10 still reading it
    for step in (10, 20, 30):
      mgr.save(step, state)
      mgr.wait_until_finished()
    assert mgr.all_steps() == [10, 30]
    held.clear()
    mgr.save(40, state)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [40]


@pytest.mark.parametrize(
    'fields',
    [{'checkpoint.remote_every': 3}, {'checkpoint.every': 'auto', 'checkpoint.replicas': 1}],
    ids=['fixed', 'planned'])
def test_across_processes_the_others_upload_the_steps_process_0_says(fields):
  """Process 0 counts for every process (K fixed or planned): the other takes its answer for each
  step from the job's real key-value store, and uploads its part when none comes in time."""
  from test_remote_ends import _job, _Process
  config = tiny_config(**fields)
  with _job(2) as kv:
    leader, other = (
        UploadCadence(config, _Process(k, 2, timeout_secs=2, kv=kv[k])) for k in (0, 1))
    leader.k = 3  # a plan's K, or the flag's; process 1 never plans
    both = [(leader.take(s), other.take(s)) for s in (10, 20, 30, 40, 50, 60)]
    assert both == [(False, False), (False, False), (True, True)] * 2
    assert other.take(70, always=True)  # the last: no word needed
    assert other.take(80)  # process 0 never said: its part is uploaded all the same


def test_auto_keeps_saving_while_only_every_third_checkpoint_goes_up(trainer, s3_server, tmp_path):
  """Without --replicas the automatic cadence waits for the last checkpoint sent to be durable,
  not for one that --remote_every passed over (which never will be)."""
  url = s3_server.bucket()
  r = trainer.train(tmp_path, '--checkpoint_every=auto', '--checkpoint_mtbi=60s',
                    '--config.train.steps=500', '--config.train.log_every=50', '--remote_every=3',
                    f'--remote={url}')
  assert r.returncode == 0, r.stderr
  saves = [e['step'] for e in events_of(tmp_path, 'checkpoint')]
  uploaded = [e['step'] for e in events_of(tmp_path, 'uploaded')]
  assert len(saves) >= 4, saves  # on after the 1st, which did not go up (and never will)
  assert uploaded == saves[2:-1:3] + [500], (saves, uploaded)


def test_the_cost_of_an_upload_is_measured_against_the_loops_step_boundaries():
  """δ_up: the loop's time across an upload, less its steps at the clean step time and less
  what local saves cost meanwhile; the plan then says it is measured."""
  config = tiny_config(**{'checkpoint.every': 'auto', 'checkpoint.replicas': 1})
  up = UploadCadence(config, distributed.Cluster())
  position = [(100.0, 1000, 5.0)]
  up.watch(lambda: position[0], lambda: 0.1)
  up.upload_started()
  position[0] = (112.0, 1100, 6.5)  # 100 steps in 12 s: 10 s of steps, 1.5 s of local saves
  up.uploaded(11.0)
  assert up.delta_s == pytest.approx(0.5) and up.upload_s == 11.0
  up.replan(cadence.plan(delta_s=0.2, mtbi_s=3600.0, step_s=0.1), 1100, state_bytes=10**9)
  assert up.plan.delta_s == pytest.approx(0.5)
  up.upload_started()
  position[0] = (112.5, 1100, 6.5)  # no step ended while it ran: no sample
  up.uploaded(0.5)
  assert up.delta_s == pytest.approx(0.5)


def test_a_commit_the_peers_do_not_cover_goes_up_whatever_remote_every_says(tmp_path):
  """With `--replicas`, a commit whose word says a part has no confirmed copy on another host
  (`CommitInfo.replicas == 0`) is uploaded though `--remote_every` passes it over, is said
  (`replicas_short`), and counts durable once up; a covered one is durable when committed."""
  workdir, url = tmp_path / 'run', f'file://{tmp_path}/bucket/run'
  config = tiny_config(
      **{'checkpoint.remote': url, 'checkpoint.remote_every': 3, 'checkpoint.replicas': 1})
  ckpt_dir, options = workdir / 'checkpoints', CheckpointOptions(keep=0)
  (tmp_path / 'bucket').mkdir()
  infos = []
  with RemoteRun.opened(config, workdir) as run:
    run.attach(RunLog(workdir), options, ckpt_dir)
    run.started(None, ckpt_dir, 0)
    durable = run.chain(lambda: True)
    with CheckpointManager(ckpt_dir, options, on_commit=infos.append) as mgr:
      for step, copies in ((5, 1), (10, 0), (15, 1)):
        mgr.save(step, {'w': jnp.full(8, float(step))})
        mgr.wait_until_finished()
        run.on_commit(dataclasses.replace(infos[-1], replicas=copies))
        if step == 10:
          assert run.uploader.wait(10, timeout=60)
          assert run.durable(10) and durable()  # up: durable now, not before
      assert durable()  # 15: the peers hold a copy of every part, not uploaded
      assert run.uploader.wanted_step is None  # 15 not sent
  assert [e['step'] for e in events_of(workdir, 'replicas_short')] == [10]
  assert remote_steps(Store(url)) == [10, 15]  # 5 was passed over; the end sends the last
