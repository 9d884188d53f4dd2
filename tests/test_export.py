"""Exports: flat safetensors, the Hugging Face GPT-2 directory and the raw `.bin`.

Each format is checked by a reader that is not jaxckpt's: torch/transformers for safetensors and
HF, a few lines of numpy written here for the `.bin`.
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import REPO, hf_logits, read_arrays

from jaxckpt.errors import CheckpointError, ResumeError, UsageError
from jaxckpt.export import flatbin, hf, offline, safetensors_io
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names

TINY_MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, dtype='float32')


def model_config(tied: bool) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({**TINY_MODEL, 'tie_embeddings': tied})


def jax_logits(cfg, flat: dict, tokens: np.ndarray) -> np.ndarray:
  """The JAX model's logits for `tokens` with the parameters `flat` ({dotted name: array})."""
  model = model_lib.from_config(cfg)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.asarray(tokens)))['params']
  params = model_lib.unflatten_params({k: jnp.asarray(v) for k, v in flat.items()}, nn.unbox(boxed))
  return np.asarray(model.apply({'params': params}, jnp.asarray(tokens)))  # (B, T, V)


@pytest.fixture(scope='module')
def models():
  """{tied: (cfg, flat params, tokens, JAX logits)}, each model built once for the module.

  Every parameter is perturbed away from its init (LayerNorms at 1/0, zero biases) so that a
  misplaced bias or scale would show in the logits.
  """
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(2, 32), dtype=np.int32)  # (B, T)
  out = {}
  for tied in (False, True):
    cfg = model_config(tied)
    variables = model_lib.from_config(cfg).init(jax.random.key(1), jnp.asarray(tokens))
    flat = model_lib.flatten_params(nn.unbox(variables['params']), cfg)
    flat = {
        k: (np.asarray(v) + rng.normal(0, 0.05, v.shape)).astype(np.float32)
        for k, v in flat.items()
    }
    out[tied] = (cfg, flat, tokens, jax_logits(cfg, flat, tokens))
  return out


def adam_like(params: dict, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}


# ----------------------------------------------------------------------------- Hugging Face
@pytest.mark.parametrize('tied', [False, True], ids=['untied', 'tied'])
def test_hf_from_pretrained_gives_the_jax_logits(models, tmp_path, tied):
  cfg, params, tokens, logits = models[tied]
  hf.write_hf_dir(tmp_path / 'hf', params, cfg)

  assert np.abs(hf_logits(tmp_path / 'hf', tokens) - logits).max() <= 1e-4
  config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert config['tie_word_embeddings'] is tied
  assert (config['n_positions'], config['n_embd'], config['vocab_size']) == (32, 32, 256)
  assert 0 <= config['bos_token_id'] < 256 and 0 <= config['eos_token_id'] < 256
  names = safetensors.torch.load_file(tmp_path / 'hf' / 'model.safetensors')
  assert ('lm_head.weight' in names) is not tied
  assert sorted(os.listdir(tmp_path)) == ['hf']  # no temporary left beside it


def test_hf_dir_replaces_an_existing_export(models, tmp_path):
  cfg, params, tokens, logits = models[False]
  hf.write_hf_dir(tmp_path / 'hf', {k: v * 0 for k, v in params.items()}, cfg)
  hf.write_hf_dir(tmp_path / 'hf', params, cfg)
  assert np.abs(hf_logits(tmp_path / 'hf', tokens) - logits).max() <= 1e-4
  assert sorted(os.listdir(tmp_path)) == ['hf']


def test_hf_refuses_params_of_another_config(models, tmp_path):
  cfg, params, *_ = models[False]
  with pytest.raises(UsageError, match='E-EXPORT-002'):
    hf.write_hf_dir(tmp_path / 'hf', params, model_config(tied=True))
  wrong = {**params, 'wpe.embedding': params['wpe.embedding'][:16]}
  with pytest.raises(UsageError, match='E-EXPORT-002.*wpe.embedding'):
    hf.write_hf_dir(tmp_path / 'hf', wrong, cfg)
  assert not os.listdir(tmp_path)


# ------------------------------------------------------------------------------ safetensors
def test_flat_safetensors_load_in_torch_in_the_given_order(models, tmp_path):
  cfg, params, *_ = models[False]
  m, v = adam_like(params, 1), adam_like(params, 2)
  safetensors_io.write_model(tmp_path / 'model.safetensors', params, metadata={'step': 7})
  safetensors_io.write_optimizer(tmp_path / 'optimizer.safetensors', m, v)

  loaded = safetensors.torch.load_file(tmp_path / 'model.safetensors')
  assert sorted(loaded) == sorted(params)
  for name, x in params.items():
    assert loaded[name].dtype == torch.float32 and tuple(loaded[name].shape) == x.shape
    np.testing.assert_array_equal(loaded[name].numpy(), x)
  back, meta = safetensors_io.read_model(tmp_path / 'model.safetensors')
  assert list(back) == model_lib.parameter_names(cfg) == list(params)
  assert meta['format'] == 'pt' and meta['step'] == '7'

  opt = safetensors.torch.load_file(tmp_path / 'optimizer.safetensors')
  assert sorted(opt) == sorted([f'{n}/m' for n in params] + [f'{n}/v' for n in params])
  np.testing.assert_array_equal(opt['h.1.mlp.c_fc.kernel/v'].numpy(), v['h.1.mlp.c_fc.kernel'])
  m2, v2, _ = safetensors_io.read_optimizer(tmp_path / 'optimizer.safetensors')
  assert all(np.array_equal(m2[k], m[k]) and np.array_equal(v2[k], v[k]) for k in params)


def test_narrow_floats_are_stored_as_f32_and_round_trip(tmp_path):
  rng = np.random.default_rng(3)
  arrays = {
      'a.kernel': rng.normal(size=(3, 4)).astype(ml_dtypes.bfloat16),
      'b.bias': rng.normal(size=(5,)).astype(np.float32),
      'c.scale': rng.normal(size=(2,)).astype(np.float16), 'd.count': np.array(7, np.int32)
  }
  safetensors_io.write_model(tmp_path / 'model.safetensors', arrays)

  loaded = safetensors.torch.load_file(tmp_path / 'model.safetensors')
  assert {k: t.dtype for k, t in loaded.items()} == {
      'a.kernel': torch.float32, 'b.bias': torch.float32, 'c.scale': torch.float32,
      'd.count': torch.int32
  }
  np.testing.assert_array_equal(loaded['a.kernel'].numpy(), arrays['a.kernel'].astype(np.float32))
  back, meta = safetensors_io.read_model(tmp_path / 'model.safetensors')
  assert json.loads(
      meta[safetensors_io.DTYPES_KEY]) == {'a.kernel': 'bfloat16', 'c.scale': 'float16'}
  for name, x in arrays.items():
    assert back[name].dtype == x.dtype and back[name].tobytes() == x.tobytes(), name


# ------------------------------------------------------------------------------------ .bin
def read_bin_independently(path, shapes: dict) -> tuple[int, int, int, list[dict]]:
  """(step, header n, file size, [weights, m, v]) straight from the documented layout."""
  raw = Path(path).read_bytes()
  step, n = struct.unpack('<ii', raw[:8])
  data = np.frombuffer(raw, dtype='<f4', offset=8)
  assert data.size == 3 * n
  sections = []
  for flat in data.reshape(3, n):
    tensors, offset = {}, 0
    for name, shape in shapes.items():
      count = int(np.prod(shape))
      tensors[name] = flat[offset:offset + count].reshape(shape)
      offset += count
    assert offset == n
    sections.append(tensors)
  return step, n, len(raw), sections


def test_bin_is_8_plus_12n_bytes_in_canonical_order(models, tmp_path):
  cfg, params, *_ = models[False]
  m, v = adam_like(params, 1), adam_like(params, 2)
  path = tmp_path / flatbin.bin_name(7)
  flatbin.write_bin(path, 7, params, dict(reversed(m.items())), v)  # m's own order is ignored
  safetensors_io.write_model(tmp_path / 'model.safetensors', params)

  shapes = model_lib.param_shapes(cfg)
  assert shapes == {k: x.shape for k, x in params.items()}  # the config alone gives the shapes
  n = model_lib.count_params(cfg)
  step, header_n, size, (weights, m_read, v_read) = read_bin_independently(path, shapes)
  assert (path.name, step, header_n, size) == ('step_000007.bin', 7, n, 8 + 12 * n)
  exported, _ = safetensors_io.read_model(tmp_path / 'model.safetensors')
  for name in shapes:
    np.testing.assert_array_equal(weights[name], exported[name])
    np.testing.assert_array_equal(m_read[name], m[name])
    np.testing.assert_array_equal(v_read[name], v[name])

  step2, *state = flatbin.read_bin(path, shapes)
  assert step2 == 7
  for read, written in zip(state, (params, m, v)):
    assert list(read) == list(shapes)
    assert all(np.array_equal(read[k], written[k]) for k in shapes)
  table = flatbin.offsets(shapes)
  assert table[0] == ('wte.embedding', 0, 256 * 32)
  assert table[-1][1] + table[-1][2] == n


def test_bin_name_grows_past_six_digits():
  assert flatbin.bin_name(300) == 'step_000300.bin'
  assert flatbin.bin_name(12_345_678) == 'step_12345678.bin'


def test_read_bin_refuses_a_file_of_another_model(tmp_path):
  small = {'w': np.ones((4, 5), np.float32)}
  flatbin.write_bin(tmp_path / 'a.bin', 3, small, small, small)
  with pytest.raises(ResumeError) as e:
    flatbin.read_bin(tmp_path / 'a.bin', {'w': (4, 6)})
  assert e.value.code == 'E-BIN-001' and e.value.exit_code == 2
  assert '248 bytes' in str(e.value) and '296 bytes' in str(e.value)  # actual, expected

  # Right size, wrong header: n_params says 5 where the shapes say 20.
  raw = bytearray((tmp_path / 'a.bin').read_bytes())
  raw[4:8] = struct.pack('<i', 5)
  (tmp_path / 'b.bin').write_bytes(bytes(raw))
  with pytest.raises(ResumeError, match='E-BIN-001.*n_params=5'):
    flatbin.read_bin(tmp_path / 'b.bin', {'w': (4, 5)})


def test_write_bin_refuses_more_params_than_int32(tmp_path):
  huge = np.broadcast_to(np.float32(0), (2**31,))  # 8 GiB that is never allocated
  with pytest.raises(CheckpointError, match='E-BIN-002'):
    flatbin.write_bin(tmp_path / 'big.bin', 1, {'w': huge}, {'w': huge}, {'w': huge})
  assert not os.listdir(tmp_path)


# --------------------------------------------------------------- killed before publishing
_WRITER = """
import os, sys, time
import numpy as np
from jaxckpt.model import gpt as model_lib
from jaxckpt.export import flatbin, hf
kind, out, marker = sys.argv[1], sys.argv[2], sys.argv[3]
real_fsync = os.fsync
def fsync_then_wait(fd):  # the big file is written, not yet renamed: tell the test, and wait
  real_fsync(fd)
  if os.path.getsize(os.readlink(f'/proc/self/fd/{fd}')) > (1 << 20):
    open(marker, 'w').close()
    time.sleep(120)
os.fsync = fsync_then_wait
if kind == 'bin':  # 8 + 3 * 64 MiB
  a = np.ones(1 << 24, np.float32)
  flatbin.write_bin(out, 1, {'w': a}, {'w': a}, {'w': a})
else:  # one 2048-wide layer: ~200 MB of weights
  cfg = dict(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=2048,
             tie_embeddings=True, dtype='float32')
  shapes = model_lib.param_shapes(cfg)
  hf.write_hf_dir(out, {k: np.ones(s, np.float32) for k, s in shapes.items()}, cfg)
"""


@pytest.mark.parametrize('kind', ['bin', 'hf'])
def test_an_export_killed_before_publishing_leaves_nothing_under_its_name(tmp_path, kind):
  final = tmp_path / ('step_000001.bin' if kind == 'bin' else 'hf')
  if kind == 'hf':  # an earlier export is there and must survive intact
    final.mkdir()
    (final / 'config.json').write_text('old')

  marker = tmp_path.parent / f'{tmp_path.name}.written'  # outside the directory under test

  def writing() -> bool:  # the big temporary file is written and about to be renamed
    return marker.exists()

  proc = subprocess.Popen([sys.executable, '-c', _WRITER, kind,
                           str(final), str(marker)],
                          cwd=REPO,
                          env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  deadline = time.monotonic() + 60
  while not writing():
    assert proc.poll() is None, f'the writer exited ({proc.returncode}) before being killed'
    assert time.monotonic() < deadline, 'the writer never started writing'
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL

  leftovers = [p.name for p in tmp_path.iterdir() if p != final]
  assert leftovers and all('.tmp-' in name for name in leftovers), leftovers
  if kind == 'bin':
    assert not final.exists()
  else:
    assert os.listdir(final) == ['config.json'] and (final / 'config.json').read_text() == 'old'


# ---------------------------------------------------------------------------------- offline
def test_param_of_leaf_names_weights_and_adam_moments():
  assert names.param_of_leaf('params/h/0/attn/c_attn/kernel') == \
      ('params', 'h.0.attn.c_attn.kernel')
  assert names.param_of_leaf('opt_state/1/0/mu/wte/embedding') == ('m', 'wte.embedding')
  assert names.param_of_leaf('opt_state/1/0/nu/h/1/ln_2/bias') == ('v', 'h.1.ln_2.bias')
  assert names.param_of_leaf('opt_state/1/0/count') is None


@pytest.fixture(scope='module')
def checkpoint(trainer, tmp_path_factory) -> Path:
  """The committed step-10 checkpoint of a real `python -m jaxckpt.main` run."""
  workdir = tmp_path_factory.mktemp('run')
  r = trainer.train(workdir, '--config.train.steps=10', '--config.train.log_every=10')
  assert r.returncode == 0, r.stderr
  return workdir / 'checkpoints' / 'step_00000010'


def adam_moment(arrays: dict, which: str, name: str) -> np.ndarray:
  """Adam's `which` ('mu' or 'nu') of `name`, found in the orbax keys by this test itself."""
  suffix = f'/{which}/' + name.replace('.', '/')
  (key,) = [k for k in arrays if k.startswith('opt_state/') and k.endswith(suffix)]
  return arrays[key]


def test_offline_export_of_a_trainer_checkpoint(checkpoint, tmp_path):
  arrays = read_arrays(checkpoint)
  cfg = ml_collections.ConfigDict(
      json.loads((checkpoint / 'manifest.json').read_text())['config']['model'])
  exports = tmp_path / 'exports'
  out = {
      fmt:
          offline.export_checkpoint(
              checkpoint, fmt, offline.export_path(exports, 10, fmt), optimizer=True)
      for fmt in offline.FORMATS
  }
  assert out == {
      'safetensors': exports / 'step_00000010', 'hf': exports / 'step_00000010/hf',
      'bin': exports / 'step_000010.bin'
  }

  params, meta = safetensors_io.read_model(out['safetensors'] / 'model.safetensors')
  assert meta['step'] == '10' and list(params) == model_lib.parameter_names(cfg)
  m, v, _ = safetensors_io.read_optimizer(out['safetensors'] / 'optimizer.safetensors')
  step, n, size, (weights, m_bin, v_bin) = read_bin_independently(out['bin'],
                                                                  model_lib.param_shapes(cfg))
  assert (step, size) == (10, 8 + 12 * n)
  for name in params:
    np.testing.assert_array_equal(params[name], arrays['params/' + name.replace('.', '/')])
    np.testing.assert_array_equal(weights[name], params[name])
    for moment, from_st, from_bin in (('mu', m, m_bin), ('nu', v, v_bin)):
      np.testing.assert_array_equal(from_st[name], adam_moment(arrays, moment, name))
      np.testing.assert_array_equal(from_bin[name], from_st[name])

  tokens = np.random.default_rng(0).integers(0, 256, size=(2, cfg.block_size), dtype=np.int32)
  torch_out = hf_logits(out['hf'], tokens)
  assert np.abs(torch_out - jax_logits(cfg, params, tokens)).max() <= 1e-4

  # The .bin exports back to HF with the same weights.
  again = offline.export_bin(out['bin'], 'hf', tmp_path / 'from_bin', cfg)
  a = safetensors.torch.load_file(again / 'model.safetensors')
  b = safetensors.torch.load_file(out['hf'] / 'model.safetensors')
  assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_offline_export_refusals(checkpoint, tmp_path):
  with pytest.raises(UsageError, match='E-EXPORT-001'):
    offline.export_checkpoint(checkpoint, 'onnx', tmp_path / 'x')
  with pytest.raises(UsageError, match='E-EXPORT-003'):
    offline.export_checkpoint(checkpoint.parent, 'hf', tmp_path / 'x')
  small = {'w': np.ones(3, np.float32)}
  flatbin.write_bin(tmp_path / 'small.bin', 1, small, small, small)
  with pytest.raises(ResumeError, match='E-BIN-001'):
    offline.export_bin(tmp_path / 'small.bin', 'hf', tmp_path / 'x', model_config(False))

  damaged = tmp_path / checkpoint.name
  shutil.copytree(checkpoint, damaged)
  victim = max((p for p in (damaged / 'state').rglob('*') if p.is_file()),
               key=lambda p: p.stat().st_size)
  data = victim.read_bytes()
  victim.write_bytes(data[:-1])
  with pytest.raises(CheckpointError, match='E-EXPORT-004'):
    offline.export_checkpoint(damaged, 'hf', tmp_path / 'x')
  assert not (tmp_path / 'x').exists()
  # Same size, one bit flipped: caught by the checksum checked while the arrays are read.
  victim.write_bytes(data[:100] + bytes([data[100] ^ 4]) + data[101:])
  with pytest.raises(CheckpointError, match='E-EXPORT-004.*checksum mismatch'):
    offline.export_checkpoint(damaged, 'hf', tmp_path / 'x')
  assert not (tmp_path / 'x').exists()
