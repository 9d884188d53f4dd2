"""Where a run's config came from, for every checkpoint's manifest.

    knobs      every config leaf with its value and source: default (configs/default.py), config
               file, or flag (`--config.*`, the checkpoint and export flags, `--flagfile`)
    sources    sha256 of each module of the jaxckpt package and of the config file
    versions   jaxckpt, python, jax, flax, optax, orbax, tensorstore, numpy
    pins       `pin_file`: size and sha256 of a file a run depends on (init_from)

`jaxckpt.records.identity` compares them on resume: a changed knob or source is allowed and recorded.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

import jaxckpt
from jaxckpt import errors

KNOB_SOURCES = ('default', 'config file', 'flag')


# ---------------------------------------------------------------------------------- knobs
def jsonable(value: Any) -> Any:
  if isinstance(value, (tuple, list)):
    return [jsonable(v) for v in value]
  if isinstance(value, Mapping):
    return {str(k): jsonable(v) for k, v in value.items()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if hasattr(value, 'item') and callable(value.item):  # numpy scalars
    return jsonable(value.item())
  return repr(value)


def flatten_config(config: Any) -> dict[str, Any]:
  """{dotted field: JSON-safe value} of every leaf of a ConfigDict (or nested dict)."""
  tree = config.to_dict() if hasattr(config, 'to_dict') else config
  out: dict[str, Any] = {}

  def walk(prefix: str, node: Any) -> None:
    if isinstance(node, Mapping):
      for key in sorted(node):
        walk(f'{prefix}.{key}' if prefix else str(key), node[key])
    else:
      out[prefix] = jsonable(node)

  walk('', tree)
  return out


def flagged_fields(flag_values,
                   flag_fields: Mapping[str, str] | None = None,
                   config_flag: str = 'config') -> set[str]:
  """Config fields the command line set, from absl's and ml_collections' own records.

  Parsed flags know whether they were given (`--flagfile` included), which no reading of argv
  does: `--config.*` overrides are the config flag's `override_values`, and a flag in
  `flag_fields` ({flag: dotted field}) counts when it is `present`.
  """
  from ml_collections import config_flags  # not for every user of this module
  named = set(config_flags.get_override_values(flag_values[config_flag]))
  return named | {field for flag, field in (flag_fields or {}).items() if flag_values[flag].present}


def knob_table(config,
               *,
               default_config=None,
               file_config=None,
               flagged: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
  """Every leaf of `config` as {dotted name: {'value': v, 'source': s}}.

  The source is 'flag' when the command line set the field (or a field above it), else
  'default' when the value is the one in `default_config` (configs/default.py) and the config
  file left it alone, else 'config file'.

  Args:
    config: the final ConfigDict the run uses (file + flags).
    default_config: the defaults the config file starts from; None: no field counts as default.
    file_config: the config file's own `get_config()`, before flags; None: judged from `config`.
    flagged: the fields the command line set (`flagged_fields`); a field under one counts too.
  """
  values = flatten_config(config)
  defaults = flatten_config(default_config) if default_config is not None else None
  from_file = flatten_config(file_config) if file_config is not None else None
  flagged = set(flagged)
  table = {}
  for name, value in values.items():
    parts = name.split('.')
    if any('.'.join(parts[:i]) in flagged for i in range(1, len(parts) + 1)):
      source = 'flag'
    else:
      file_value = from_file.get(name, value) if from_file is not None else value
      is_default = defaults is not None and name in defaults and defaults[name] == file_value
      source = 'default' if is_default else 'config file'
    table[name] = {'value': value, 'source': source}
  return table


def make_config_importable(config_file: str | os.PathLike) -> None:
  """Let a config file import its siblings from any working directory.

  Config files import each other as their folder's package (`from configs import default` in
  `configs/tiny.py`), which Python finds only from the folder above `configs/`: that folder goes
  on `sys.path` (once), so `--config=/abs/path/configs/tiny.py` loads from anywhere. Last, not
  first: nothing there can shadow a module the process imports later (jax, numpy).
  """
  root = str(Path(config_file).expanduser().resolve().parent.parent)
  if root not in sys.path:
    sys.path.append(root)


def load_config_file(path: str | os.PathLike):
  """A config file's `get_config()` (a `path:arg` suffix is passed to it), before any flag."""
  path = str(path)
  arg = None
  if ':' in Path(path).name:
    path, arg = path.rsplit(':', 1)
  make_config_importable(path)
  spec = importlib.util.spec_from_file_location(f'_jaxckpt_config_{abs(hash(path))}', path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


def load_default_config(config_file: str | os.PathLike):
  """The defaults a config file builds on: `default.py` beside it, or None when there is none."""
  path = Path(str(config_file).split(':', 1)[0]).with_name('default.py')
  return load_config_file(path) if path.is_file() else None


def provenance(config, config_file: str, *, flagged: Iterable[str] = ()) -> dict[str, Any]:
  """{'knobs', 'sources'} for `build`, from what `main` knows: the config file and command line.

  The defaults are `default.py` beside the config file (when there is one); it is hashed with
  the config file and the package. Call it once, at the start, before the sources can change.

  Args:
    config: the final ConfigDict (file + flags).
    config_file: the config flag's file (`config_flags.get_config_filename(FLAGS['config'])`).
    flagged: the fields the command line set; `main` passes `flagged_fields(FLAGS, ...)`.
  """
  path = str(config_file).split(':', 1)[0]
  default_config = load_default_config(path)
  defaults_file = str(Path(path).with_name('default.py'))
  extra = [defaults_file] if default_config is not None and defaults_file != path else []
  sources = source_hashes(config_file, extra)
  sources.update(data_fingerprints(config))
  return {
      'knobs':
          knob_table(
              config,
              default_config=default_config,
              file_config=load_config_file(config_file),
              flagged=flagged), 'sources':
                  sources
  }


DATA_KEY = 'data:'  # `sources` keys of the training data: 'data:main'
_EDGE = 64 << 10  # bytes read at each end of a data file
_READ_FILES = 256  # data files of a source whose ends are read


def data_fingerprints(config) -> dict[str, str]:
  """{'data:<source>': fingerprint} of the training data's files (`config.data.sources`): their
  count, order, sizes and first and last 64 KiB (of 256 of them at most), hashed (not every
  byte: a corpus can be terabytes). A resume whose data changed says so (`source data:main ... -> ...`): its batches
  are not the ones the checkpoint's run would have seen. The embedded corpus is the package's;
  a source that cannot be listed or read is left to the data loader's own error."""
  from jaxckpt.model import data  # pylint: disable=import-outside-toplevel
  out = {}
  sources = config.get('data', {}).get('sources', {}) if hasattr(config, 'get') else {}
  for name, value in dict(sources).items():
    try:
      paths = data.source_paths(value)
      if paths == [data.EMBEDDED]:
        continue
      h = hashlib.sha256()
      # Every file's size; the ends of at most _READ_FILES of them, spread over the list (a
      # source of 100,000 shards on a network filesystem is read in seconds, not minutes).
      read = set(range(0, len(paths), max(1, -(-len(paths) // _READ_FILES))))
      for k, path in enumerate(paths):
        size = os.path.getsize(path)
        h.update(f'{size}:'.encode())
        if k in read:
          with open(path, 'rb') as f:
            h.update(f.read(_EDGE))
            f.seek(max(0, size - _EDGE))
            h.update(f.read(_EDGE))
      out[f'{DATA_KEY}{name}'] = h.hexdigest()
    except (OSError, ValueError, TypeError, errors.JaxckptError):
      continue
  return out


# -------------------------------------------------------------------------------- sources
def sha256_file(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)
  return h.hexdigest()


def source_hashes(
    config_file: str | os.PathLike | None,
    extra: Iterable[str | os.PathLike] = ()) -> dict[str, str]:
  """{path: sha256} of every module of the installed jaxckpt package and of the config file.

  Package modules are named from the package's parent (`jaxckpt/model/gpt.py`); the config file and
  `extra` files (say the `configs/default.py` it imports) by the path as given, which a resume
  may spell otherwise (`/abs/configs/tiny.py`): `identity.compare` pairs the two spellings.
  """
  package = Path(jaxckpt.__file__).resolve().parent
  out = {}
  for path in sorted(package.rglob('*.py')):
    if '__pycache__' not in path.parts:
      out[path.relative_to(package.parent).as_posix()] = sha256_file(path)
  for path in ([config_file] if config_file else []) + list(extra):
    out[str(path).split(':', 1)[0]] = sha256_file(str(path).split(':', 1)[0])
  return out


def pin_file(path: str | os.PathLike) -> dict[str, Any]:
  """{'path', 'size', 'sha256'} of a file a run reads its initial weights from (init_from)."""
  return {'path': str(path), 'size': os.path.getsize(path), 'sha256': sha256_file(path)}


_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'tensorstore', 'numpy')


@functools.cache
def versions() -> dict[str, str]:
  out = {'jaxckpt': jaxckpt.__version__, 'python': platform.python_version()}
  for name in _PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = 'not installed'
  return out
