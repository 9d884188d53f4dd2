"""Exports, evaluation and pivots trust nothing they read: a safetensors file's `jaxckpt.dtypes`,
a `--config`'s model, a sealed manifest's config, step and `init_from`, a `.bin` header,
`evaluated.json`, `events.jsonl`; and an export that fails during training is retried at the
next commit, naming a command that writes it later.

One tiny run (20 steps from an init_from file with `wte` frozen, checkpoints at 10 and 20)
serves the module; the damaging cases work on copies of its checkpoints, resealed.
"""

import json
import os
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import ml_collections
import numpy as np
import pytest
from conftest import REPO, call_cli, flip_a_data_byte, jaxckpt_cli, tiny_config

from jaxckpt.checkpoint import atomic, manifest
from jaxckpt.errors import CheckpointError, ConfigError, ResumeError
from jaxckpt.export import during_training, flatbin, safetensors_io, weights
from jaxckpt.export.tensorfile import File, Unreadable
from jaxckpt.model import gpt as model_lib
from jaxckpt.records import phases
from jaxckpt.records.workdir import ARCHIVE, BANDIT, EVALUATED, EVENTS

STEP_10, STEP_20 = 'step_00000010', 'step_00000020'


def random_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  shapes = model_lib.param_shapes(tiny_config().model)
  return {n: rng.normal(scale=0.02, size=s).astype(np.float32) for n, s in shapes.items()}


@pytest.fixture(scope='module')
def run(trainer, tmp_path_factory) -> Path:
  """The workdir of a 20-step run from an init_from file, `wte` frozen (kept out of its
  checkpoints, read from the pinned file), checkpoints at steps 10 and 20."""
  root = tmp_path_factory.mktemp('trust')
  init = root / 'init.safetensors'
  safetensors_io.write_model(init, random_params())
  r = trainer.train(root / 'run', '--config.train.steps=20', '--checkpoint_every=10', '--keep=0',
                    '--config.train.log_every=10', f'--config.train.init_from={init}',
                    "--config.train.frozen=('wte.*',)", '--export_every=0')
  assert r.returncode == 0, r.stderr
  return root / 'run'


def refused(code, stdout, err, which: str, status: int) -> str:
  """One line `jaxckpt: <which>: ...` on stderr, nothing on stdout, exit `status`."""
  assert code == status and not stdout, (code, stdout, err)
  assert err.startswith(f'jaxckpt: {which}: ') and err.count('\n') == 1, err
  return err


def export(source, fmt, out, capsys, *flags):
  return call_cli(['export', str(source), f'--format={fmt}', f'--out={out}', *flags], capsys)


def resealed(step_dir: Path, dest: Path, edit) -> Path:
  """A copy of the checkpoint `step_dir` at `dest/<its name>` whose manifest `edit(m)` changed,
  sealed again: a hand-edited manifest that `jaxckpt verify` finds intact."""
  copy = dest / step_dir.name
  shutil.copytree(step_dir, copy)
  m = json.loads((copy / 'manifest.json').read_bytes())
  edit(m)
  (copy / 'manifest.json').write_bytes(manifest.sealed_json(m))
  return copy


def config_file(where: Path, body: str) -> Path:
  """A --config file: `body` is get_config()'s, `c` the default config in it."""
  path = where / 'cfg.py'
  path.write_text(f'import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom configs import default\n'
                  f'def get_config():\n  c = default.get_config()\n  {body}\n')
  return path


# ------------------------------------------------------------ 1. jaxckpt.dtypes is not trusted
@pytest.mark.parametrize('record', [{'wte.embedding': 'int8'}, {'wte.embedding': 'float64'},
                                    {'nope': 'bfloat16'}, ['x'], 'not json'])
def test_a_dtype_record_that_jaxckpt_does_not_write_makes_the_file_unreadable(tmp_path, record):
  evil = tmp_path / 'evil.safetensors'
  safetensors_io.write_tensors(
      evil,
      random_params(),
      metadata={
          safetensors_io.DTYPES_KEY: record if isinstance(record, str) else json.dumps(record)
      })
  with pytest.raises(Unreadable, match='jaxckpt.dtypes'):
    File(str(evil))
  with pytest.raises(
      ConfigError, match='^E-LOAD-002: cannot read train.init_from=.*jaxckpt.dtypes'):
    weights.plan(str(evil), tiny_config().model)
  with pytest.raises(ValueError, match='jaxckpt.dtypes'):
    safetensors_io.read_model(evil)


def test_a_recorded_narrow_float_stored_as_f32_is_still_restored(tmp_path):
  import ml_dtypes
  params = random_params()
  params['wte.embedding'] = params['wte.embedding'].astype(ml_dtypes.bfloat16)
  safetensors_io.write_model(tmp_path / 'm.safetensors', params)
  pin = weights.plan(str(tmp_path / 'm.safetensors'), tiny_config().model)
  back = weights.read_pinned(pin)
  assert back['wte.embedding'].dtype == ml_dtypes.bfloat16
  assert back['wte.embedding'].tobytes() == params['wte.embedding'].tobytes()


def test_training_from_a_file_with_a_false_dtype_record_is_refused(trainer, tmp_path):
  evil = tmp_path / 'evil.safetensors'
  safetensors_io.write_tensors(
      evil, random_params(), metadata={safetensors_io.DTYPES_KEY: '{"wte.embedding":"int8"}'})
  r = trainer.train(tmp_path / 'run', '--config.train.steps=2', f'--config.train.init_from={evil}',
                    "--config.train.frozen=('wte.*',)")
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith('jaxckpt: E-LOAD-002: '), r.stderr
  assert 'Traceback' not in r.stderr and not (tmp_path / 'run' / 'checkpoints').is_dir()


# ------------------------------------------------------------------ 2. the model config
@pytest.mark.parametrize('body, which', [
    ('c.model.n_head = 3; return c', 'E-CONFIG-001'),
    ('c.model.n_head = 4; return c', 'E-EXPORT-002'),
    ('del c.model; return c', 'E-CONFIG-001'),
    ("c.model = {'n_layer': 2}; return c", 'E-CONFIG-001'),
    ('return 5', 'E-USAGE-001'),
])
def test_a_config_that_is_not_the_checkpoints_model_is_refused_writing_nothing(
    run, tmp_path, capsys, body, which):
  cfg = config_file(tmp_path, body)
  out = tmp_path / 'out'
  err = refused(*export(run / 'checkpoints' / STEP_20, 'hf', out, capsys, f'--config={cfg}'), which,
                2)
  assert not out.exists()
  if which == 'E-EXPORT-002':
    assert 'n_head=4 (the checkpoint: 2)' in err


def test_the_config_it_was_trained_with_still_exports(run, tmp_path, capsys):
  cfg = config_file(tmp_path, 'return c')
  code, out, err = export(run / 'checkpoints' / STEP_20, 'hf', tmp_path / 'out', capsys,
                          f'--config={cfg}')
  assert code == 0, err
  assert json.loads((tmp_path / 'out' / 'config.json').read_text())['n_head'] == 2


def test_a_bin_with_a_config_the_model_cannot_have_is_refused(run, tmp_path, capsys):
  shapes = model_lib.param_shapes(tiny_config().model)
  params = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
  flatbin.write_bin(tmp_path / 'x.bin', 5, params, params, params)
  cfg = config_file(tmp_path, 'c.model.n_head = 3; return c')
  refused(*export(tmp_path / 'x.bin', 'hf', tmp_path / 'out', capsys, f'--config={cfg}'),
          'E-CONFIG-001', 2)


@pytest.mark.parametrize('edit, problem', [
    (lambda m: m['config']['model'].update(n_layer='two'), "model.n_layer='two'"),
    (lambda m: m['config']['model'].update(n_head=3), 'not a multiple of model.n_head=3'),
    (lambda m: m['config']['model'].update(tie_embeddings='false'), 'tie_embeddings'),
    (lambda m: m.update(config=[1]), 'config is list'),
])
def test_a_resealed_manifest_whose_model_config_is_not_one_is_refused(run, tmp_path, capsys, edit,
                                                                      problem):
  step_dir = resealed(run / 'checkpoints' / STEP_20, tmp_path, edit)
  err = refused(*export(step_dir, 'bin', tmp_path / 'x.bin', capsys), 'E-EXPORT-004', 1)
  assert problem in err
  assert not (tmp_path / 'x.bin').exists()


def test_evaluate_refuses_a_bad_config_and_passes_over_a_bad_manifest(run, tmp_path, capsys):
  workdir = tmp_path / 'run'
  resealed(run / 'checkpoints' / STEP_20, workdir / 'checkpoints',
           lambda m: m['config']['model'].update(n_layer='two'))
  for body, which in (('return 5', 'E-USAGE-001'), ('c.model.n_head = 3; return c',
                                                    'E-CONFIG-001')):
    cfg = config_file(tmp_path, body)
    refused(*call_cli(['evaluate', f'--workdir={workdir}', f'--config={cfg}'], capsys), which, 2)
  code, out, err = call_cli(['evaluate', f'--workdir={workdir}'], capsys)
  lines = err.strip().splitlines()
  assert code == 1 and len(lines) == 2, err
  assert lines[0].startswith('jaxckpt: step 20: not evaluated: E-CKPT-004: ') and 'n_layer' in err
  assert lines[1].startswith('jaxckpt: E-EVAL-006: ')


# ----------------------------------------------- 3. a damaged last checkpoint ends --follow
@pytest.mark.parametrize('damage', ['a data byte', 'the manifest'])
def test_follow_ends_when_the_finished_runs_last_checkpoint_is_damaged(
    run, tmp_path, compile_cache, damage):
  """A flipped byte: found as it is read. A manifest that cannot be read says nothing: the
  run's status.json says it finished at that step."""
  workdir = tmp_path / 'run'
  step_dir = workdir / 'checkpoints' / STEP_20
  shutil.copytree(run / 'checkpoints' / STEP_20, step_dir)
  assert json.loads((step_dir / 'manifest.json').read_text())['finished']
  if damage == 'a data byte':
    flip_a_data_byte(step_dir)
  else:
    (step_dir / 'manifest.json').write_text('{')
    (workdir / 'status.json').write_text(json.dumps({'state': 'finished', 'step': 20}))
  r = jaxckpt_cli(
      'evaluate',
      f'--workdir={workdir}',
      '--follow',
      '--poll_secs=0.05',
      cache=compile_cache,
      timeout=120)  # before the fix: never returns
  assert r.returncode == 1, r.stderr
  lines = r.stderr.strip().splitlines()
  assert lines[-1].startswith('jaxckpt: E-EVAL-006: 1 of 1 committed checkpoint(s)'), r.stderr
  assert 'Traceback' not in r.stderr


# ----------------------------------------------------------------- 4. evaluated.json
@pytest.mark.parametrize('content', ['{"abc": {}}', '{"-1": {}}', '{"4.5": {}}', 'directory'])
def test_an_evaluated_json_that_is_not_one_is_e_eval_002(tmp_path, capsys, content):
  (tmp_path / 'checkpoints').mkdir()
  if content == 'directory':
    (tmp_path / EVALUATED).mkdir()
  else:
    (tmp_path / EVALUATED).write_text(content)
  refused(*call_cli(['evaluate', f'--workdir={tmp_path}'], capsys), 'E-EVAL-002', 2)


# ------------------------------------------------------------- 5. the manifest's init_from
@pytest.mark.parametrize('pin, problem', [
    ('x', "init_from is 'x', not an object"),
    ({'files': [{'path': 5}]}, 'init_from.files[0].path is 5'),
    ({'files': 'a'}, 'init_from.files is'),
    ({'files': [{'path': 'a', 'size': 1, 'tensors': [1]}]}, 'init_from.files[0].tensors'),
])
def test_a_manifest_init_from_of_the_wrong_shape_is_e_ckpt_004(run, tmp_path, capsys, pin, problem):
  step_dir = resealed(run / 'checkpoints' / STEP_20, tmp_path, lambda m: m.update(init_from=pin))
  err = refused(*export(step_dir, 'safetensors', tmp_path / 'out', capsys), 'E-CKPT-004', 1)
  assert problem in err
  with pytest.raises(CheckpointError, match='E-CKPT-004'):
    weights.normalize(pin)


# ---------------------------------------------------------------- 6. a negative .bin step
def test_a_bin_whose_header_step_is_negative_is_refused(tmp_path, capsys):
  shapes = model_lib.param_shapes(tiny_config().model)
  params = {n: np.ones(s, np.float32) for n, s in shapes.items()}
  path = tmp_path / 'neg.bin'
  flatbin.write_bin(path, 5, params, params, params)
  with open(path, 'r+b') as f:
    f.write(struct.pack('<i', -5))
  with pytest.raises(ResumeError, match='E-BIN-001: .*step=-5'):
    flatbin.read_bin(path, shapes)
  refused(*export(path, 'hf', tmp_path / 'out', capsys, f'--config={REPO / "configs/tiny.py"}'),
          'E-BIN-001', 2)
  assert not (tmp_path / 'out').exists()


# ---------------------------------------------------- 7. the manifest's step is its folder's
def test_a_manifest_whose_step_is_not_its_directorys_is_not_exported(run, tmp_path, capsys):
  step_dir = resealed(run / 'checkpoints' / STEP_20, tmp_path, lambda m: m.update(step=99))
  err = refused(*export(step_dir, 'bin', tmp_path / 'x.bin', capsys), 'E-EXPORT-004', 1)
  assert 'says step 99, its directory step 20' in err
  assert not (tmp_path / 'x.bin').exists()


# ------------------------------------------------------------------------ 8. pivot
def stopped_run(workdir: Path, events: str) -> Path:
  (workdir / 'checkpoints').mkdir(parents=True)
  (workdir / BANDIT).write_text('{}')
  (workdir / EVENTS).write_text(events)
  return workdir


def test_foreign_event_rows_are_no_pivot_and_pivot_refuses_them_untouched(tmp_path, capsys):
  workdir = stopped_run(tmp_path / 'run', '{"x": 1}\n[1]\n"s"\n{"event": "pivot"}\n')
  assert phases.current_phase(workdir) == 1
  err = refused(*call_cli(['pivot', f'--workdir={workdir}'], capsys), 'E-PIVOT-001', 2)
  assert 'row 1: {"x": 1}' in err
  assert not (workdir / ARCHIVE).exists() and (workdir / BANDIT).is_file()
  (workdir / EVENTS).write_text('{"event": "pivot"}\n')
  code, out, err = call_cli(['pivot', f'--workdir={workdir}'], capsys)
  assert code == 0 and not err, err
  assert (workdir / ARCHIVE / 'phase-1' / BANDIT).is_file()


def test_pivot_refuses_an_archive_that_is_not_a_directory(tmp_path, capsys):
  workdir = stopped_run(tmp_path / 'run', '')
  (workdir / ARCHIVE).write_text('mine')
  err = refused(*call_cli(['pivot', f'--workdir={workdir}'], capsys), 'E-PIVOT-002', 2)
  assert str(workdir / ARCHIVE) in err
  assert (workdir / ARCHIVE).read_text() == 'mine' and (workdir / BANDIT).is_file()


# ----------------------------------------------- 9. a failed export is retried at the next commit
def staged_state() -> dict[str, np.ndarray]:
  """What a commit stages for the tiny model: params and Adam moments by checkpoint leaf name."""
  out = {}
  for name, x in random_params().items():
    leaf = name.replace('.', '/')
    out[f'params/{leaf}'] = x
    out[f'opt_state/0/mu/{leaf}'] = x * 0.5
    out[f'opt_state/0/nu/{leaf}'] = x * x
  return out


def exporter(directory: Path, every: int = 20) -> during_training.Exporter:
  config = ml_collections.ConfigDict({
      'export': {'every': every, 'formats': 'safetensors,hf', 'keep': 0, 'optimizer': False},
      'model': tiny_config().model.to_dict(), 'train': {'steps': 100}
  })
  return during_training.Exporter(directory / 'exports', config)


def commit(step: int, workdir: Path):
  return SimpleNamespace(
      step=step, staged=staged_state(), path=workdir / 'checkpoints' / f'step_{step:08d}')


def test_a_failed_export_is_retried_at_the_next_commit_due_or_not(tmp_path, monkeypatch):
  ex = exporter(tmp_path)
  assert ex.on_commit(commit(10, tmp_path)) is None  # not due
  real = during_training.write_exports

  def disk_full(*args, **kwargs):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(during_training, 'write_exports', disk_full)
  with pytest.raises(OSError):
    ex.on_commit(commit(20, tmp_path))
  monkeypatch.setattr(during_training, 'write_exports', real)
  done = ex.on_commit(commit(30, tmp_path))  # not due, but the failed one is retried
  assert done is not None and done['step'] == 30 and done['retry_of'] == 20
  assert sorted(os.listdir(tmp_path / 'exports')) == ['step_00000030']
  assert ex.on_commit(commit(35, tmp_path)) is None  # caught up: the cadence again


def test_a_failed_step_directory_names_both_formats_and_a_command_that_runs(
    run, tmp_path, monkeypatch, capsys):
  import jaxckpt.export as export_pkg
  publish = export_pkg.publish_dir

  def refuse(tmp, path):  # the step directory's rename fails; hf/ inside it was published
    if path.name != STEP_20:
      return publish(tmp, path)
    raise PermissionError(1, 'Operation not permitted', str(path))

  monkeypatch.setattr(export_pkg, 'publish_dir', refuse)
  ex = exporter(tmp_path, every=10)
  info = commit(20, run)
  with pytest.raises(CheckpointError) as e:
    ex.on_commit(info)
  line = e.value.line()
  assert '\n' not in line and line.startswith(
      f'E-EXPORT-006: exporting step 20 as safetensors,hf to {tmp_path / "exports" / STEP_20} '
      'failed: PermissionError'), line
  assert not (tmp_path / 'exports' / STEP_20).exists()
  monkeypatch.undo()
  # The command in the fix runs as printed (the checkpoint it names is the run's step 20).
  command = line.split('`')[1]
  assert command.startswith(f'jaxckpt export {run / "checkpoints" / STEP_20} --format=')
  for part in command.split(' && '):
    code, out, err = call_cli(part.split()[1:], capsys)
    assert code == 0, err
  assert sorted(os.listdir(tmp_path / 'exports' / STEP_20)) == ['hf', 'model.safetensors']


def test_a_failed_hf_export_names_the_safetensors_it_took_with_it(run, tmp_path, monkeypatch,
                                                                  capsys):
  """hf and safetensors share one temporary directory, discarded whole: the command that writes
  the export later writes both."""
  from jaxckpt.export import during_training

  def fail(*args, **kwargs):
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(during_training.hf, 'write_hf_dir', fail)
  ex = exporter(tmp_path, every=10)
  with pytest.raises(CheckpointError) as e:
    ex.on_commit(commit(20, run))
  line = e.value.line()
  assert 'exporting step 20 as hf (with safetensors: one directory) to ' in line, line
  monkeypatch.undo()
  for part in line.split('`')[1].split(' && '):
    code, _, err = call_cli(part.split()[1:], capsys)
    assert code == 0, err
  assert sorted(os.listdir(tmp_path / 'exports' / STEP_20)) == ['hf', 'model.safetensors']


# --------------------------------------------------------- 10. an --out that is a symlink
@pytest.mark.parametrize('fmt', ['safetensors', 'hf'])
def test_an_out_that_is_a_symlink_is_replaced_as_a_name_leaving_no_debris(
    run, tmp_path, capsys, fmt):
  target = tmp_path / 'target'
  target.mkdir()
  link = tmp_path / 'link'
  link.symlink_to(target)
  code, out, err = export(run / 'checkpoints' / STEP_20, fmt, link, capsys)
  assert code == 0, err
  assert sorted(os.listdir(tmp_path)) == ['link', 'target']  # no link.tmp-*
  assert link.is_dir() and not link.is_symlink() and os.listdir(link)
  assert os.listdir(target) == []  # what the link pointed to is untouched


def test_publish_dir_unlinks_a_symlink_and_never_deletes_what_it_points_to(tmp_path):
  kept = tmp_path / 'kept'
  kept.mkdir()
  (kept / 'f').write_text('mine')
  path = tmp_path / 'path'
  path.symlink_to(kept)
  new = tmp_path / 'new'
  new.mkdir()
  (new / 'g').write_text('new')
  atomic.publish_dir(new, path)
  assert sorted(os.listdir(tmp_path)) == ['kept', 'path']
  assert (path / 'g').read_text() == 'new' and (kept / 'f').read_text() == 'mine'
  dangling = tmp_path / 'dangling'
  dangling.symlink_to(tmp_path / 'nowhere')
  (tmp_path / 'new2').mkdir()
  atomic.publish_dir(tmp_path / 'new2', dangling)
  assert dangling.is_dir() and not dangling.is_symlink()
