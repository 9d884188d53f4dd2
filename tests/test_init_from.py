"""init_from and frozen parameters: loaded from a pinned file, never updated, never checkpointed.

The init file is the `model.safetensors` export of a short tiny run. The end-to-end runs train
the tiny config from it with the embeddings frozen; a run SIGKILLed after its first checkpoint
and started again must end with the same bytes as one that never stopped, although no checkpoint
holds the frozen embeddings (each start reads them from the file again).
"""

import json
import re
import shutil
import signal
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import (assert_same_bytes, checkpoint_arrays, committed_steps, events_of, jaxckpt_cli,
                      losses, read_arrays, tiny_config, wait_for)

from jaxckpt.checkpoint.tree import named_leaves
from jaxckpt.errors import ConfigError, ResumeError
from jaxckpt.export import safetensors_io
from jaxckpt.model import gpt as model_lib
from jaxckpt.records import identity, provenance
from jaxckpt.train import config as config_lib
from jaxckpt.train import init_from
from jaxckpt.train import loop as train
from jaxckpt.train import state as trainer_lib

STEPS = 30
FROZEN = ('wte.*', 'wpe.*')
FROZEN_NAMES = ['wte.embedding', 'wpe.embedding']
FROZEN_LEAVES = ['params/wte/embedding', 'params/wpe/embedding']


def run_flags(init_file, frozen=FROZEN, steps=STEPS):
  return (f'--config.train.steps={steps}', '--checkpoint_every=10', '--keep=0',
          '--config.train.log_every=10', f'--config.train.init_from={init_file}',
          f'--config.train.frozen={frozen!r}')


def last_line(r) -> str:
  return r.stderr.strip().splitlines()[-1]


@pytest.fixture(scope='module')
def init_file(trainer, tmp_path_factory) -> Path:
  """The safetensors export of step 10 of a tiny run."""
  workdir = tmp_path_factory.mktemp('source')
  r = trainer.train(workdir, '--config.train.steps=10', '--checkpoint_every=10',
                    '--export_every=10', '--export_formats=safetensors')
  assert r.returncode == 0, r.stderr
  return workdir / 'exports' / 'step_00000010' / 'model.safetensors'


@pytest.fixture(scope='module')
def straight(trainer, init_file, tmp_path_factory) -> Path:
  """A run of STEPS steps from `init_file` with the embeddings frozen, never stopped."""
  workdir = tmp_path_factory.mktemp('straight')
  r = trainer.train(workdir, *run_flags(init_file), f'--export_every={STEPS}',
                    '--export_formats=safetensors,bin', '--export_optimizer')
  assert r.returncode == 0, r.stderr
  return workdir


@pytest.fixture(scope='module')
def pinned(trainer, init_file, tmp_path_factory) -> tuple[Path, Path]:
  """(workdir, init file) of a 10-step run from a partial copy of `init_file` (no lm_head)."""
  root = tmp_path_factory.mktemp('pinned')
  tensors, _ = safetensors_io.read_model(init_file)
  partial = root / 'partial.safetensors'
  safetensors_io.write_model(partial, {n: x for n, x in tensors.items() if n != 'lm_head.kernel'})
  r = trainer.train(root / 'run', *run_flags(partial, steps=10))
  assert r.returncode == 0, r.stderr
  assert 'not in init_from, fresh init: lm_head.kernel' in r.stderr
  return root / 'run', partial


# ----------------------------------------------------------------------------- in process
def test_loaded_values_equal_the_files_on_the_right_shardings(init_file, tmp_path):
  config = tiny_config(**{'mesh.model': 2})
  trainer = trainer_lib.build_trainer(config)
  state = trainer.init_fn(jax.random.key(config.seed))
  arrays = init_from.read(init_file, trainer.abstract_state().params, trainer.config.model)
  file_tensors, _ = safetensors_io.read_model(init_file)
  assert list(arrays) == model_lib.parameter_names(config.model)
  loaded = model_lib.flatten_params(init_from.load_params(state.params, arrays), config.model)
  shardings = model_lib.flatten_params(trainer.state_shardings.params, config.model)
  for name, x in loaded.items():
    assert np.asarray(x).tobytes() == file_tensors[name].tobytes(), name
    assert x.sharding == shardings[name], name

  # A partial file: what it lacks keeps the fresh init.
  partial = tmp_path / 'partial.safetensors'
  safetensors_io.write_model(partial,
                             {n: x for n, x in file_tensors.items() if not n.startswith('h.1.')})
  fresh = model_lib.flatten_params(state.params, config.model)
  loaded = model_lib.flatten_params(
      init_from.load_params(
          state.params,
          init_from.read(partial,
                         trainer.abstract_state().params, trainer.config.model)), config.model)
  for name, x in loaded.items():
    want = fresh[name] if name.startswith('h.1.') else file_tensors[name]
    assert np.asarray(x).tobytes() == np.asarray(want).tobytes(), name


def test_a_file_that_does_not_fit_is_refused_naming_what(init_file, tmp_path):
  trainer = trainer_lib.build_trainer(tiny_config())
  tensors, _ = safetensors_io.read_model(init_file)
  bad = tmp_path / 'bad.safetensors'
  safetensors_io.write_model(
      bad, {
          **tensors, 'wpe.embedding': tensors['wpe.embedding'][:32],
          'transformer.wte.weight': tensors['wte.embedding']
      })
  with pytest.raises(ConfigError) as e:
    init_from.read(bad, trainer.abstract_state().params, trainer.config.model)
  assert e.value.code == 'E-LOAD-003' and e.value.exit_code == 2
  assert 'train.init_from=' in e.value.what
  assert 'not parameters of the model: transformer.wte.weight' in e.value.what
  assert 'wpe.embedding float32[32, 64] -> model float32[64, 64]' in e.value.what

  garbage = tmp_path / 'garbage.safetensors'
  garbage.write_bytes(b'not a safetensors file')
  with pytest.raises(ConfigError, match='E-LOAD-002: cannot read train.init_from='):
    init_from.read(garbage, trainer.abstract_state().params, trainer.config.model)
  missing = tmp_path / 'missing.safetensors'
  with pytest.raises(ConfigError, match='E-LOAD-002: cannot read train.init_from=.*No such file'):
    init_from.pin(str(missing), trainer.config.model, fresh=True)
  # On a resume a missing file is pinned as unreadable; check_resume refuses it (E-LOAD-001).
  unreadable = init_from.pin(str(missing), trainer.config.model, fresh=False)
  assert unreadable['path'] == str(missing) and 'No such file' in unreadable['unreadable']
  assert init_from.pin('', trainer.config.model, fresh=True) is None


@pytest.mark.parametrize('frozen, message', [
    (('wte.*', 'nope.*'), "train.frozen glob(s) 'nope.*' match no parameter"),
    (('*',), 'freezes every parameter'),
    (('wte.*', 3), 'is not a tuple of globs'),
])
def test_frozen_globs_are_validated(frozen, message):
  with pytest.raises(ConfigError) as e:
    config_lib.validate_config(tiny_config(**{'train.frozen': frozen}))
  assert e.value.code == 'E-CONFIG-006' and message in e.value.what


def test_frozen_parameters_never_change_and_have_no_optimizer_state(init_file):
  config = tiny_config(**{'mesh.model': 2, 'train.frozen': FROZEN})
  trainer = trainer_lib.build_trainer(config)
  state = trainer.init_fn(jax.random.key(0))
  arrays = init_from.read(init_file, trainer.abstract_state().params, trainer.config.model)
  arrays['wpe.embedding'] = arrays['wpe.embedding'].copy()
  arrays['wpe.embedding'][0, :4] = -0.0  # p + 0.0 would be +0.0: a frozen value keeps its bytes
  state = state.replace(params=init_from.load_params(state.params, arrays))
  before = {
      n: np.asarray(x).copy()
      for n, x in model_lib.flatten_params(state.params, config.model).items()
  }
  rng = np.random.default_rng(0)
  for _ in range(2):
    tokens = rng.integers(0, 256, (16, 65), dtype=np.int32)
    state, _ = trainer.train_step(state, trainer.put_batch((tokens[:, :-1], tokens[:, 1:])))
  after = model_lib.flatten_params(state.params, config.model)
  for name in FROZEN_NAMES:
    assert np.asarray(after[name]).tobytes() == before[name].tobytes(), name
  assert not np.array_equal(
      np.asarray(after['h.0.attn.c_attn.kernel']), before['h.0.attn.c_attn.kernel'])
  moments = [
      n for n in named_leaves(state.opt_state)
      if n.split('/')[-2:] in (['wte', 'embedding'], ['wpe', 'embedding'])
  ]
  assert not moments, moments  # no Adam m and v for frozen parameters


def test_freezing_on_resume_is_param_003_not_opt_001():
  """A frozen run's optimizer state differs from an unfrozen one's; trainable is checked first."""
  plain = train.run_identity(trainer_lib.build_trainer(tiny_config()))
  frozen = train.run_identity(trainer_lib.build_trainer(tiny_config(**{'train.frozen': FROZEN})))
  assert plain['optimizer'] != frozen['optimizer']
  assert 'wte.embedding' not in frozen['optimizer']
  assert {r['path'] for r in frozen['parameters'] if not r['trainable']} == set(FROZEN_NAMES)
  for saved, new, said in ((plain, frozen, 'trainable in the checkpoint, frozen now'),
                           (frozen, plain, 'frozen in the checkpoint, trainable now')):
    with pytest.raises(ResumeError) as e:
      identity.compare(saved, new)
    assert e.value.code == 'E-PARAM-003' and said in e.value.what


# ------------------------------------------------------------------------ end to end
def test_the_file_is_pinned_and_frozen_file_params_are_not_checkpointed(straight, init_file):
  step_dir = straight / 'checkpoints' / f'step_{STEPS:08d}'
  manifest = json.loads((step_dir / 'manifest.json').read_text())
  pin = provenance.pin_file(init_file)
  path = str(init_file.absolute())
  assert manifest['init_from'] == {
      'path':
          path, 'naming':
              'jaxckpt', 'files': [{
                  **pin, 'path': path,
                  'tensors': {n: n for n in model_lib.parameter_names(tiny_config().model)}
              }]
  }
  assert manifest['knobs']['train.frozen']['value'] == list(FROZEN)
  names = [t['name'] for t in manifest['tensors']]
  assert not [n for n in names if 'wte/embedding' in n or 'wpe/embedding' in n]
  assert sorted(t['name'] for t in manifest['excluded']) == sorted(FROZEN_LEAVES)
  arrays = read_arrays(step_dir)
  assert sorted(arrays) == sorted(names)
  assert 'params/h/0/attn/c_attn/kernel' in arrays
  trainable = {r['path']: r['trainable'] for r in manifest['parameters']}
  assert [n for n, t in trainable.items() if not t] == FROZEN_NAMES
  started = events_of(straight, 'init_from')
  assert len(started) == 1 and started[0]['fresh_init'] == []
  assert started[0]['not_checkpointed'] == FROZEN_NAMES


def test_frozen_values_are_unchanged_after_training(straight, init_file):
  exported, _ = safetensors_io.read_model(straight / 'exports' / f'step_{STEPS:08d}' /
                                          'model.safetensors')
  source, _ = safetensors_io.read_model(init_file)
  assert sorted(exported) == sorted(source)
  for name in source:
    same = exported[name].tobytes() == source[name].tobytes()
    assert same == (name in FROZEN_NAMES), name
  m, v, _ = safetensors_io.read_optimizer(straight / 'exports' / f'step_{STEPS:08d}' /
                                          'optimizer.safetensors')
  assert not m['wte.embedding'].any() and not v['wpe.embedding'].any()  # no moments: zeros
  assert m['h.0.attn.c_attn.kernel'].any()
  assert (straight / 'exports' / f'step_{STEPS:06d}.bin').is_file()


def test_killed_run_resumes_bit_exactly_reading_the_file_again(trainer, straight, init_file,
                                                               tmp_path):
  proc = trainer.start(tmp_path, *run_flags(init_file))
  wait_for(lambda: 10 in committed_steps(tmp_path), proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  survived = committed_steps(tmp_path)
  assert max(survived) < STEPS, 'the run finished before it could be killed'

  again = trainer.train(tmp_path, *run_flags(init_file))
  assert again.returncode == 0, again.stderr
  assert 'read 2 frozen parameter(s) the checkpoint does not hold from init_from' in again.stderr

  assert_same_bytes(checkpoint_arrays(tmp_path, STEPS), checkpoint_arrays(straight, STEPS))
  assert losses(tmp_path) == losses(straight)
  reads = [e for e in events_of(tmp_path, 'init_from') if 'read' in e]
  assert [(e['step'], e['read']) for e in reads] == [(max(survived), FROZEN_NAMES)]


def test_changing_frozen_on_resume_is_refused(trainer, pinned):
  workdir, partial = pinned
  for frozen, said in ((('wte.*',), 'frozen in the checkpoint, trainable now: wpe.embedding'),
                       (FROZEN + ('ln_f.*',), 'trainable in the checkpoint, frozen now: ln_f')):
    r = trainer.train(workdir, *run_flags(partial, frozen=frozen, steps=20))
    assert r.returncode == 2, r.stderr
    assert last_line(r).startswith('jaxckpt: E-PARAM-003: ') and said in last_line(r)


def test_a_changed_init_from_file_is_refused_before_loading(trainer, pinned, tmp_path):
  workdir, partial = pinned
  original = partial.read_bytes()
  kept = tmp_path / 'kept.safetensors'
  shutil.copyfile(partial, kept)
  data = bytearray(original)
  data[-1] ^= 0x01  # one bit of a tensor: same size, another sha256
  partial.write_bytes(bytes(data))
  r = trainer.train(workdir, *run_flags(partial, steps=10))
  assert r.returncode == 2, r.stderr
  line = last_line(r)
  # Named by a frozen parameter: the one a resume could not take from the checkpoint.
  assert re.match(
      r"jaxckpt: E-LOAD-001: a loaded parameter's file is not the one the "
      r"checkpoint's run read: (wte|wpe)\.embedding in ", line), line
  old, new = provenance.sha256_file(kept), provenance.sha256_file(partial)
  assert (f'{partial}, {len(original)} bytes, sha256:{old} -> {len(original)} bytes, '
          f'sha256:{new}; restore that file') in line

  partial.unlink()
  r = trainer.train(workdir, *run_flags(partial, steps=10))
  assert r.returncode == 2, r.stderr
  assert last_line(r).startswith('jaxckpt: E-LOAD-001: ') and 'cannot be read' in last_line(r)

  shutil.copyfile(kept, partial)  # the pinned bytes are back: the run continues
  r = trainer.train(workdir, *run_flags(partial, steps=20))
  assert r.returncode == 0, r.stderr
  assert committed_steps(workdir)[-1] == 20


def test_export_and_evaluate_read_frozen_parameters_from_the_pinned_file(
    trainer, straight, tmp_path, init_file):
  """Checkpoints leave file-backed frozen parameters out; the offline tools read them back."""
  workdir = shutil.copytree(straight, tmp_path / 'run')  # evaluate writes to the workdir
  ckpt = workdir / 'checkpoints' / 'step_00000010'
  out = tmp_path / 'model.bin'
  export = jaxckpt_cli('export', str(ckpt), '--format=bin', f'--out={out}', timeout=None)
  assert export.returncode == 0, export.stderr
  from jaxckpt.export import flatbin
  _, params, m, _ = flatbin.read_bin(out, model_lib.param_shapes(tiny_config().model))
  expected, _ = safetensors_io.read_model(init_file)
  np.testing.assert_array_equal(params['wte.embedding'], expected['wte.embedding'])
  assert not m['wte.embedding'].any()  # frozen: no moments, exported as zeros
  evaluate = jaxckpt_cli('evaluate', f'--workdir={workdir}', timeout=None)
  assert evaluate.returncode == 0, evaluate.stderr
  assert '10' in json.loads((workdir / 'evaluated.json').read_text())
  # Step 10's bin continued to STEPS as `straight` was: the train step it compiled is reused.
  resumed = trainer.train(tmp_path / 'from_bin', *run_flags(init_file), f'--resume={out}')
  assert resumed.returncode == 0, resumed.stderr  # frozen parameters have no moments to restore
