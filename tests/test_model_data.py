"""The model's layout and numerics, the sharded trainer, and the data pipeline."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import andrea_12m, andrea_120m, tiny
from jaxckpt.errors import ConfigError
from jaxckpt.model import data, sharding
from jaxckpt.model import gpt as model
from jaxckpt.train import state as trainer_lib


def test_parameter_counts_of_the_named_configs():
  assert model.count_params(andrea_12m.get_config().model) == 12_812_800
  assert model.count_params(andrea_120m.get_config().model) == 121_316_064


@pytest.mark.parametrize('tied', [False, True])
def test_canonical_names_cover_the_parameter_tree(tied):
  cfg = tiny.get_config().model
  cfg.tie_embeddings = tied
  params = nn.unbox(model.from_config(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  flat = model.flatten_params(params['params'], cfg)
  assert list(flat) == model.parameter_names(cfg)
  assert flat['h.1.attn.c_attn.kernel'].shape == (cfg.n_embd, 3 * cfg.n_embd)
  assert ('lm_head.kernel' in flat) != tied
  assert model.param_count_of(flat) == model.count_params(cfg)
  back = model.unflatten_params(flat, params['params'])
  assert jax.tree.all(jax.tree.map(lambda a, b: (a == b).all(), back, params['params']))


def test_logits_are_causal():
  cfg = tiny.get_config().model
  gpt = model.from_config(cfg)
  params = nn.unbox(gpt.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  a = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8]])
  b = a.at[0, 6:].set(99)
  la, lb = gpt.apply(params, a), gpt.apply(params, b)
  np.testing.assert_array_equal(la[0, :6], lb[0, :6])
  assert not np.allclose(la[0, 6:], lb[0, 6:])


def test_sharded_step_matches_one_device():
  cfg = tiny.get_config()
  losses = {}
  for name, mesh, devices in [('one', (1, 1), jax.devices()[:1]), ('eight', (4, 2), None)]:
    with cfg.unlocked():
      cfg.mesh.data, cfg.mesh.model = mesh
    t = trainer_lib.build_trainer(cfg, devices)
    state = t.init_fn(jax.random.key(0))
    batch = data.from_config(cfg).batch(0)
    for _ in range(3):
      state, metrics = t.train_step(state, t.put_batch(batch))
    losses[name] = float(metrics['loss'])
    if name == 'eight':
      kernel = state.params['h']['0']['mlp']['c_fc']['kernel']
      assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, 'model')
  assert losses['one'] == pytest.approx(losses['eight'], rel=1e-5)


def test_mesh_shapes():
  mesh = sharding.make_mesh(ml_collections.ConfigDict({'data': -1, 'model': 2}))
  assert dict(mesh.shape) == {'data': 4, 'model': 2}
  with pytest.raises(ConfigError, match='E-CONFIG-002'):
    sharding.make_mesh(ml_collections.ConfigDict({'data': 3, 'model': 3}))


def test_batches_are_a_pure_function_of_seed_and_step():
  cfg = tiny.get_config()
  ds = data.from_config(cfg)
  x, y = ds.batch(7)
  assert x.shape == y.shape == (cfg.train.batch_size, cfg.model.block_size)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  np.testing.assert_array_equal(ds.batch(7)[0], data.from_config(cfg).batch(7)[0])
  assert not np.array_equal(ds.batch(8)[0], x)


def test_heldout_split_is_the_tail_and_disjoint():
  cfg = tiny.get_config()
  ds = data.from_config(cfg)
  corpus = data.embedded_corpus()
  (main,) = ds.sources
  assert len(main.train) + len(main.heldout) == len(corpus)
  assert bytes(np.asarray(main.heldout).astype(np.uint8)) == corpus[len(main.train):]
  assert len(ds.heldout_batches(2)) == 2


def test_user_text_and_pretokenized_bin(tmp_path):
  text = tmp_path / 'a.txt'
  text.write_bytes(bytes(range(256)) * 20)
  tokens = tmp_path / 'b.bin'
  np.arange(5000, dtype='<u2').tofile(tokens)
  assert list(data.load_tokens([str(text)])[:3]) == [0, 1, 2]
  assert data.load_tokens([str(tokens)]).max() == 4999
  cfg = tiny.get_config()
  with cfg.unlocked():
    cfg.data.sources.main = (str(tokens),)
  with pytest.raises(ConfigError, match='E-DATA-002.*vocab_size'):
    data.from_config(cfg)
