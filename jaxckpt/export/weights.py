"""Initial weights from elsewhere: which tensors of which files, pinned, read again on resume.

    pin = weights.plan('s3://bucket/gpt2', config.model)   # headers only; names, shapes checked
    arrays = weights.read_pinned(pin)                      # {dotted name: array}, ranged reads

A source is a safetensors file, a directory holding `model.safetensors.index.json` (a sharded
Hugging Face save) or `model.safetensors`, or an index file itself; local, `s3://` or `gs://`.
Its names are jaxckpt's (`h.0.attn.c_attn.kernel`) or transformers' (`transformer.h.0.attn.
c_attn.weight`), told apart by the names: jaxckpt's end in `embedding`, `kernel` or `scale`.
transformers' Conv1D kernels are [in, out], as jaxckpt stores them: nothing is transposed. A
directory's (or a file's sibling) `config.json` is checked for what shapes do not show (heads,
activation, LayerNorm eps) and says whether the head is tied (transformers' default: tied).

The pin, in every manifest as `init_from`:

    {'path': SOURCE, 'naming': 'jaxckpt' | 'hf',
     'files': [{'path': FILE, 'size': N, 'sha256' | 'etag' | 'generation': V,
                'tensors': {dotted name: the file's tensor name}}, ...]}

Only files a parameter is read from are pinned. Manifests written before this form pinned one
file as {'path', 'size', 'sha256'} of jaxckpt's names; `normalize` reads both.
"""

from __future__ import annotations

import json
import os
import posixpath
from typing import Any, Iterable, Mapping

import numpy as np

from jaxckpt.errors import CheckpointError, ConfigError, ResumeError
from jaxckpt.export import hf
from jaxckpt.export.tensorfile import File, Unreadable, exists, is_url, read_small
from jaxckpt.model import gpt as model_lib

INDEX_FILE = 'model.safetensors.index.json'
WEIGHTS_FILE = 'model.safetensors'
CONFIG_FILE = 'config.json'
VERSION_KEYS = ('sha256', 'etag', 'generation')
_JAXCKPT_LEAVES = ('embedding', 'kernel', 'scale')
FIX = ('point --config.train.init_from at a safetensors file, a Hugging Face GPT-2 directory or '
       f'its {INDEX_FILE}, of a model with this config')


def _join(base: str, name: str) -> str:
  return f'{base}/{name}' if is_url(base) else os.path.join(base, name)


def _dirname(location: str) -> str:
  return posixpath.dirname(location) if is_url(location) else os.path.dirname(location)


def _json(location: str, required: bool) -> Any:
  data = read_small(location)
  if data is None:
    if required:
      raise Unreadable(f'{location}: no such file')
    return None
  try:
    return json.loads(data)
  except (UnicodeDecodeError, ValueError) as e:
    raise Unreadable(f'{location} is not JSON: {e}') from e


def locate(spec: str) -> tuple[list[str], dict[str, str] | None, str]:
  """(safetensors files, the index's {tensor: file} or None, where a config.json would be)."""
  spec = spec.rstrip('/') if is_url(spec) else os.path.abspath(spec)
  if spec.endswith('.json'):
    index = spec
  elif spec.endswith('.safetensors'):
    return [spec], None, _join(_dirname(spec), CONFIG_FILE)
  elif exists(_join(spec, INDEX_FILE)):
    index = _join(spec, INDEX_FILE)
  elif exists(_join(spec, WEIGHTS_FILE)):
    return [_join(spec, WEIGHTS_FILE)], None, _join(spec, CONFIG_FILE)
  elif not is_url(spec) and not os.path.isdir(spec):
    raise Unreadable(f'{spec}: no such file or directory')
  else:
    raise Unreadable(f'{spec} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}')
  base, weight_map = _dirname(index), (_json(index, True) or {}).get('weight_map')
  if not isinstance(weight_map, dict) or not weight_map:
    raise Unreadable(f'{index} has no weight_map')
  for tensor, shard in weight_map.items():
    # A shard is a file beside the index: never a path that leaves its directory.
    if not isinstance(shard, str) or '/' in shard or '\\' in shard or shard in ('', '.', '..'):
      raise Unreadable(f'{index}: {tensor} is in {shard!r}, not a file beside the index')
  shards = list(dict.fromkeys(weight_map.values()))
  return [_join(base, s) for s in shards], weight_map, _join(base, CONFIG_FILE)


def naming_of(names: Iterable[str]) -> str:
  return 'jaxckpt' if any(n.rsplit('.', 1)[-1] in _JAXCKPT_LEAVES for n in names) else 'hf'


def plan(spec: str, model_cfg) -> dict[str, Any]:
  """The pin of what `spec` gives the model: its files' versions and {parameter: tensor} each.

  Raises:
    ConfigError E-LOAD-002: the source cannot be read (missing, not safetensors, a bad index).
    ConfigError E-LOAD-003: tensors that are not parameters of the model, or another shape.
    ConfigError E-LOAD-004: a config.json whose architecture is not the model's.
  """
  where = f'train.init_from={spec}'
  files: list[File] = []
  try:
    locations, weight_map, config_at = locate(spec)
    for location in locations:
      files.append(File(location))
    held = {}  # tensor -> (file number, Tensor)
    for i, f in enumerate(files):
      for name, t in f.tensors.items():
        if weight_map is None or weight_map.get(name) == posixpath.basename(f.location):
          held[name] = (i, t)
    lost = [n for n in (weight_map or {}) if n not in held]
    if lost:
      raise Unreadable(f'{lost[0]} is not in {weight_map[lost[0]]}, which the index says holds it')
    naming = naming_of(held)
    hf_config = _json(config_at, False) if naming == 'hf' else None
  except Unreadable as e:
    raise ConfigError('E-LOAD-002', f'cannot read {where}: {e}', FIX) from e
  finally:
    for f in files:
      f.close()
  c = model_lib.as_model_config(model_cfg)
  if hf_config is not None and not isinstance(hf_config, dict):
    raise ConfigError('E-LOAD-002', f'cannot read {where}: {config_at} is not a JSON object', FIX)
  params = _params_of(held, naming, hf_config, c, where)
  shapes = model_lib.param_shapes(c)
  unknown = [t for t, p in params.items() if p not in shapes]
  misfit = [t for t, p in params.items() if p in shapes and not _fits(held[t][1], shapes[p])]
  if unknown or misfit or not params:
    parts = [
        f'not parameters of the model: {", ".join(unknown[:5])}' +
        (f' (+{len(unknown) - 5} more)' if len(unknown) > 5 else '')
    ] if unknown else []
    for t in misfit[:5]:
      x, p = held[t][1], params[t]
      named = t if t == p else f'{t} ({p})'
      parts.append(f'{named} {x.dtype}{list(x.shape)} -> model float32{list(shapes[p])}')
    parts += [f'(+{len(misfit) - 5} more)'] if len(misfit) > 5 else []
    raise ConfigError(
        'E-LOAD-003',
        f'{where} does not fit the model: ' + ('; '.join(parts) if parts else 'it holds no tensor'),
        FIX)
  by_param = {p: t for t, p in params.items()}
  tied = _tied(held, naming, hf_config)
  if naming == 'hf' and not c.tie_embeddings and tied and 'wte.embedding' in by_param:
    by_param['lm_head.kernel'] = by_param['wte.embedding']  # transformers' tied head is wte
  pins = []
  for i, f in enumerate(files):
    mine = {p: by_param[p] for p in shapes if p in by_param and held[by_param[p]][0] == i}
    if mine:
      pins.append({**f.pin(), 'tensors': mine})
  return {'path': spec if is_url(spec) else os.path.abspath(spec), 'naming': naming, 'files': pins}


def _tied(held: Mapping[str, Any], naming: str, hf_config: Mapping[str, Any] | None) -> bool:
  """Whether the source's head is its token embedding, as transformers would load it."""
  if hf_config is not None:
    return bool(hf_config.get('tie_word_embeddings', True))
  return naming == 'hf' and 'lm_head.weight' not in held


def _params_of(held, naming, hf_config, c, where) -> dict[str, str]:
  """{tensor: dotted parameter name} of what the model takes from the source."""
  if naming == 'jaxckpt':
    return {t: t for t in held}
  if hf_config is not None:
    misfit = hf.config_misfit(hf_config, c)
    if misfit:
      raise ConfigError('E-LOAD-004', f'{where}: its config.json is not this model: '
                        f'{"; ".join(misfit)}', FIX)
  tied = _tied(held, naming, hf_config)
  if c.tie_embeddings and not tied:
    raise ConfigError(
        'E-LOAD-004', f'{where} has an untied head (lm_head.weight) and the '
        'model ties it to wte', 'set --config.model.tie_embeddings=False, or '
        'load a tied model')
  out = {}
  for t in held:
    name = hf.from_hf_name(t)
    if name is not None and not (name == 'lm_head.kernel' and tied):  # a tied head is wte
      out[t] = name
  return out


def _fits(x, shape: tuple[int, ...]) -> bool:
  """The parameter's shape, and a float jaxckpt's f32 parameters hold exactly."""
  return tuple(x.shape) == tuple(shape) and x.dtype.kind in 'fV' and x.dtype.itemsize <= 4


# ------------------------------------------------------------------------------ pins
def pin_problem(pin: Any) -> str | None:
  """What is wrong with the shape of a pin read from a manifest (`init_from`), or None: a
  manifest is sealed, not trusted, and a reader must not fail on a field of the wrong type."""
  text = lambda v: f'{v!r:.60}'
  whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0
  if not isinstance(pin, Mapping):
    return f'init_from is {text(pin)}, not an object'
  files = pin['files'] if 'files' in pin else [pin]  # an older pin: one file, no `files`
  if not isinstance(files, list) or not files:
    return f'init_from.files is {text(files)}, not a list of files'
  for i, f in enumerate(files):
    where = f'init_from.files[{i}]' if 'files' in pin else 'init_from'
    if not isinstance(f, Mapping):
      return f'{where} is {text(f)}, not an object'
    if not isinstance(f.get('path'), str) or not f['path']:
      return f'{where}.path is {text(f.get("path"))}, not a file name'
    if not whole(f.get('size')):
      return f'{where}.size is {text(f.get("size"))}, not a whole number'
    if not all(f.get(k) is None or isinstance(f[k], (str, int)) for k in VERSION_KEYS):
      return f'{where} has a version ({", ".join(VERSION_KEYS)}) that is not a string'
    tensors = f.get('tensors')
    if tensors is not None and (not isinstance(tensors, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tensors.items())):
      return f'{where}.tensors is {text(tensors)}, not an object of tensor names'
  return None


def normalize(pin: Mapping[str, Any]) -> dict[str, Any]:
  """A pin in this module's form; an older manifest's {'path', 'size', 'sha256'} as one file
  whose tensors are the parameters by their own names (`tensors` None).

  Raises:
    CheckpointError E-CKPT-004: a pin of the wrong shape (`pin_problem`).
  """
  problem = pin_problem(pin)
  if problem:
    raise CheckpointError('E-CKPT-004', f"a checkpoint's manifest is foreign: {problem}",
                          'the checkpoint is damaged: verify it, resume from another')
  if 'files' in pin:
    return dict(pin)
  return {
      'path':
          pin.get('path'), 'naming':
              'jaxckpt', 'files': [{
                  'path': pin.get('path'), 'size': pin.get('size'), 'sha256': pin.get('sha256'),
                  'tensors': None
              }]
  }


def version_of(file_pin: Mapping[str, Any]) -> tuple[Any, ...]:
  return (file_pin.get('size'),) + tuple(file_pin.get(k) for k in VERSION_KEYS)


def describe(file_pin: Mapping[str, Any] | None) -> str:
  """'4976 bytes, "9b2c...-149"' (an ETag), '..., sha256:<hex>', '..., generation 17'."""
  if file_pin is None:
    return 'not read now'
  if 'unreadable' in file_pin:
    return f'cannot be read ({file_pin["unreadable"]})'
  if file_pin.get('etag') is not None:
    version = file_pin['etag']
  elif file_pin.get('generation') is not None:
    version = f'generation {file_pin["generation"]}'
  else:
    version = f'sha256:{file_pin.get("sha256")}'
  return f'{file_pin.get("size")} bytes, {version}'


def load_001(file_pin: Mapping[str, Any],
             now: Mapping[str, Any] | None,
             param: str | None = None) -> ResumeError:
  """E-LOAD-001 for a pinned file that is not the one read before: the tensor (a frozen one
  named by `param` when given), the file and both pins."""
  tensors = file_pin.get('tensors') or {}
  param = param if param in tensors or not tensors else next(iter(tensors))
  tensor = tensors.get(param, param) if param else 'its tensors'
  label = f'{param}: {tensor}' if param and tensor != param else str(tensor)
  return ResumeError(
      'E-LOAD-001', "a loaded parameter's file is not the one the checkpoint's run read: "
      f'{label} in {file_pin.get("path")}, {describe(file_pin)} -> {describe(now)}',
      'restore that file, or start the run again in a new --workdir')


def now_pin(file_pin: Mapping[str, Any]) -> dict[str, Any]:
  """The file of `file_pin` as it is now: its pin, or {'unreadable': why}."""
  try:
    with File(file_pin['path']) as f:
      return f.pin()
  except Unreadable as e:
    return {'path': file_pin.get('path'), 'unreadable': str(e)}


def read_pinned(pin: Mapping[str, Any],
                names: Iterable[str] | None = None,
                *,
                verify: bool = True) -> dict[str, np.ndarray]:
  """{dotted name: array} of the pinned parameters (`names` of them, when given), each read from
  the file and tensor the pin names. A file whose size or version is not the pinned one is
  refused (ResumeError E-LOAD-001); S3 and GCS versions come with the reads themselves, a local
  file's sha256 is computed only when `verify` (a caller that has just checked it passes False).
  """
  wanted = None if names is None else set(names)
  out = {}
  for file_pin in normalize(pin)['files']:
    tensors = file_pin.get('tensors')
    try:
      with File(file_pin['path'], hash_local=verify) as f:
        if tensors is None:  # an older pin: the file's tensors by their own names
          tensors = {n: n for n in f.tensors}
        mine = {p: t for p, t in tensors.items() if wanted is None or p in wanted}
        if not mine:
          continue
        now = f.pin()
        same = all(now.get(k) == file_pin.get(k) for k in ('size', *now) if k != 'path')
        absent = [t for t in mine.values() if t not in f.tensors]
        if not same or absent:
          raise load_001(file_pin, now, next(iter(mine)))
        arrays = f.read(set(mine.values()))
    except Unreadable as e:
      raise load_001(file_pin, {'unreadable': str(e)}, next(iter(tensors or {}), None)) from e
    out.update({p: arrays[t] for p, t in mine.items()})
  return out


def first_change(saved: Mapping[str, Any],
                 new: Mapping[str, Any] | None,
                 frozen: Iterable[str] = ()) -> ResumeError | None:
  """E-LOAD-001 when the files `new` pins (None: the saved files as they are now) are not the
  ones `saved` pins; None when they are. The error names a frozen parameter when one is read
  from the changed file."""
  saved_files = normalize(saved)['files']
  if new is None:
    new_files = [now_pin(f) for f in saved_files]
  elif 'unreadable' in new:
    new_files = [dict(new)] * len(saved_files)
  else:
    new_files = normalize(new)['files']
  frozen = list(frozen)
  for i, old in enumerate(saved_files):
    now = new_files[i] if i < len(new_files) else None
    mapping_moved = (
        now is not None and old.get('tensors') is not None and now.get('tensors') is not None
        and old['tensors'] != now['tensors'])
    if now is None or 'unreadable' in now or version_of(old) != version_of(now) or mapping_moved:
      pick = next((p for p in frozen if p in (old.get('tensors') or {})), None)
      return load_001(old, now, pick)
  if len(new_files) > len(saved_files):
    extra = new_files[len(saved_files)]
    return ResumeError(
        'E-LOAD-001', f'train.init_from now reads {extra.get("path")}, which the checkpoint\'s '
        'run did not', 'restore the source the run started from, or start a new --workdir')
  return None
