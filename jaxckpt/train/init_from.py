"""Initialising parameters from a safetensors file, and freezing parameters.

`config.train.init_from` names a safetensors file with jaxckpt's dotted parameter names (a
`model.safetensors` export); `config.train.frozen` is a tuple of globs over those names. The file
is pinned (path, size, sha256) in every manifest; frozen parameters it holds are not checkpointed
but read from it again on every resume (see `jaxckpt.train.loop`).
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxckpt.errors import ConfigError
from jaxckpt.export import safetensors_io
from jaxckpt.model import gpt as model_lib
from jaxckpt.records import identity, provenance


def validate(config) -> None:
  """train.frozen: globs that each name a parameter, and not all of them; train.init_from: a str."""
  t = config.train
  if not isinstance(t.get('init_from', ''), str):
    raise ConfigError('E-CONFIG-006', f'train.init_from={t.init_from!r} is not a path',
                      "set --config.train.init_from=PATH/model.safetensors, or '' for none")
  frozen = t.get('frozen', ())
  if isinstance(frozen, str) or not all(isinstance(g, str) for g in frozen):
    raise ConfigError('E-CONFIG-006', f'train.frozen={frozen!r} is not a tuple of globs',
                      "set --config.train.frozen=\"('wte.*', 'wpe.*')\"")
  names = model_lib.parameter_names(config.model)
  unmatched = [g for g in frozen if not any(fnmatch.fnmatchcase(n, g) for n in names)]
  if unmatched:
    raise ConfigError(
        'E-CONFIG-006', f'train.frozen glob(s) {", ".join(map(repr, unmatched))} '
        'match no parameter of the model', 'globs match dotted names such as '
        f'{", ".join(names[:3])}, h.0.* (`jaxckpt inspect CKPT` lists them all)')
  trainable = identity.trainable_fn(frozen)
  if names and not any(trainable(n) for n in names):
    raise ConfigError(
        'E-CONFIG-006', f'train.frozen={tuple(frozen)!r} freezes every parameter: '
        'there is nothing to train', 'freeze fewer parameters')


FIX = ('point --config.train.init_from at a jaxckpt safetensors export of a model with this '
       'config (WORKDIR/exports/step_<n>/model.safetensors)')


def pin(path: str, *, fresh: bool) -> dict[str, Any] | None:
  """`provenance.pin_file` of train.init_from (absolute path, size, sha256); None when unset.

  On a fresh start a missing file is an error here (E-LOAD-002). On a resume it is pinned with
  no size or sha256, and `identity.compare` refuses it (E-LOAD-001) before anything is loaded.
  """
  if not path:
    return None
  path = os.path.abspath(path)
  try:
    return provenance.pin_file(path)
  except OSError as e:
    if fresh:
      raise ConfigError('E-LOAD-002', f'cannot read train.init_from={path}: '
                        f'{e.strerror or e}', FIX) from e
    return {'path': path, 'size': None, 'sha256': None}


def read(path: str | os.PathLike, abstract_params, model_cfg) -> dict[str, np.ndarray]:
  """{dotted name: array} of an init_from file, checked against the model's parameters.

  `abstract_params` is the model's params tree (shapes and dtypes suffice).

  Every tensor of the file must be a parameter of the model with its shape; a float tensor
  narrower than the parameter (bf16 into f32) is widened, exactly. A parameter the file does not
  hold is not an error (a partial file): it keeps its fresh init.

  Raises:
    ConfigError (E-LOAD-002): the file cannot be read as safetensors.
    ConfigError (E-LOAD-003): names or shapes that do not fit the model (named).
  """
  try:
    tensors, _ = safetensors_io.read_model(path)
  except Exception as e:  # OSError, or not safetensors (the library's own error types)
    raise ConfigError('E-LOAD-002', f'cannot read train.init_from={path}: {type(e).__name__}: '
                      f'{e}', FIX) from e
  model = model_lib.flatten_params(abstract_params, model_cfg)
  unknown = [n for n in tensors if n not in model]
  misfit = [n for n, x in tensors.items() if n in model and not _fits(x, model[n])]
  if unknown or misfit or not tensors:
    parts = ([
        f'not parameters of the model: {", ".join(unknown[:5])}' +
        (f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else '')
    ] if unknown else [])
    parts += [
        f'{n} {tensors[n].dtype}{list(tensors[n].shape)} -> model '
        f'{np.dtype(model[n].dtype)}{list(model[n].shape)}' for n in misfit[:5]
    ]
    parts += [f'(+{len(misfit) - 5} more)'] if len(misfit) > 5 else []
    raise ConfigError(
        'E-LOAD-003', f'train.init_from={path} does not fit the model: ' +
        ('; '.join(parts) if parts else 'it holds no tensor'), FIX)
  return {n: np.asarray(tensors[n], dtype=model[n].dtype) for n in model if n in tensors}


def _fits(x: np.ndarray, param) -> bool:
  if tuple(x.shape) != tuple(param.shape):
    return False
  if x.dtype == param.dtype:
    return True
  floats = jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(param.dtype, jnp.floating)
  return floats and x.dtype.itemsize <= np.dtype(param.dtype).itemsize


def load_params(params, arrays: dict[str, np.ndarray]):
  """`params` with the leaves named in `arrays` replaced, each placed on the leaf's sharding."""

  def put(name, x):
    if name not in arrays:
      return x
    value = arrays[name]
    return jax.make_array_from_callback(value.shape, x.sharding, lambda idx: value[idx])

  return model_lib.map_named(put, params)
