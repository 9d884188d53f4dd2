"""Initialising parameters from safetensors weights, and freezing parameters.

`config.train.init_from` names a safetensors source: a jaxckpt export (`model.safetensors`, its
dotted names), a Hugging Face GPT-2 directory or `model.safetensors` (transformers' names), or a
sharded `model.safetensors.index.json` (or its directory); a path, or an `s3://` or `gs://` URL
(`jaxckpt.export.weights`). `config.train.frozen` is a tuple of globs over jaxckpt's names. The
files read are pinned in every manifest (size and sha256, ETag or generation); frozen parameters
they hold are not checkpointed but read from them again on every resume (`jaxckpt.train.resume`).
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any, Mapping

import jax
import numpy as np

from jaxckpt.errors import ConfigError, ResumeError
from jaxckpt.export import weights
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names as names_lib
from jaxckpt.records import identity


def validate(config) -> None:
  """train.frozen: globs that each name a parameter, and not all of them; train.init_from: a str."""
  t = config.train
  if not isinstance(t.get('init_from', ''), str):
    raise ConfigError(
        'E-CONFIG-006', f'train.init_from={t.init_from!r} is not a path',
        "set --config.train.init_from=PATH/model.safetensors (or a Hugging Face directory, "
        "an s3:// or gs:// URL), or '' for none")
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


def pin(spec: str, model_cfg, *, fresh: bool) -> dict[str, Any] | None:
  """The pin of train.init_from (`jaxckpt.export.weights.plan`: files, versions, tensors); None
  when unset.

  On a fresh start a source that cannot be read or does not fit is an error here (E-LOAD-002,
  -003, -004). On a resume it is pinned as {'path', 'unreadable': why}, and `check_resume`
  refuses it (E-LOAD-001, naming the checkpoint's pin) before anything is loaded.
  """
  if not spec:
    return None
  try:
    return weights.plan(spec, model_cfg)
  except ConfigError as e:
    if fresh:
      raise
    return {'path': spec, 'unreadable': e.what}


def check_resume(manifest: Mapping[str, Any], new_pin: Mapping[str, Any] | None,
                 where: str) -> None:
  """Refuse a resume whose init_from files are not the ones the checkpoint's run read.

  Raises:
    ResumeError E-LOAD-001: a pinned file changed or cannot be read (named with the tensor and
      both pins), or init_from was added where the checkpoint's run had none.
  """
  saved = manifest.get('init_from')
  if saved is None:
    if new_pin is not None:
      raise ResumeError(
          'E-LOAD-001', f'{where} was not initialized from a file, but the config now '
          f'reads init_from={new_pin["path"]}', 'drop init_from to continue this run, '
          'or start a new --workdir')
    return
  frozen = [names_lib.param_of_leaf(t['name']) for t in manifest.get('excluded') or []]
  change = weights.first_change(saved, new_pin, [f[1] for f in frozen if f])
  if change is not None:
    raise change


def summary(pin: Mapping[str, Any]) -> dict[str, Any]:
  """The init_from event's account of a pin: the source and each file's size and version."""
  files = weights.normalize(pin)['files']
  return {
      'path': pin['path'], 'files': [{k: v for k, v in f.items() if k != 'tensors'} for f in files]
  }


def versions(fields: Mapping[str, Any]) -> str:
  """'<size> bytes, sha256:<hex>' (or the ETag, the generation) of each file of `summary`."""
  return '; '.join(weights.describe(f) for f in fields['files'])


def read(source: str | os.PathLike | Mapping[str, Any],
         abstract_params,
         model_cfg,
         *,
         verify: bool = False) -> dict[str, np.ndarray]:
  """{dotted name: array} of an init_from source (a spec, or its pin), in the model's dtypes.

  `abstract_params` is the model's params tree (shapes and dtypes suffice). Every tensor the
  source holds must be a parameter of the model with its shape (checked by `weights.plan`); a
  float narrower than the parameter (bf16 into f32) is widened, exactly. A parameter the source
  does not hold is not an error (a partial file): it keeps its fresh init.

  Raises:
    ConfigError (E-LOAD-002, -003, -004): a spec that cannot be read, or does not fit.
    ResumeError (E-LOAD-001): a pinned file that changed since it was pinned.
  """
  pin_ = source if isinstance(source, Mapping) else weights.plan(os.fspath(source), model_cfg)
  model = model_lib.flatten_params(abstract_params, model_cfg)
  arrays = weights.read_pinned(pin_, [n for n in model], verify=verify)
  return {n: np.asarray(arrays[n], dtype=model[n].dtype) for n in model if n in arrays}


def load_params(params, arrays: dict[str, np.ndarray]):
  """`params` with the leaves named in `arrays` replaced, each placed on the leaf's sharding."""

  def put(name, x):
    if name not in arrays:
      return x
    value = arrays[name]
    return jax.make_array_from_callback(value.shape, x.sharding, lambda idx: value[idx])

  return model_lib.map_named(put, params)
