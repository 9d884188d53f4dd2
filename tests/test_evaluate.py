"""The evaluator: weights only, committed checkpoints only, each once, following a live run."""

import json
import math
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY, abstract, committed_steps, jaxckpt_cli, make_state, subprocess_env

from jaxckpt import cli, evaluate
from jaxckpt.checkpoint import CheckpointManager, layout, manifest
from jaxckpt.errors import CheckpointError, ConfigError
from jaxckpt.export import frozen
from jaxckpt.records import provenance
from jaxckpt.records import workdir as workdir_lib

STEPS, EVERY = 60, 10


def is_params(name):
  return name.startswith('params/')


# -------------------------------------------------------------- restoring weights alone
def test_restore_only_the_params(mesh, tmp_path):
  state = make_state(mesh)
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, state)
  restored, run_state = CheckpointManager(
      tmp_path, writer=False).restore(
          1, {'params': abstract(state['params'])}, only=is_params)
  assert set(restored) == {'params'} and run_state == {'step': 1}
  for k in ('w', 'b'):
    assert np.asarray(restored['params'][k]).tobytes() == np.asarray(state['params'][k]).tobytes()
    assert restored['params'][k].sharding == state['params'][k].sharding


def test_restoring_the_params_needs_no_optimizer_bytes(mesh, tmp_path):
  """A checkpoint whose manifest lists optimizer tensors that are not on disk at all."""
  state = make_state(mesh)
  with CheckpointManager(tmp_path / 'full') as mgr:
    mgr.save(1, state)
  with CheckpointManager(tmp_path / 'weights') as mgr:
    mgr.save(1, {'params': state['params']})
  step_dir = tmp_path / 'weights' / layout.step_dirname(1)
  m = manifest.read(step_dir)
  m['tensors'] = manifest.read(tmp_path / 'full' / layout.step_dirname(1))['tensors']
  assert any(t['name'].startswith('opt_state/') for t in m['tensors'])
  (step_dir / layout.MANIFEST).write_bytes(manifest.sealed_json(m))

  mgr = CheckpointManager(tmp_path / 'weights', writer=False)
  restored, _ = mgr.restore(1, {'params': abstract(state['params'])}, only=is_params)
  assert np.asarray(restored['params']['w']).tobytes() == \
      np.asarray(state['params']['w']).tobytes()
  # The whole state does need them: a manifest listing tensors the state file lacks (only a hand
  # edit, re-sealed, makes one) is a one-line error naming the file and the tensors.
  with pytest.raises(CheckpointError, match='E-CKPT-012.*process_0.safetensors.*opt_state/'):
    mgr.restore(1, abstract(state))


def test_only_still_checks_the_tensors_it_reads(mesh, tmp_path):
  state = make_state(mesh)
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(1, state)
  wrong = {
      'params': {
          'w': jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=state['params']['w'].sharding),
          'b': abstract(state['params']['b'])
      }
  }
  with pytest.raises(Exception, match='E-PARAM-002.*params/w'):
    CheckpointManager(tmp_path, writer=False).restore(1, wrong, only=is_params)


# ------------------------------------------------------------------- following a live run
@pytest.fixture(scope='module')
def followed(trainer, compile_cache, tmp_path_factory):
  """A 60-step run with a checkpoint every 10, and an evaluator that was waiting before it began."""
  workdir = tmp_path_factory.mktemp('followed')
  log = workdir.parent / f'{workdir.name}-evaluator.log'
  with open(log, 'w') as out:
    ev = subprocess.Popen([
        sys.executable, '-m', 'jaxckpt.cli', 'evaluate', f'--workdir={workdir}', '--follow',
        '--poll_secs=0.1'
    ],
                          cwd=REPO,
                          stdout=out,
                          stderr=subprocess.STDOUT,
                          text=True,
                          env=subprocess_env(compile_cache))
  train = None
  try:
    deadline = time.monotonic() + 120
    while 'waiting for new checkpoints' not in log.read_text():  # ready before the run starts
      assert ev.poll() is None and time.monotonic() < deadline, log.read_text()
      time.sleep(0.05)
    train = trainer.start(workdir, f'--config.train.steps={STEPS}', f'--checkpoint_every={EVERY}',
                          '--keep=0')
    train_out, _ = train.communicate(timeout=240)
    assert train.returncode == 0, train_out
    ev.wait(timeout=120)  # it stops by itself after the finished checkpoint
  finally:
    for proc in (train, ev):
      if proc is not None and proc.poll() is None:
        proc.kill()
  out = log.read_text()
  assert ev.returncode == 0, out
  return workdir, out


def test_evaluator_follows_a_live_run_each_checkpoint_once(followed):
  workdir, out = followed
  steps = list(range(EVERY, STEPS + 1, EVERY))
  assert committed_steps(workdir) == steps
  lines = [l for l in out.splitlines() if l.startswith('step ')]
  assert [int(l.split()[1].rstrip(':')) for l in lines] == steps  # each once, in order
  assert out.splitlines()[0].startswith('waiting for new checkpoints')  # before any existed
  assert out.splitlines()[-1].endswith('all its checkpoints are evaluated')
  assert 'Traceback' not in out and 'warn' not in out.lower()
  results = json.loads((workdir / workdir_lib.EVALUATED).read_text())
  assert list(results) == [str(s) for s in steps]
  for step in steps:
    r = results[str(step)]
    step_dir = workdir / 'checkpoints' / layout.step_dirname(step)
    assert r['path'] == str(step_dir) and math.isfinite(r['heldout_loss'])
    assert r['committed_at'] == manifest.read(step_dir)['committed_at'] <= r['evaluated_at']
  assert results['60']['heldout_loss'] < results['10']['heldout_loss']
  # Nothing but committed step directories: the evaluator wrote nothing among the checkpoints.
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == [
      layout.step_dirname(s) for s in steps
  ]


def test_a_restarted_evaluator_evaluates_nothing_again(followed, compile_cache):
  workdir, _ = followed
  before = (workdir / workdir_lib.EVALUATED).read_text()
  for follow in (['--follow'], []):
    r = jaxckpt_cli('evaluate', f'--workdir={workdir}', *follow, cache=compile_cache)
    assert r.returncode == 0, r.stderr
    assert not [l for l in r.stdout.splitlines() if l.startswith('step ')]
  assert (workdir / workdir_lib.EVALUATED).read_text() == before


def test_a_rewritten_checkpoint_is_evaluated_again(followed, tmp_path):
  workdir, _ = followed
  results = json.loads((workdir / workdir_lib.EVALUATED).read_text())
  results['30']['committed_at'] -= 1  # as if a resumed run had written step 30 again since
  (tmp_path / 'checkpoints').symlink_to(workdir / 'checkpoints')
  (tmp_path / workdir_lib.EVALUATED).write_text(json.dumps(results))
  ev = evaluate.Evaluator(tmp_path)
  assert [step for step, _, _ in ev.pending()] == [30]
  assert ev.finished()


def test_one_evaluator_per_workdir(followed, capsys):
  workdir, _ = followed
  with workdir_lib.EvaluatorLock(workdir):
    with pytest.raises(SystemExit) as e:
      cli.main(['evaluate', f'--workdir={workdir}'])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith('jaxckpt: E-EVAL-001: ') and 'in use by another evaluator' in err


def test_evaluate_usage(tmp_path, capsys):
  for argv, code in ((['evaluate'], 'E-USAGE-001'), (['evaluate', '--workdir=x',
                                                      '--poll_secs=0'], 'E-USAGE-001'),
                     ([f'--workdir={tmp_path / "nowhere"}'], 'E-EVAL-003')):
    with pytest.raises(SystemExit) as e:
      cli.main(argv if argv[0] == 'evaluate' else ['evaluate', *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f'jaxckpt: {code}: ') and err.count('\n') == 1


def test_a_damaged_checkpoint_is_warned_about_once_and_the_others_evaluated(followed, tmp_path):
  workdir, _ = followed
  for step in (50, 60):
    name = layout.step_dirname(step)
    shutil.copytree(workdir / 'checkpoints' / name, tmp_path / 'checkpoints' / name)
  damaged = tmp_path / 'checkpoints' / layout.step_dirname(50) / layout.RUN_STATE
  damaged.write_text(damaged.read_text()[:-3])
  warnings, lines = [], []
  ev = evaluate.Evaluator(tmp_path, log=lines.append, warn=warnings.append)
  assert ev.run_once() == ([60], True)
  assert ev.run_once() == ([], True)
  assert len(warnings) == 1 and 'step 50: not evaluated: E-CKPT-003' in warnings[0]
  results = json.loads((tmp_path / workdir_lib.EVALUATED).read_text())
  assert list(results) == ['60']
  # The same weights give the same loss, on 8 devices here as on the follower's 1.
  expected = json.loads((workdir / workdir_lib.EVALUATED).read_text())['60']['heldout_loss']
  assert results['60']['heldout_loss'] == pytest.approx(expected, rel=1e-5)


def test_a_mesh_that_does_not_fit_here_falls_back_to_one_device():
  config = provenance.load_config_file(TINY)
  config.mesh.data, config.mesh.model = 4, 4  # written on 16 devices; this process has 8
  trainer = evaluate._build_trainer(config)
  assert trainer.mesh.size == 1
  config = provenance.load_config_file(TINY)
  config.train.batch_size = 4  # written on 4 devices with mesh.data=-1: here all 8, 4 % 8 != 0
  assert evaluate._build_trainer(config).mesh.size == 1


def test_any_other_config_error_is_raised_not_retried_on_one_device(monkeypatch):
  from jaxckpt.train import state as trainer_lib

  def refuse(train_cfg):
    raise ConfigError('E-CONFIG-001', 'train.b1=2.0 must be below 1', 'set --config.train.b1')

  monkeypatch.setattr(trainer_lib, 'make_optimizer', refuse)
  config = provenance.load_config_file(TINY)
  config.mesh.data, config.mesh.model = 4, 2  # fits this process's 8 devices
  with pytest.raises(ConfigError, match='E-CONFIG-001: train.b1'):
    evaluate._build_trainer(config)
  assert (config.mesh.data, config.mesh.model) == (4, 2)  # not rewritten for a fallback


@pytest.fixture
def one_pending(followed, tmp_path):
  """An evaluator of a copy of the followed run's last checkpoint, and that checkpoint."""
  workdir, _ = followed
  name = layout.step_dirname(STEPS)
  shutil.copytree(workdir / 'checkpoints' / name, tmp_path / 'checkpoints' / name)
  warnings = []
  ev = evaluate.Evaluator(tmp_path, log=lambda s: None, warn=warnings.append)
  [(step, path, meta)] = ev.pending()
  return ev, warnings, (step, path, meta)


def test_a_checkpoint_retention_deletes_while_it_is_evaluated_is_skipped(one_pending, monkeypatch):
  ev, warnings, (step, path, meta) = one_pending
  real, gone = manifest.crc32_file, []

  def retire_then_read(file, **kw):  # retention renames the checkpoint away, then deletes it
    if not gone:
      gone.append(layout.deleting_dir(path.parent, step))
      path.rename(gone[0])
      shutil.rmtree(gone[0])
    return real(file, **kw)

  monkeypatch.setattr(manifest, 'crc32_file', retire_then_read)
  assert ev.evaluate(step, path, meta) is None and gone
  assert len(warnings) == 1 and 'was deleted (retention) before it could be evaluated' in \
      warnings[0]
  assert evaluate.read_results(ev.workdir) == {}


def test_a_bug_while_evaluating_is_raised_even_if_the_checkpoint_vanished(one_pending, monkeypatch):
  ev, warnings, (step, path, meta) = one_pending

  def vanish_then_fail(step_dir, manifest):
    shutil.rmtree(step_dir)
    raise TypeError('a bug in the reader')  # not the deletion's doing: it must surface

  monkeypatch.setattr(frozen, 'read_excluded', vanish_then_fail)
  with pytest.raises(TypeError, match='a bug in the reader'):
    ev.evaluate(step, path, meta)
  assert not warnings
