"""A Hugging Face GPT-2 directory: `config.json` + `model.safetensors`.

    write_hf_dir('exports/step_00000300/hf', flat_params, config.model)

    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained('exports/step_00000300/hf')

jaxckpt's model is GPT-2 itself (see `jaxckpt.model.gpt`): kernels are stored (in, out) like GPT-2's
`Conv1D` weights and the untied head (vocab, embed) like `lm_head.weight`, so the export only
renames tensors, it never transposes. A tied head writes no `lm_head.weight` (transformers ties
it to `transformer.wte.weight` itself) and sets `tie_word_embeddings`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np

from jaxckpt.errors import UsageError
from jaxckpt.export import atomic_dir, atomic_file, safetensors_io
from jaxckpt.model import gpt as model_lib

CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'

# Last component of a jaxckpt name -> GPT-2's.
_LEAF = {'embedding': 'weight', 'kernel': 'weight', 'scale': 'weight', 'bias': 'bias'}


def gpt2_config(model_cfg) -> dict[str, Any]:
  """The `config.json` of a `GPT2LMHeadModel` with the architecture of `model_cfg`."""
  c = model_lib.as_model_config(model_cfg)
  # The byte tokenizer has no special tokens; the last id (0xFF for bytes, which never occurs
  # in UTF-8 text) is a valid id that never ends a generate() early on real text.
  special = c.vocab_size - 1
  return {
      'model_type': 'gpt2',
      'architectures': ['GPT2LMHeadModel'],
      'vocab_size': c.vocab_size,
      'n_positions': c.block_size,
      'n_ctx': c.block_size,
      'n_embd': c.n_embd,
      'n_layer': c.n_layer,
      'n_head': c.n_head,
      'n_inner': 4 * c.n_embd,
      'activation_function': 'gelu_new',  # tanh-approximated GELU, as jaxckpt.model
      'layer_norm_epsilon': model_lib.LAYER_NORM_EPS,
      'resid_pdrop': 0.0,
      'embd_pdrop': 0.0,
      'attn_pdrop': 0.0,
      'summary_first_dropout': 0.0,
      'initializer_range': 0.02,
      'scale_attn_weights': True,
      'scale_attn_by_inverse_layer_idx': False,
      'reorder_and_upcast_attn': False,
      'tie_word_embeddings': bool(c.tie_embeddings),
      'bos_token_id': special,
      'eos_token_id': special,
      'use_cache': True,
      # Weights are exported in f32 whatever the compute dtype; `dtype` is transformers 5's
      # name for `torch_dtype`, kept for transformers 4.
      'dtype': 'float32',
      'torch_dtype': 'float32',
  }


def hf_name(name: str) -> str:
  """`h.0.attn.c_attn.kernel` -> `transformer.h.0.attn.c_attn.weight`; `lm_head.kernel` ->
  `lm_head.weight`."""
  *path, leaf = name.split('.')
  hf = '.'.join([*path, _LEAF[leaf]])
  return hf if path[0] == 'lm_head' else f'transformer.{hf}'


def hf_state_dict(params: Mapping[str, np.ndarray], model_cfg) -> dict[str, np.ndarray]:
  """{GPT-2 name: f32 array} from jaxckpt's {dotted name: array}, in canonical order.

  Raises:
    UsageError (E-EXPORT-002): `params` are not exactly this config's parameters and shapes.
  """
  c = model_lib.as_model_config(model_cfg)
  check_params(params, c)
  return {hf_name(n): np.asarray(params[n], dtype=np.float32) for n in model_lib.parameter_names(c)}


def check_params(params: Mapping[str, Any], model_cfg) -> None:
  """Refuse parameters that are not exactly `model_cfg`'s, before anything is written."""
  c = model_lib.as_model_config(model_cfg)
  want = model_lib.parameter_names(c)
  if sorted(params) != sorted(want):
    diff = sorted(set(params) ^ set(want))
    raise UsageError(
        'E-EXPORT-002', f'parameters do not match the model config '
        f'(n_layer={c.n_layer}, tie_embeddings={c.tie_embeddings}): differ in '
        f'{diff[:4]}', 'export with the model config the parameters were trained '
        'with')
  shapes = model_lib.param_shapes(c)
  for name in want:
    if tuple(np.shape(params[name])) != shapes[name]:
      raise UsageError(
          'E-EXPORT-002', f'{name} has shape {tuple(np.shape(params[name]))}, the '
          f'model config wants {shapes[name]}', 'export with the model config the '
          'parameters were trained with')


def write_hf_dir(out_dir: str | os.PathLike,
                 params: Mapping[str, np.ndarray],
                 model_cfg,
                 *,
                 metadata: Mapping[str, object] | None = None) -> None:
  """Write a `from_pretrained`-loadable GPT-2 directory at `out_dir`, atomically.

  The files go into a temporary sibling directory, are fsynced, and the directory is renamed
  into place (an existing export there is swapped out), so a half-written export is never seen
  under `out_dir`.

  Args:
    out_dir: the directory to create or replace.
    params: {dotted name: array} of `model_cfg`'s parameters (`jaxckpt.model.gpt.flatten_params`).
    model_cfg: `config.model` (a ConfigDict or a plain dict).
    metadata: extra string metadata for `model.safetensors` (e.g. the step).
  """
  state = hf_state_dict(params, model_cfg)
  config = json.dumps(gpt2_config(model_cfg), indent=2) + '\n'
  with atomic_dir(out_dir) as tmp:
    with atomic_file(tmp / CONFIG_FILE) as path:
      path.write_text(config)
    safetensors_io.write_tensors(tmp / WEIGHTS_FILE, state, metadata=metadata)


def from_hf_name(name: str) -> str | None:
  """Inverse of `hf_name`: `transformer.h.0.attn.c_attn.weight` (or `h.0.attn.c_attn.weight`, as
  `GPT2Model` saves) -> `h.0.attn.c_attn.kernel`; None for the attention-mask buffers older
  transformers saved (`h.0.attn.bias`, `h.0.attn.masked_bias`), which are not parameters."""
  parts = name.split('.')
  parts = parts[1:] if parts[0] == 'transformer' and len(parts) > 1 else parts
  if len(parts) == 4 and parts[0] == 'h' and parts[2] == 'attn' and parts[3] in ('bias',
                                                                                 'masked_bias'):
    return None
  *path, leaf = parts
  if leaf == 'weight' and path:
    module = path[-1]
    leaf = ('embedding' if module in ('wte',
                                      'wpe') else 'scale' if module.startswith('ln_') else 'kernel')
  return '.'.join([*path, leaf])


def config_misfit(hf_config: Mapping[str, Any], model_cfg) -> list[str]:
  """What a GPT-2 `config.json` says that jaxckpt's model with `model_cfg` would compute
  differently and the tensor shapes do not show (heads, activation, LayerNorm eps, scaling)."""
  want = gpt2_config(model_cfg)
  out = []
  if hf_config.get('model_type', 'gpt2') != 'gpt2':
    out.append(f'model_type {hf_config.get("model_type")!r} (not gpt2)')
  for key, default in (('n_head', 12), ('layer_norm_epsilon', 1e-5), ('scale_attn_weights', True),
                       ('scale_attn_by_inverse_layer_idx', False)):
    value = hf_config.get(key, default)
    if value != want[key] and not (isinstance(value, float) and math.isclose(value, want[key])):
      out.append(f'{key} {value!r} -> model {want[key]!r}')
  act = hf_config.get('activation_function', 'gelu_new')
  if act not in ('gelu_new', 'gelu_pytorch_tanh'):  # both tanh-approximated, as jaxckpt's
    out.append(f'activation_function {act!r} -> model gelu_new')
  return out
