"""init_from a Hugging Face GPT-2: transformers -> jaxckpt -> transformers, sharded, on S3 and GCS.

Each source is written by transformers' own `save_pretrained` (or copied into a moto S3 server or
the GCS emulator) and read by `jaxckpt.train.init_from`; jaxckpt's exporter writes it back and
transformers reads that, so a name, a layout or a tied head read wrongly shows in the logits.
"""

import json
import re
import shutil
import struct
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_logits, tiny_config

from jaxckpt.checkpoint.remote.store import Store
from jaxckpt.errors import ConfigError, ResumeError
from jaxckpt.export import frozen, hf, weights
from jaxckpt.model import gpt as model_lib
from jaxckpt.train import init_from

TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 64), dtype=np.int32)  # (B, T)


def model_cfg(**fields):
  return tiny_config(**{f'model.{k}': v for k, v in fields.items()}).model


def abstract_params(cfg):
  model = model_lib.from_config(cfg)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.asarray(TOKENS)))['params']
  return nn.unbox(boxed)


def save_gpt2(out: Path, tied: bool, **save) -> tuple[Path, np.ndarray]:
  """(directory, logits) of a GPT2LMHeadModel with tiny.py's architecture and every weight
  perturbed off its init, saved by transformers (safetensors)."""
  from transformers import GPT2Config, GPT2LMHeadModel
  fields = hf.gpt2_config(model_cfg(tie_embeddings=tied))
  for key in ('architectures', 'model_type', 'dtype', 'torch_dtype'):
    fields.pop(key)
  torch.manual_seed(int(tied))
  model = GPT2LMHeadModel(GPT2Config(**fields)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
    logits = model(torch.from_numpy(TOKENS).long()).logits.numpy()
  model.save_pretrained(out, **save)
  return out, logits


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  root = tmp_path_factory.mktemp('hf')
  return {
      'untied': save_gpt2(root / 'untied', False),
      'tied': save_gpt2(root / 'tied', True),
      'sharded': save_gpt2(root / 'sharded', False, max_shard_size='100KB'),
  }


def round_trip(source, cfg, out: Path) -> np.ndarray:
  """Logits transformers computes from jaxckpt's export of what init_from read from `source`."""
  arrays = init_from.read(source, abstract_params(cfg), cfg)
  assert sorted(arrays) == sorted(model_lib.parameter_names(cfg))
  hf.write_hf_dir(out, arrays, cfg)
  return hf_logits(out, TOKENS)


@pytest.mark.parametrize('form, tied, model_tied', [
    ('dir', False, False),
    ('file', False, False),
    ('dir', True, True),
    ('dir', True, False),
    ('sharded dir', False, False),
    ('index file', False, False),
])
def test_transformers_to_jaxckpt_to_transformers_gives_equal_logits(saved, tmp_path, form, tied,
                                                                    model_tied):
  kind = 'sharded' if 'sharded' in form or 'index' in form else 'tied' if tied else 'untied'
  hf_dir, logits = saved[kind]
  source = {
      'dir': hf_dir, 'sharded dir': hf_dir, 'file': hf_dir / 'model.safetensors',
      'index file': hf_dir / 'model.safetensors.index.json'
  }[form]
  if 'sharded' in kind:
    assert len(list(hf_dir.glob('model-*.safetensors'))) > 1
  cfg = model_cfg(tie_embeddings=model_tied)
  # The same bytes, the same computation: exactly the logits transformers started from.
  np.testing.assert_array_equal(round_trip(source, cfg, tmp_path / 'out'), logits)
  pin = init_from.pin(str(source), cfg, fresh=True)
  assert pin['naming'] == 'hf'
  read = {p: t for f in pin['files'] for p, t in f['tensors'].items()}
  assert read['h.1.attn.c_attn.kernel'] == 'transformer.h.1.attn.c_attn.weight'
  assert read.get('lm_head.kernel') == (None if model_tied else
                                        'transformer.wte.weight' if tied else 'lm_head.weight')


def test_sources_that_do_not_fit_are_refused_naming_the_tensor(saved, tmp_path):
  hf_dir, _ = saved['untied']
  with pytest.raises(ConfigError) as e:
    init_from.pin(str(hf_dir), model_cfg(block_size=32), fresh=True)
  assert e.value.code == 'E-LOAD-003' and e.value.exit_code == 2
  assert 'transformer.wpe.weight (wpe.embedding) float32[64, 64] -> model float32[32, 64]' in \
      e.value.what
  with pytest.raises(ConfigError, match=r'E-LOAD-004: .*config.json .*n_head 2 -> model 4'):
    init_from.pin(str(hf_dir), model_cfg(n_head=4), fresh=True)
  with pytest.raises(ConfigError, match='E-LOAD-004: .*untied head'):
    init_from.pin(str(hf_dir), model_cfg(tie_embeddings=True), fresh=True)


def rewrite_header(src: Path, dst: Path, change) -> None:
  """`dst`: `src` with its safetensors header passed through `change` (a dict, edited)."""
  data = src.read_bytes()
  length = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8:8 + length])
  change(header)
  raw = json.dumps(header).encode()
  dst.write_bytes(struct.pack('<Q', len(raw)) + raw + data[8 + length:])


@pytest.mark.parametrize('lie, said', [
    (lambda h: h['transformer.wte.weight'].update(data_offsets=[0, 10**9]),
     r'transformer.wte.weight: F32\[256, 64\] is 65536 bytes, its offsets say 1000000000'),
    (lambda h: h['transformer.wte.weight'].update(shape=[256, 65]), 'its offsets say 65536'),
    (lambda h: h['transformer.wte.weight'].update(dtype='F99'), "dtype 'F99'"),
    (lambda h: h.update(extra={'dtype': 'F32', 'shape': [1], 'data_offsets': [10**9, 10**9 + 4]}),
     'bytes, its header says'),
])
def test_a_header_that_lies_is_refused_before_any_tensor_is_read(saved, tmp_path, lie, said):
  bad = tmp_path / 'model.safetensors'
  rewrite_header(saved['untied'][0] / 'model.safetensors', bad, lie)
  with pytest.raises(ConfigError) as e:
    init_from.pin(str(bad), model_cfg(), fresh=True)
  assert e.value.code == 'E-LOAD-002' and re.search(said, e.value.what), e.value.what
  huge = tmp_path / 'huge.safetensors'
  huge.write_bytes(struct.pack('<Q', 1 << 40) + b'{}')
  with pytest.raises(ConfigError, match='E-LOAD-002: .*a header of 1099511627776 bytes'):
    init_from.pin(str(huge), model_cfg(), fresh=True)


def test_an_index_naming_files_outside_its_directory_is_refused(saved, tmp_path):
  hf_dir = tmp_path / 'sharded'
  shutil.copytree(saved['sharded'][0], hf_dir)
  index = hf_dir / 'model.safetensors.index.json'
  doc = json.loads(index.read_text())
  doc['weight_map']['transformer.wte.weight'] = '../elsewhere.safetensors'
  index.write_text(json.dumps(doc))
  with pytest.raises(ConfigError, match='E-LOAD-002: .*not a file beside the index'):
    init_from.pin(str(hf_dir), model_cfg(), fresh=True)


def upload(directory: Path, url: str) -> Store:
  store = Store(url)
  for f in sorted(directory.iterdir()):
    store.write(f.name, f.read_bytes())
  return store


def flip_last_byte(store: Store, key: str) -> None:
  data = bytearray(store.read(key))
  data[-1] ^= 0x01  # one bit of the last tensor: same size, another version
  store.write(key, bytes(data))


def test_s3_source_is_pinned_by_etag_and_a_changed_object_refuses_the_resume(
    trainer, saved, s3_server, tmp_path):
  hf_dir, logits = saved['untied']
  url = s3_server.bucket('gpt2')
  store = upload(hf_dir, url)
  sharded_url = s3_server.bucket('sharded')
  upload(saved['sharded'][0], sharded_url)
  np.testing.assert_array_equal(
      round_trip(f'{sharded_url}/model.safetensors.index.json', model_cfg(), tmp_path / 'out'),
      saved['sharded'][1])

  workdir = tmp_path / 'run'
  flags = ('--checkpoint_every=2', '--keep=0', f'--config.train.init_from={url}',
           "--config.train.frozen=('wte.*', 'wpe.*')")
  r = trainer.train(workdir, '--config.train.steps=2', *flags, env=s3_server.env)
  assert r.returncode == 0, r.stderr
  step_dir = workdir / 'checkpoints' / 'step_00000002'
  manifest = json.loads((step_dir / 'manifest.json').read_text())
  [pinned] = manifest['init_from']['files']
  etag = s3_server.client().head_object(
      Bucket=url[5:].split('/')[0], Key='gpt2/model.safetensors')['ETag']
  assert pinned['path'] == f'{url}/model.safetensors' and pinned['etag'] == etag
  assert pinned['size'] == (hf_dir / 'model.safetensors').stat().st_size
  assert pinned['tensors']['wte.embedding'] == 'transformer.wte.weight'
  # The frozen embeddings are not in the checkpoint; the exporter reads them from the object.
  excluded = frozen.read_excluded(step_dir, manifest)
  from transformers import GPT2LMHeadModel
  original = GPT2LMHeadModel.from_pretrained(hf_dir).transformer.wte.weight.detach().numpy()
  np.testing.assert_array_equal(excluded['wte.embedding'], original)

  flip_last_byte(store, 'model.safetensors')
  now = s3_server.client().head_object(
      Bucket=url[5:].split('/')[0], Key='gpt2/model.safetensors')['ETag']
  assert now != etag
  r = trainer.train(workdir, '--config.train.steps=4', *flags, env=s3_server.env)
  assert r.returncode == 2, r.stderr
  line = r.stderr.strip().splitlines()[-1]
  size = pinned['size']
  assert line.startswith("jaxckpt: E-LOAD-001: a loaded parameter's file is not the one the "
                         "checkpoint's run read: "), line
  assert ('.embedding: transformer.w' in line
          and f'in {url}/model.safetensors, {size} bytes, {etag} -> {size} bytes, {now}; '
          in line), line
  with pytest.raises(ResumeError, match=f'E-LOAD-001: .* {re.escape(etag)} -> '):
    frozen.read_excluded(step_dir, manifest)


def test_gcs_source_reads_and_refuses_a_changed_object(saved, gcs_server, tmp_path):
  hf_dir, logits = saved['untied']
  url = gcs_server.bucket('gpt2')
  store = upload(hf_dir, url)
  cfg = model_cfg()
  pin = init_from.pin(url, cfg, fresh=True)
  np.testing.assert_array_equal(round_trip(pin, cfg, tmp_path / 'out'), logits)
  [pinned] = pin['files']
  # The emulator reports no generations: the object is pinned by its size and sha256 instead.
  assert pinned['generation' if 'generation' in pinned else 'sha256']
  assert weights.first_change(pin, init_from.pin(url, cfg, fresh=False)) is None
  flip_last_byte(store, 'model.safetensors')
  change = weights.first_change(pin, init_from.pin(url, cfg, fresh=False))
  assert change is not None and change.code == 'E-LOAD-001'
  assert f'in {url}/model.safetensors, {pinned["size"]} bytes' in change.what
  with pytest.raises(ResumeError, match='E-LOAD-001'):
    weights.read_pinned(pin, ['wte.embedding'])
