"""A GPT-2 language model in Flax, laid out so its weights map 1:1 onto GPT-2's.

The architecture is exactly GPT-2's: learned position embeddings, pre-LayerNorm blocks with a
fused q/k/v projection, tanh-approximated GELU, a final LayerNorm, biases everywhere except the
output head, LayerNorm eps 1e-5. Kernels are stored (in, out) like GPT-2's `Conv1D` weights, and
the untied head is stored (vocab, embed) like `lm_head.weight`, so an export needs no transposes.

Every parameter carries logical axis names (`embed`, `vocab`, `qkv`, `heads`, `mlp`, ...);
`jaxckpt.model.sharding` maps them onto the mesh.

Canonical parameter order (used by the flat `.bin` export and `jaxckpt inspect`):
    wte.embedding, wpe.embedding,
    for each layer i: h.i.ln_1.{scale,bias}, h.i.attn.c_attn.{kernel,bias},
                      h.i.attn.c_proj.{kernel,bias}, h.i.ln_2.{scale,bias},
                      h.i.mlp.c_fc.{kernel,bias}, h.i.mlp.c_proj.{kernel,bias},
    ln_f.{scale,bias}, lm_head.kernel (absent when the head is tied to wte).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxckpt.model import names

LAYER_NORM_EPS = 1e-5


def _init(std: float, axes: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(stddev=std), axes)


def _zeros(axes):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes):
  return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def _layer_norm(dtype, name):
  return nn.LayerNorm(
      epsilon=LAYER_NORM_EPS,
      dtype=dtype,
      name=name,
      scale_init=_ones(('norm',)),
      bias_init=_zeros(('norm',)))


def _dense(features, axes, std, dtype, name):
  return nn.Dense(
      features, dtype=dtype, name=name, kernel_init=_init(std, axes), bias_init=_zeros(axes[1:]))


class CausalSelfAttention(nn.Module):
  n_head: int
  n_layer: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    B, T, C = x.shape
    head_dim = C // self.n_head
    qkv = _dense(3 * C, ('embed', 'qkv'), 0.02, self.dtype, 'c_attn')(x)  # (B, T, 3C)
    q, k, v = jnp.split(qkv, 3, axis=-1)  # each (B, T, C)
    q, k, v = (t.reshape(B, T, self.n_head, head_dim) for t in (q, k, v))  # (B, T, H, D)
    att = jnp.einsum('bqhd,bkhd->bhqk', q, k).astype(jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    att = jnp.where(causal, att, jnp.finfo(jnp.float32).min)
    att = jax.nn.softmax(att, axis=-1).astype(self.dtype)  # (B, H, T, T)
    y = jnp.einsum('bhqk,bkhd->bqhd', att, v).reshape(B, T, C)
    # GPT-2 scales the init of residual projections by 1/sqrt(2 * n_layer).
    proj_std = 0.02 / math.sqrt(2 * self.n_layer)
    return _dense(C, ('heads', 'embed'), proj_std, self.dtype, 'c_proj')(y)


class MLP(nn.Module):
  n_layer: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    C = x.shape[-1]
    h = _dense(4 * C, ('embed', 'mlp'), 0.02, self.dtype, 'c_fc')(x)  # (B, T, 4C)
    h = nn.gelu(h, approximate=True)
    proj_std = 0.02 / math.sqrt(2 * self.n_layer)
    return _dense(C, ('mlp', 'embed'), proj_std, self.dtype, 'c_proj')(h)


class Block(nn.Module):
  n_head: int
  n_layer: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = x + CausalSelfAttention(
        self.n_head, self.n_layer, self.dtype, name='attn')(
            _layer_norm(self.dtype, 'ln_1')(x))
    x = x + MLP(self.n_layer, self.dtype, name='mlp')(_layer_norm(self.dtype, 'ln_2')(x))
    return x


class Blocks(nn.Module):
  """The stack of layers; a module of its own so parameters read `h.<i>.attn...`."""
  n_layer: int
  n_head: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    for i in range(self.n_layer):
      x = Block(self.n_head, self.n_layer, self.dtype, name=str(i))(x)
    return x


class Head(nn.Module):
  """The untied output head, stored (vocab, embed) like GPT-2's `lm_head.weight`."""
  vocab_size: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    kernel = self.param('kernel', _init(0.02, ('vocab', 'embed')), (self.vocab_size, x.shape[-1]),
                        jnp.float32)
    return jnp.einsum('btc,vc->btv', x, kernel.astype(self.dtype))  # (B, T, V)


class GPT(nn.Module):
  """GPT-2. `tokens` (B, T) int32 -> logits (B, T, vocab) float32."""
  vocab_size: int
  block_size: int
  n_layer: int
  n_head: int
  n_embd: int
  tie_embeddings: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    B, T = tokens.shape
    wte = nn.Embed(
        self.vocab_size, self.n_embd, name='wte', embedding_init=_init(0.02, ('vocab', 'embed')))
    wpe = nn.Embed(
        self.block_size, self.n_embd, name='wpe', embedding_init=_init(0.01, ('pos', 'embed')))
    x = wte(tokens) + wpe(jnp.arange(T)[None, :])  # (B, T, C)
    x = x.astype(self.dtype)
    x = Blocks(self.n_layer, self.n_head, self.dtype, name='h')(x)
    x = _layer_norm(self.dtype, 'ln_f')(x)
    if self.tie_embeddings:
      logits = wte.attend(x)  # (B, T, V)
    else:
      logits = Head(self.vocab_size, self.dtype, name='lm_head')(x)
    return logits.astype(jnp.float32)


def from_config(model_cfg) -> GPT:
  return GPT(
      vocab_size=model_cfg.vocab_size,
      block_size=model_cfg.block_size,
      n_layer=model_cfg.n_layer,
      n_head=model_cfg.n_head,
      n_embd=model_cfg.n_embd,
      tie_embeddings=model_cfg.tie_embeddings,
      dtype=jnp.dtype(model_cfg.dtype))


_LAYER_PARAMS = ('ln_1.scale', 'ln_1.bias', 'attn.c_attn.kernel', 'attn.c_attn.bias',
                 'attn.c_proj.kernel', 'attn.c_proj.bias', 'ln_2.scale', 'ln_2.bias',
                 'mlp.c_fc.kernel', 'mlp.c_fc.bias', 'mlp.c_proj.kernel', 'mlp.c_proj.bias')


def parameter_names(model_cfg) -> list[str]:
  """The canonical order of the model's parameters, as dotted names."""
  order = ['wte.embedding', 'wpe.embedding']
  for i in range(model_cfg.n_layer):
    order += [f'h.{i}.{p}' for p in _LAYER_PARAMS]
  order += ['ln_f.scale', 'ln_f.bias']
  if not model_cfg.tie_embeddings:
    order.append('lm_head.kernel')
  return order


def map_named(fn, params) -> Any:
  """`fn(dotted name, leaf)` over a params tree, boxed (`nn.LogicallyPartitioned`) or not."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: fn(names.dotted(path), x),
      params,
      is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def flatten_params(params: Mapping, model_cfg) -> dict[str, Any]:
  """`{dotted name: array}` in canonical order."""
  flat = {names.dotted(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  order = parameter_names(model_cfg)
  if sorted(flat) != sorted(order):
    raise ValueError(f'parameter tree does not match the config: {sorted(set(flat) ^ set(order))}')
  return {name: flat[name] for name in order}


def unflatten_params(flat: Mapping[str, Any], params_like: Mapping) -> Any:
  """Inverse of `flatten_params`: arrays by dotted name into the structure of `params_like`."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(params_like)
  return jax.tree_util.tree_unflatten(treedef, [flat[names.dotted(p)] for p, _ in paths])


def count_params(model_cfg) -> int:
  C, V, T, L = model_cfg.n_embd, model_cfg.vocab_size, model_cfg.block_size, model_cfg.n_layer
  per_layer = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C +
                                                                                         C)
  head = 0 if model_cfg.tie_embeddings else V * C
  return V * C + T * C + L * per_layer + 2 * C + head


def param_count_of(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


def param_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
  """{dotted name: shape} in canonical order, from the config alone (no model is built)."""
  c = as_model_config(model_cfg)
  C, V, T = c.n_embd, c.vocab_size, c.block_size
  per_layer = {
      'ln_1.scale': (C,), 'ln_1.bias': (C,), 'attn.c_attn.kernel': (C, 3 * C), 'attn.c_attn.bias':
          (3 * C,), 'attn.c_proj.kernel': (C, C), 'attn.c_proj.bias': (C,), 'ln_2.scale': (C,),
      'ln_2.bias': (C,), 'mlp.c_fc.kernel': (C, 4 * C), 'mlp.c_fc.bias': (4 * C,),
      'mlp.c_proj.kernel': (4 * C, C), 'mlp.c_proj.bias': (C,)
  }
  fixed = {
      'wte.embedding': (V, C), 'wpe.embedding': (T, C), 'ln_f.scale': (C,), 'ln_f.bias': (C,),
      'lm_head.kernel': (V, C)
  }
  shapes = {}
  for name in parameter_names(c):
    parts = name.split('.')
    shapes[name] = per_layer['.'.join(parts[2:])] if parts[0] == 'h' else fixed[name]
  return shapes


def as_model_config(model_cfg: Any) -> ml_collections.ConfigDict:
  """`config.model` as a ConfigDict, whether given one or a plain dict (from a manifest)."""
  if isinstance(model_cfg, ml_collections.ConfigDict):
    return model_cfg
  return ml_collections.ConfigDict(dict(model_cfg))
