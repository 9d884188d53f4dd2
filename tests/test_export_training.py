"""Exports during training, `jaxckpt export`, and resuming from a `.bin`, end to end.

One run of the tiny config (60 steps, a checkpoint every 10, an export every 20 in all three
formats, the newest 2 kept) is the reference: its exports are checked for cadence, retention,
layout and content, its `.bin` of step 40 is resumed from (bit-exact with the matching run state),
and its checkpoints are exported by `python -m jaxckpt.cli export`.
"""

import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from conftest import (TINY, assert_same_bytes, checkpoint_arrays, committed_steps, events_of,
                      hf_logits, jaxckpt_cli, losses, read_arrays, tiny_config)

from jaxckpt.errors import ConfigError, ResumeError
from jaxckpt.export import during_training, flatbin, safetensors_io
from jaxckpt.model import gpt as model_lib
from jaxckpt.records.runlog import read_status
from jaxckpt.train import resume

STEPS = 60
RUN_FLAGS = (f'--config.train.steps={STEPS}', '--checkpoint_every=10', '--keep=0',
             '--config.train.log_every=20')
EXPORT_FLAGS = ('--export_every=20', '--export_formats=safetensors,hf,bin', '--export_keep=2')
DEBRIS = ('step_00000099.tmp-0123456789ab', 'step_000099.bin.tmp-0123456789ab')


@pytest.fixture(scope='module')
def exported_run(trainer, tmp_path_factory) -> Path:
  """The workdir of the reference run, started over export debris left by a 'crash'."""
  workdir = tmp_path_factory.mktemp('run')
  exports = workdir / 'exports'
  (exports / DEBRIS[0]).mkdir(parents=True)
  (exports / DEBRIS[0] / 'model.safetensors').write_bytes(b'half')
  (exports / DEBRIS[1]).write_bytes(b'half')
  r = trainer.train(workdir, *RUN_FLAGS, *EXPORT_FLAGS)
  assert r.returncode == 0, r.stderr
  return workdir


@pytest.fixture(scope='module')
def model_cfg():
  return tiny_config().model


def params_of(arrays: dict, kind: str) -> dict:
  """{dotted name: array} of 'params', 'mu' or 'nu', found in orbax keys by this test itself."""
  out = {}
  for key, x in arrays.items():
    parts = key.split('/')
    if kind == 'params' and parts[0] == 'params':
      out['.'.join(parts[1:])] = x
    elif parts[0] == 'opt_state' and kind in parts:
      out['.'.join(parts[parts.index(kind) + 1:])] = x
  return out


# ------------------------------------------------------------------------------ cadence
def test_export_due_multiples_the_last_step_and_the_first_checkpoint_past_a_multiple():
  due = lambda steps, every, last=10_000: [
      s for prev, s in zip([None, *steps], steps)
      if during_training.export_due(s, prev, every, last)
  ]
  assert due(range(100, 3001, 100), 1000) == [1000, 2000, 3000]
  assert due([300, 600, 900, 1200, 1500, 2100], 1000) == [1200, 2100]  # misaligned: first past
  assert due([130, 270, 420], 1000, last=420) == [420]  # the last step always
  assert due([1000], 1000) == [1000] and due([1100], 1000) == []  # first commit: multiples only
  assert due(range(100, 3001, 100), 0, last=3000) == []  # 0 turns exports off


def test_export_options_are_validated_with_the_field_named():
  import ml_collections
  base = {'every': 10, 'formats': 'hf,bin', 'keep': 2, 'optimizer': False}
  ok = during_training.options_from_config(ml_collections.ConfigDict({'export': base}))
  assert ok.formats == ('hf', 'bin')
  for bad, field in (({'formats': 'hf,onnx'}, 'onnx'), ({'every': -1}, 'export.every'),
                     ({'keep': -2}, 'export.keep'), ({'formats': ''}, 'export.formats')):
    with pytest.raises(ConfigError, match=f'E-CONFIG-009.*{field}'):
      during_training.options_from_config(ml_collections.ConfigDict({'export': {**base, **bad}}))


# ------------------------------------------------------------------------ during training
def test_exports_follow_their_cadence_and_retention(exported_run, model_cfg):
  exports = exported_run / 'exports'
  done = events_of(exported_run, 'export')
  assert [e['step'] for e in done] == [20, 40, 60]
  assert [e['deleted'] for e in done] == [[], [], [20]]
  assert all(e['formats'] == ['safetensors', 'hf', 'bin'] and e['bytes'] > 0 and e['seconds'] >= 0
             for e in done)
  assert sorted(os.listdir(exports)) == [
      'step_00000040', 'step_00000060', 'step_000040.bin', 'step_000060.bin'
  ]  # debris gone, step 20 retired
  cleaned = [e for e in events_of(exported_run, 'cleaned') if e.get('what') == 'exports']
  assert sorted(Path(p).name for p in cleaned[0]['paths']) == sorted(DEBRIS)
  for step in (40, 60):
    d = exports / f'step_{step:08d}'
    assert sorted(os.listdir(d)) == ['hf', 'model.safetensors']  # optimizer is opt-in
    assert sorted(os.listdir(d / 'hf')) == ['config.json', 'model.safetensors']
  assert read_status(exported_run)['last_export'] == 60

  # The .bin: exactly 8 + 12n bytes, header (step, n), and the checkpoint's weights, m and v.
  n = sum(int(np.prod(s)) for s in model_lib.param_shapes(model_cfg).values())
  raw = (exports / 'step_000060.bin').read_bytes()
  assert len(raw) == 8 + 12 * n and struct.unpack('<ii', raw[:8]) == (60, n)
  weights, m, v = np.frombuffer(raw, '<f4', offset=8).reshape(3, n)
  arrays = read_arrays(exported_run / 'checkpoints' / 'step_00000060')
  for section, kind in ((weights, 'params'), (m, 'mu'), (v, 'nu')):
    by_name = params_of(arrays, kind)
    for name, offset, count in flatbin.offsets(model_lib.param_shapes(model_cfg)):
      np.testing.assert_array_equal(
          section[offset:offset + count], by_name[name].reshape(-1), err_msg=f'{kind} {name}')
  flat, meta = safetensors_io.read_model(exports / 'step_00000060' / 'model.safetensors')
  assert meta['step'] == '60'
  assert all(np.array_equal(flat[k], x) for k, x in params_of(arrays, 'params').items())


def test_a_failing_export_stops_the_run_with_one_clear_line(trainer, tmp_path):
  (tmp_path / 'exports').write_text('not a directory')  # every export fails to create its dir
  r = trainer.train(tmp_path, *RUN_FLAGS, '--export_every=10')
  assert r.returncode == 1, r.stderr
  assert 'Traceback' not in r.stderr
  # A failed export is a failed save: heard at once, retried at the next checkpoint, and the
  # retry failing too stops the run, naming both the export's error and the last good step.
  (line,) = [l for l in r.stderr.splitlines() if l.startswith('jaxckpt:')]
  assert line.startswith('jaxckpt: E-CKPT-001: checkpoint step 20 failed, the retry of a failed '
                         'one: E-EXPORT-006: exporting step 20 as safetensors'), line
  assert 'the last good checkpoint is step 20 (' in line
  assert 'checkpoint step 20 is committed and intact' in line
  assert {10, 20} <= set(committed_steps(tmp_path))
  assert [e['step'] for e in events_of(tmp_path, 'export_failed')] == [10, 20]
  assert [e['step'] for e in events_of(tmp_path, 'save_failed')] == [10, 20]
  assert read_status(tmp_path)['state'] == 'failed'


# --------------------------------------------------------------------------- resume from .bin
def test_resume_from_a_bin_with_its_run_state_is_bit_exact(trainer, exported_run, tmp_path):
  bin_path = exported_run / 'exports' / 'step_000040.bin'
  r = trainer.train(tmp_path, *RUN_FLAGS, f'--resume={bin_path}', '--export_every=0')
  assert r.returncode == 0, r.stderr
  (event,) = events_of(tmp_path, 'resumed_from_bin')
  assert event['step'] == 40 and event['counts_set'] >= 1
  assert event['run_state'] == str(exported_run / 'checkpoints' / 'step_00000040' /
                                   'run_state.json')
  assert set(event['not_in_bin']) >= {'rng_key', 'data_position', 'bandit_state'}
  assert 'bit-exact' in event['message'] and 'recomputed' in event['message']
  assert_same_bytes(checkpoint_arrays(tmp_path, STEPS), checkpoint_arrays(exported_run, STEPS))
  straight, resumed = losses(exported_run), losses(tmp_path)
  assert sorted(resumed) == list(range(41, STEPS + 1))
  assert all(resumed[s] == straight[s] for s in resumed)


def test_resume_from_a_lone_bin_says_what_it_recomputed(trainer, exported_run, tmp_path):
  lone = tmp_path / 'elsewhere' / 'step_000040.bin'
  lone.parent.mkdir()
  shutil.copy(exported_run / 'exports' / 'step_000040.bin', lone)
  workdir = tmp_path / 'run'
  r = trainer.train(workdir, *RUN_FLAGS, f'--resume={lone}', '--export_every=0')
  assert r.returncode == 0, r.stderr
  (event,) = events_of(workdir, 'resumed_from_bin')
  assert event['run_state'] is None and 'run_counters' in event['recomputed']
  assert 'starts fresh' in event['message']
  assert 'A .bin does not carry the RNG key' in r.stderr
  assert committed_steps(workdir)[-1] == STEPS
  assert read_status(workdir)['state'] == 'finished'


def test_a_bin_of_the_wrong_size_is_refused_with_both_sizes(trainer, exported_run, tmp_path):
  raw = (exported_run / 'exports' / 'step_000040.bin').read_bytes()
  bad = tmp_path / 'step_000040.bin'
  bad.write_bytes(raw[:-4])
  r = trainer.train(tmp_path / 'run', *RUN_FLAGS, f'--resume={bad}')
  assert r.returncode == 2, r.stderr
  assert 'Traceback' not in r.stderr
  (line,) = [l for l in r.stderr.splitlines() if l.startswith('jaxckpt:')]
  assert line.startswith('jaxckpt: E-BIN-001: ')
  assert f'{len(raw) - 4:,} bytes' in line and f'{len(raw):,} bytes' in line
  assert not committed_steps(tmp_path / 'run')


def test_a_missing_bin_is_refused_before_anything_starts(tmp_path):
  with pytest.raises(ResumeError, match='E-BIN-003'):
    resume.find_resume_point(str(tmp_path / 'step_000040.bin'), tmp_path / 'checkpoints')


# ------------------------------------------------------------------------- jaxckpt export
def test_export_command_from_a_checkpoint_and_from_a_bin(compile_cache, exported_run, model_cfg,
                                                         tmp_path):
  ckpt = exported_run / 'checkpoints' / 'step_00000060'
  outs = {'safetensors': tmp_path / 'st', 'hf': tmp_path / 'hf', 'bin': tmp_path / 'x.bin'}
  for fmt, out in outs.items():
    r = jaxckpt_cli(
        'export',
        str(ckpt),
        f'--format={fmt}',
        f'--out={out}',
        *(['--optimizer'] if fmt == 'safetensors' else []),
        cache=compile_cache)
    assert r.returncode == 0, r.stderr
  assert sorted(os.listdir(outs['safetensors'])) == ['model.safetensors', 'optimizer.safetensors']
  assert outs['bin'].read_bytes() == (exported_run / 'exports' / 'step_000060.bin').read_bytes()

  r = jaxckpt_cli(
      'export',
      str(outs['bin']),
      '--format=hf',
      f'--config={TINY}',
      f'--out={tmp_path / "from_bin"}',
      cache=compile_cache)
  assert r.returncode == 0, r.stderr
  tokens = np.random.default_rng(0).integers(0, 256, size=(2, model_cfg.block_size))
  reference = hf_logits(outs['hf'], tokens)
  for other in (tmp_path / 'from_bin', exported_run / 'exports' / 'step_00000060' / 'hf'):
    np.testing.assert_array_equal(hf_logits(other, tokens), reference)


def test_export_command_usage_errors_are_one_line(exported_run, capsys):
  from jaxckpt import cli as cli_lib
  bin_path = str(exported_run / 'exports' / 'step_000060.bin')
  for argv, code in (([bin_path, '--format=hf',
                       '--out=x'], 'E-USAGE-003'), ([bin_path], 'E-USAGE-001'),
                     ([bin_path, '--format=onnx', '--out=x', f'--config={TINY}'], 'E-EXPORT-001')):
    with pytest.raises(SystemExit) as e:
      cli_lib.main(['export', *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f'jaxckpt: {code}: '), err
