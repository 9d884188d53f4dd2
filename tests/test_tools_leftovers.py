"""The tools where a newcomer tripped: `export` onto a file and its optimizer default, `evaluate`
of a remote run keeping its results, and remote retention on a path leaving no empty folders."""

import json
import math
import os

import jax.numpy as jnp
import pytest
from conftest import call_cli, jaxckpt_cli

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.remote import Store, objects

STEP_20 = 'step_00000020'


@pytest.fixture(scope='module')
def remote_run(trainer, tmp_path_factory):
  """A run that keeps one checkpoint, mirrored to a path (`file://`): retention deleted steps
  5, 10 and 15 there."""
  root = tmp_path_factory.mktemp('remote') / 'run'
  url = f'file://{root}'
  workdir = tmp_path_factory.mktemp('run')
  r = trainer.train(workdir, '--config.train.steps=20', '--checkpoint_every=5', '--keep=1',
                    '--config.train.log_every=10', f'--remote={url}')
  assert r.returncode == 0, r.stderr
  return workdir, url, root


def _empty_folders(root) -> list[str]:
  return sorted(str(d) for d, dirs, files in os.walk(root) if not dirs and not files)


# --------------------------------------------------------------------------- retention
def test_remote_retention_on_a_path_leaves_no_empty_folders(remote_run, compile_cache):
  _, url, root = remote_run
  assert sorted(os.listdir(root / 'checkpoints')) == [STEP_20]
  assert _empty_folders(root) == []
  r = jaxckpt_cli('verify', url, cache=compile_cache)
  assert r.returncode == 0 and r.stdout.splitlines() == [f'OK {url}/checkpoints/{STEP_20}'], \
      r.stdout + r.stderr


def test_a_path_delete_removes_only_the_folders_it_emptied(tmp_path):
  local = tmp_path / 'local'
  with CheckpointManager(local, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    for step in (1, 2):
      mgr.save(step, {'w': jnp.arange(1000.0) * step}, {'step': step})
  store = Store(str(tmp_path / 'remote'))
  for step in (1, 2):
    objects.upload(store, local / layout.step_dirname(step), {})
  mine = [tmp_path / 'remote' / 'checkpoints' / 'mine', tmp_path / 'remote' / 'other']
  for folder in mine:  # empty folders retention did not empty: not its to remove
    folder.mkdir()
  objects.delete(store, 1, may_delete=lambda what: None)
  assert sorted(objects.committed(store)) == [2]
  assert not (tmp_path / 'remote' / 'checkpoints' / layout.step_dirname(1)).exists()
  assert all(folder.is_dir() for folder in mine)
  assert _empty_folders(tmp_path / 'remote') == sorted(map(str, mine))
  restored, _ = objects.download(store, 2, tmp_path / 'back')
  assert restored.is_dir()


# ------------------------------------------------------------------------------ export
@pytest.mark.parametrize('fmt', ['hf', 'safetensors'])
@pytest.mark.parametrize('where', ['the file', 'under the file'])
def test_export_onto_a_file_is_refused_and_leaves_nothing(remote_run, tmp_path, capsys, fmt, where):
  workdir, _, _ = remote_run
  existing = tmp_path / 'notes.txt'
  existing.write_text('mine')
  out = existing if where == 'the file' else existing / 'hf'
  code, stdout, err = call_cli(
      ['export',
       str(workdir / 'checkpoints' / STEP_20), f'--format={fmt}', f'--out={out}'], capsys)
  assert code == 2 and not stdout
  assert err.startswith('jaxckpt: E-EXPORT-007: ') and err.count('\n') == 1, err
  assert os.listdir(tmp_path) == ['notes.txt'] and existing.read_text() == 'mine'


def test_safetensors_export_is_weights_only_unless_asked_as_during_training(
    remote_run, tmp_path, capsys):
  workdir, _, _ = remote_run
  during = sorted(set(os.listdir(workdir / 'exports' / STEP_20)) - {'hf'})
  source = str(workdir / 'checkpoints' / STEP_20)
  out = tmp_path / 'st'
  listings = {}
  for flags in ([], ['--optimizer'], ['--no-optimizer']):
    code, stdout, err = call_cli(['export', source, '--format=safetensors', f'--out={out}', *flags],
                                 capsys)
    assert code == 0, err
    listings[' '.join(flags)] = sorted(os.listdir(out))
    assert ('weights only' in stdout) == (flags != ['--optimizer']), stdout
  assert during == ['model.safetensors']
  assert listings == {
      '': during,
      '--optimizer': ['model.safetensors', 'optimizer.safetensors'],
      # The moments of the export before are gone: they would not match these weights' export.
      '--no-optimizer': during
  }


# ---------------------------------------------------------------------------- evaluate
def test_evaluate_of_a_remote_run_keeps_its_results_in_out(remote_run, tmp_path, compile_cache,
                                                           capsys):
  _, url, _ = remote_run
  out = tmp_path / 'evaluated.json'
  r = jaxckpt_cli('evaluate', f'--workdir={url}', f'--out={out}', cache=compile_cache, timeout=300)
  assert r.returncode == 0, r.stderr
  assert 'step 20: heldout_loss' in r.stdout and f'({url}/checkpoints/{STEP_20})' in r.stdout
  assert f'recorded in {out}' in r.stdout
  results = json.loads(out.read_text())
  assert list(results) == ['20'] and results['20']['path'] == f'{url}/checkpoints/{STEP_20}'
  assert math.isfinite(results['20']['heldout_loss'])

  again = jaxckpt_cli(
      'evaluate', f'--workdir={url}', f'--out={tmp_path}', cache=compile_cache, timeout=300)
  assert again.returncode == 0 and 'heldout_loss' not in again.stdout, again.stderr
  assert json.loads(out.read_text()) == results  # continued: nothing evaluated twice

  foreign = tmp_path / 'other.json'
  foreign.write_text(json.dumps({'20': {**results['20'], 'path': '/elsewhere/step_00000020'}}))
  code, _, err = call_cli(['evaluate', f'--workdir={url}', f'--out={foreign}'], capsys)
  assert code == 2 and err.startswith('jaxckpt: E-EVAL-005: ') and str(foreign) in err, err


def test_evaluate_of_a_remote_run_without_out_says_how_to_keep_them(remote_run, compile_cache):
  _, url, _ = remote_run
  r = jaxckpt_cli('evaluate', f'--workdir={url}', cache=compile_cache, timeout=300)
  assert r.returncode == 0, r.stderr
  assert 'step 20: heldout_loss' in r.stdout and '--out=evaluated.json' in r.stderr


def test_out_is_refused_for_a_local_run(remote_run, tmp_path, capsys):
  workdir, _, _ = remote_run
  code, _, err = call_cli(['evaluate', f'--workdir={workdir}', f'--out={tmp_path / "x"}'], capsys)
  assert code == 2 and 'E-USAGE-001' in err and f'{workdir}/evaluated.json' in err, err
  assert not (tmp_path / 'x').exists()
