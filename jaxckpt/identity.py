"""What a checkpoint is, and whether a run may continue from it.

`build(...)` assembles the identity block a checkpoint's `manifest.json` carries (it is passed to
`CheckpointManager.save(..., metadata=...)` and lands at the top level of the manifest):

    knobs       every config leaf: {'train.lr': {'value': 0.001, 'source': 'flag'}, ...}
    sources     sha256 of every module of the jaxckpt package and of the config file
    parameters  [{path, shape, dtype, trainable, spec}] in canonical (flat `.bin`) order
    optimizer   optimizer state names per parameter: {'wte.embedding': ['1/0/mu', '1/0/nu'], ...}
    counters, seed, mesh, devices, processes, platform, versions, finished, init_from (optional)

`compare(saved_manifest, new_identity)` is the resume check. It raises `ResumeError` (exit 2, one
line with the fix) for what cannot continue:

    E-PARAM-001  a parameter new or gone          E-PARAM-002  a shape or dtype changed
    E-PARAM-003  trainable <-> frozen changed     E-OPT-001    the optimizer state structure changed
    E-LOAD-001   the pinned init_from file changed (size or sha256), or was added or dropped

and returns a `Diff` of what may change and is recorded, one line each:

    knob train.lr 0.001 -> 0.0005
    source jaxckpt/model.py 91d77bdc76be -> b05c928e631c
    devices 8 -> 4
    mesh {'data': 4, 'model': 2} -> {'data': 4, 'model': 1}
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jaxckpt
from jaxckpt.errors import ResumeError

KNOB_SOURCES = ('default', 'config file', 'flag')
_NONE = '(none)'
_SHOW = 5  # names listed in a refusal before "(+k more)"
_FIX = ('resume with the config that wrote the checkpoint (`jaxckpt inspect CKPT` shows it), '
        'or start a new --workdir')


# ---------------------------------------------------------------------------------- knobs
def _jsonable(value: Any) -> Any:
  if isinstance(value, (tuple, list)):
    return [_jsonable(v) for v in value]
  if isinstance(value, Mapping):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if hasattr(value, 'item') and callable(value.item):  # numpy scalars
    return _jsonable(value.item())
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
      out[prefix] = _jsonable(node)

  walk('', tree)
  return out


def flagged_fields(flag_values, flag_fields: Mapping[str, str] | None = None,
                   config_flag: str = 'config') -> set[str]:
  """Config fields the command line set, from absl's and ml_collections' own records.

  Parsed flags know whether they were given (`--flagfile` included), which no reading of argv
  does: `--config.*` overrides are the config flag's `override_values`, and a flag in
  `flag_fields` ({flag: dotted field}) counts when it is `present`.
  """
  from ml_collections import config_flags  # not for every user of this module
  named = set(config_flags.get_override_values(flag_values[config_flag]))
  return named | {field for flag, field in (flag_fields or {}).items()
                  if flag_values[flag].present}


def overridden_fields(overrides: Iterable[str],
                      flag_fields: Mapping[str, str] | None = None) -> set[str]:
  """Config fields named on a command line, read from argv (`flagged_fields` reads parsed flags).

  `--config.train.lr=0.001`, `--config.train.lr 0.001` and `--noconfig.model.tie_embeddings`
  name `train.lr` and `model.tie_embeddings`; `flag_fields` maps other flags onto fields
  (`{'checkpoint_every': 'checkpoint.every'}`, so `--checkpoint_every=10` names `checkpoint.every`).
  """
  flag_fields = dict(flag_fields or {})
  named = set()
  for arg in overrides:
    if arg == '--':
      break
    if not arg.startswith('-'):
      continue  # the value of a `--flag value` pair
    name = arg.lstrip('-').split('=', 1)[0]
    for candidate in (name, name[2:] if name.startswith('no') else None):
      if candidate is None:
        continue
      if candidate.startswith('config.'):
        named.add(candidate[len('config.'):])
        break
      if candidate in flag_fields:
        named.add(flag_fields[candidate])
        break
  return named


def knob_table(config, *, default_config=None, file_config=None, overrides: Iterable[str] = (),
               flag_fields: Mapping[str, str] | None = None,
               flagged: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
  """Every leaf of `config` as {dotted name: {'value': v, 'source': s}}.

  The source is 'flag' when the command line set the field (or a field above it), else
  'default' when the value is the one in `default_config` (configs/default.py) and the config
  file left it alone, else 'config file'.

  Args:
    config: the final ConfigDict the run uses (file + flags).
    default_config: the defaults the config file starts from; None: no field counts as default.
    file_config: the config file's own `get_config()`, before flags; None: judged from `config`.
    overrides: the command line (`sys.argv[1:]`), read when `flagged` is None.
    flag_fields: flags other than `--config.*` that set config fields, {flag: dotted field}.
    flagged: the fields the command line set (`flagged_fields`).
  """
  values = flatten_config(config)
  defaults = flatten_config(default_config) if default_config is not None else None
  from_file = flatten_config(file_config) if file_config is not None else None
  flagged = set(flagged) if flagged is not None else overridden_fields(overrides, flag_fields)
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


def load_config_file(path: str | os.PathLike):
  """A config file's `get_config()` (a `path:arg` suffix is passed to it), before any flag."""
  path = str(path)
  arg = None
  if ':' in Path(path).name:
    path, arg = path.rsplit(':', 1)
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


def provenance(config, config_file: str, argv: Iterable[str] = (),
               flag_fields: Mapping[str, str] | None = None, *,
               flagged: Iterable[str] | None = None) -> dict[str, Any]:
  """{'knobs', 'sources'} for `build`, from what `main` knows: the config file and command line.

  The defaults are `default.py` beside the config file (when there is one); it is hashed with
  the config file and the package. Call it once, at the start, before the sources can change.

  Args:
    config: the final ConfigDict (file + flags).
    config_file: the config flag's file (`config_flags.get_config_filename(FLAGS['config'])`).
    argv: the command line (`sys.argv[1:]`), read when `flagged` is None.
    flag_fields: flags other than `--config.*` that set config fields, {flag: dotted field}.
    flagged: the fields the command line set; `main` passes `flagged_fields(FLAGS, ...)`.
  """
  path = str(config_file).split(':', 1)[0]
  default_config = load_default_config(path)
  defaults_file = str(Path(path).with_name('default.py'))
  extra = [defaults_file] if default_config is not None and defaults_file != path else []
  return {'knobs': knob_table(config, default_config=default_config,
                              file_config=load_config_file(config_file), overrides=argv,
                              flag_fields=flag_fields, flagged=flagged),
          'sources': source_hashes(config_file, extra)}


# -------------------------------------------------------------------------------- sources
def sha256_file(path: str | os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 20):
      h.update(chunk)
  return h.hexdigest()


def source_hashes(config_file: str | os.PathLike | None,
                  extra: Iterable[str | os.PathLike] = ()) -> dict[str, str]:
  """{path: sha256} of every module of the installed jaxckpt package and of the config file.

  Package modules are named from the package's parent (`jaxckpt/model.py`); the config file and
  `extra` files (say the `configs/default.py` it imports) by the path as given.
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


# ------------------------------------------------------------------ parameters, optimizer
def _dotted(path) -> str:
  from jaxckpt import model as model_lib  # the model's own naming: h.0.attn.c_attn.kernel
  return model_lib._dotted(path)  # pylint: disable=protected-access


def _spec_str(spec_or_sharding) -> str | None:
  spec = getattr(spec_or_sharding, 'spec', spec_or_sharding)
  return None if spec is None else str(tuple(spec))


def trainable_fn(frozen: Sequence[str] = ()) -> Callable[[str], bool]:
  """A `trainable(dotted name)` predicate: frozen are the names matching a glob in `frozen`."""
  frozen = tuple(frozen)
  return lambda name: not any(fnmatch.fnmatchcase(name, pattern) for pattern in frozen)


def parameter_table(params_tree, partition_specs=None,
                    trainable: Callable[[str], bool] = lambda name: True, *,
                    order: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """One row per parameter: {path, shape, dtype, trainable, spec}.

  Args:
    params_tree: the params (arrays or `jax.ShapeDtypeStruct`s).
    partition_specs: a tree like `params_tree` of `PartitionSpec`s or `NamedSharding`s, or None
      (then each leaf's own `.sharding` is used when it has one).
    trainable: dotted name -> whether the optimizer updates it.
    order: dotted names in canonical order (`jaxckpt.model.parameter_names(config.model)`);
      rows follow it, so cumulative element counts are offsets in the flat `.bin` export.
  """
  import jax
  import numpy as np
  leaves = jax.tree_util.tree_flatten_with_path(params_tree)[0]
  if partition_specs is None:
    specs = [getattr(x, 'sharding', None) for _, x in leaves]
  else:
    specs = jax.tree_util.tree_leaves(partition_specs, is_leaf=lambda s: s is None or hasattr(
        s, 'spec') or type(s).__name__ == 'PartitionSpec')
    if len(specs) != len(leaves):
      raise ValueError(f'{len(specs)} partition specs for {len(leaves)} parameters')
  rows = {}
  for (path, x), spec in zip(leaves, specs):
    name = _dotted(path)
    rows[name] = {'path': name, 'shape': [int(d) for d in np.shape(x)],
                  'dtype': str(np.dtype(x.dtype)), 'trainable': bool(trainable(name)),
                  'spec': _spec_str(spec)}
  ranked = [n for n in (order or ()) if n in rows]
  return [rows[n] for n in ranked] + [rows[n] for n in rows if n not in set(ranked)]


GLOBAL_STATES = '(global)'  # optimizer_table's key for states that belong to no parameter


def optimizer_table(opt_state) -> dict[str, list[str]]:
  """The optimizer's state names per parameter, from the optax state's structure.

  Optax states are tuples and named tuples; the parameters inside them are dicts. So a leaf
  path splits into the state's position (`1/0/mu`: the chain's second transformation, its first
  part, field `mu`) and the parameter (`h.0.attn.c_attn.kernel`):

      {'h.0.attn.c_attn.kernel': ['1/0/mu', '1/0/nu'], ..., '(global)': ['1/0/count', '1/2/count']}

  A state name includes its position, so moving Adam inside the chain is a structure change.
  """
  import jax
  table: dict[str, list[str]] = {}
  for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    split = len(path)
    while split > 0 and isinstance(path[split - 1], jax.tree_util.DictKey):
      split -= 1  # the trailing run of dict keys is the parameter's path
    state = '/'.join(str(getattr(k, 'name', getattr(k, 'idx', getattr(k, 'key', k))))
                     for k in path[:split])
    param = _dotted(path[split:]) if split < len(path) else GLOBAL_STATES
    table.setdefault(param, []).append(state)
  return {k: sorted(v) for k, v in sorted(table.items())}


# ------------------------------------------------------------------------------ identity
def build(*, config, params, opt_state, partition_specs=None, mesh_shape: Mapping[str, int],
          devices: int, processes: int = 1, platform: str | None = None,
          knobs: Mapping[str, Any] | None = None, sources: Mapping[str, str] | None = None,
          trainable: Callable[[str], bool] = lambda name: True,
          counters: Mapping[str, Any] | None = None, finished: bool = False,
          init_from: Mapping[str, Any] | None = None,
          versions: Mapping[str, str] | None = None) -> dict[str, Any]:
  """The identity block of a checkpoint (`metadata=` of `CheckpointManager.save`).

  Args:
    config: the run's ConfigDict; stored whole (`config`) for tools that rebuild the model.
    params, opt_state: the state's trees (arrays or ShapeDtypeStructs; only structure is read).
    partition_specs: shardings or specs of `params` (`trainer.state_shardings.params`).
    mesh_shape, devices, processes, platform: where the run is (`dict(mesh.shape)`,
      `jax.device_count()`, `jax.process_count()`, `jax.devices()[0].platform`).
    knobs: `knob_table(...)`; default: every config leaf with source 'config file'.
    sources: `source_hashes(...)`; default: the package modules only.
    trainable: dotted parameter name -> trainable (see `trainable_fn`).
    counters: step, epoch, tokens seen, data position (the run state).
    finished: True only for the checkpoint of the run's last step.
    init_from: `pin_file(path)` of the file initial weights were read from, if any.
    versions: default `jaxckpt.train.versions()`.
  """
  from jaxckpt import model as model_lib
  if versions is None:
    from jaxckpt import train  # the trainer imports this module: import it when called
    versions = train.versions()
  # A GPT config has the fields `parameter_names` reads; any other config gets the tree order.
  model_cfg = getattr(config, 'model', None)
  gpt = all(hasattr(model_cfg, field) for field in ('n_layer', 'tie_embeddings'))
  order = model_lib.parameter_names(model_cfg) if gpt else None
  identity = {
      'config': config.to_dict() if hasattr(config, 'to_dict') else dict(config),
      'knobs': dict(knobs) if knobs is not None else knob_table(config),
      'sources': dict(sources) if sources is not None else source_hashes(None),
      'parameters': parameter_table(params, partition_specs, trainable, order=order),
      'optimizer': optimizer_table(opt_state),
      'counters': _jsonable(dict(counters or {})),
      'seed': _jsonable(config.get('seed') if hasattr(config, 'get') else None),
      'mesh': {str(k): int(v) for k, v in dict(mesh_shape).items()},
      'devices': int(devices),
      'processes': int(processes),
      'versions': dict(versions),
      'finished': bool(finished),
  }
  if platform is not None:
    identity['platform'] = platform
  if init_from is not None:
    identity['init_from'] = dict(init_from)
  return _jsonable(identity)


# ----------------------------------------------------------------------------- compare
@dataclasses.dataclass(frozen=True)
class Diff:
  """What changed between a checkpoint and the run resuming from it, and is allowed to."""
  knobs: tuple[str, ...] = ()
  sources: tuple[str, ...] = ()
  topology: tuple[str, ...] = ()  # devices, processes, mesh, platform (an elastic restore)
  versions: tuple[str, ...] = ()

  @property
  def lines(self) -> list[str]:
    return [*self.topology, *self.knobs, *self.sources, *self.versions]

  @property
  def elastic(self) -> bool:
    return any(line.startswith(('devices ', 'mesh ', 'processes ')) for line in self.topology)

  def __bool__(self) -> bool:
    return bool(self.lines)


def _fmt(value: Any) -> str:
  return json.dumps(value, separators=(', ', ': '))


def _names(names: Sequence[str]) -> str:
  shown = ', '.join(names[:_SHOW])
  return shown + (f' (+{len(names) - _SHOW} more)' if len(names) > _SHOW else '')


def _saved_parameters(saved: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
  """The parameter table of a manifest; from its tensor table when it predates identities."""
  if saved.get('parameters') is not None:
    return {row['path']: row for row in saved['parameters']}
  if saved.get('tensors') is None:
    return None
  return {t['name'][len('params/'):].replace('/', '.'): {**t, 'trainable': None}
          for t in saved['tensors'] if t['name'].startswith('params/')}


def _saved_knobs(saved: Mapping[str, Any]) -> dict[str, Any]:
  if saved.get('knobs') is not None:
    return {k: v['value'] for k, v in saved['knobs'].items()}
  return flatten_config(saved['config']) if saved.get('config') is not None else {}


def _check_parameters(saved_rows, new_rows, where: str) -> None:
  new_names = [n for n in new_rows if n not in saved_rows]
  gone_names = [n for n in saved_rows if n not in new_rows]
  if new_names or gone_names:
    parts = ([f'new in the model: {_names(new_names)}'] if new_names else []) + \
            ([f'gone from the model: {_names(gone_names)}'] if gone_names else [])
    raise ResumeError('E-PARAM-001', f'{where} does not fit the model: parameters '
                      + '; '.join(parts), _FIX)
  changed = [n for n, row in new_rows.items()
             if list(saved_rows[n]['shape']) != list(row['shape'])
             or saved_rows[n]['dtype'] != row['dtype']]
  if changed:
    details = '; '.join(f'{n} {saved_rows[n]["dtype"]}{list(saved_rows[n]["shape"])} -> '
                        f'{new_rows[n]["dtype"]}{list(new_rows[n]["shape"])}'
                        for n in changed[:_SHOW])
    more = f' (+{len(changed) - _SHOW} more)' if len(changed) > _SHOW else ''
    raise ResumeError('E-PARAM-002', f'{where} does not fit the model: shape or dtype changed: '
                      f'{details}{more}', _FIX)
  flipped = [n for n, row in new_rows.items() if saved_rows[n].get('trainable') is not None
             and bool(saved_rows[n]['trainable']) != bool(row.get('trainable', True))]
  if flipped:
    frozen = [n for n in flipped if saved_rows[n]['trainable']]
    thawed = [n for n in flipped if not saved_rows[n]['trainable']]
    parts = ([f'trainable in the checkpoint, frozen now: {_names(frozen)}'] if frozen else []) + \
            ([f'frozen in the checkpoint, trainable now: {_names(thawed)}'] if thawed else [])
    raise ResumeError('E-PARAM-003', f'{where}: ' + '; '.join(parts),
                      'freeze the same parameters as the run that wrote it, or start a new '
                      '--workdir (initialize it from an export of this one)')


def _check_optimizer(saved_opt, new_opt, where: str) -> None:
  if saved_opt is None or new_opt is None or saved_opt == new_opt:
    return
  keys = sorted(set(saved_opt) | set(new_opt), key=lambda k: (k != GLOBAL_STATES, k))
  changed = [k for k in keys if saved_opt.get(k) != new_opt.get(k)]
  details = '; '.join(f'{k} {saved_opt.get(k, [])} -> {new_opt.get(k, [])}'
                      for k in changed[:3])
  more = f' (+{len(changed) - 3} more)' if len(changed) > 3 else ''
  raise ResumeError('E-OPT-001', f'{where}: the optimizer state structure changed: '
                    f'{details}{more}', 'resume with the optimizer that wrote the checkpoint '
                    '(same transformations in the same chain), or start a new --workdir')


def _check_init_from(saved_pin, new_identity: Mapping[str, Any], where: str) -> None:
  new_pin = new_identity.get('init_from')
  if saved_pin is None and new_pin is None:
    return
  if saved_pin is None:
    raise ResumeError('E-LOAD-001', f'{where} was not initialized from a file, but the config now '
                      f'reads init_from={new_pin["path"]}', 'drop init_from to continue this run, '
                      'or start a new --workdir')
  path = new_pin['path'] if new_pin is not None else saved_pin['path']
  if new_pin is None or new_pin.get('sha256') is None:
    try:
      new_pin = pin_file(path)
    except OSError as e:
      pinned = (f'pinned by {where}' if path == saved_pin['path'] else
                f'(where {where} pinned {saved_pin["path"]})')
      raise ResumeError('E-LOAD-001', f'the init_from file {path} {pinned} cannot be '
                        f'read: {e.strerror or e}', f'restore the file (size {saved_pin["size"]}, '
                        f'sha256 {saved_pin["sha256"]}) or start a new --workdir') from e
  if (new_pin['size'], new_pin['sha256']) != (saved_pin['size'], saved_pin['sha256']):
    raise ResumeError(
        'E-LOAD-001', f'the init_from file {path} differs from the one pinned by {where} '
        f'({saved_pin["path"]}): size {saved_pin["size"]} -> {new_pin["size"]}, sha256 '
        f'{saved_pin["sha256"][:12]} -> {new_pin["sha256"][:12]}',
        f'put back the file with sha256 {saved_pin["sha256"]}, or start a new --workdir')


def _value_lines(kind: str, old: Mapping[str, Any], new: Mapping[str, Any],
                 fmt: Callable[[Any], str]) -> tuple[str, ...]:
  lines = []
  for name in sorted(set(old) | set(new)):
    a, b = old.get(name, _NONE), new.get(name, _NONE)
    if a != b:
      lines.append(f'{kind} {name} {_NONE if a is _NONE else fmt(a)} -> '
                   f'{_NONE if b is _NONE else fmt(b)}')
  return tuple(lines)


def compare(saved: Mapping[str, Any], new: Mapping[str, Any], *,
            where: str = 'the checkpoint') -> Diff:
  """Refuse what cannot resume (`ResumeError`), return what changed and may (`Diff`).

  Args:
    saved: the checkpoint's manifest (or its identity block). Manifests written before the
      identity block existed are compared by their tensor table and config.
    new: `build(...)` for the run about to resume.
    where: how messages name the checkpoint (its path).
  """
  saved_rows = _saved_parameters(saved)
  new_rows = {row['path']: row for row in new.get('parameters') or []}
  if saved_rows is not None and new.get('parameters') is not None:
    _check_parameters(saved_rows, new_rows, where)
  _check_optimizer(saved.get('optimizer'), new.get('optimizer'), where)
  _check_init_from(saved.get('init_from'), new, where)

  # A section one side does not record (a manifest older than it) is not a change.
  both = lambda key: saved.get(key) is not None and new.get(key) is not None
  has_knobs = lambda m: m.get('knobs') is not None or m.get('config') is not None
  knobs = _value_lines('knob', _saved_knobs(saved), _saved_knobs(new),
                       _fmt) if has_knobs(saved) and has_knobs(new) else ()
  sources = _value_lines('source', saved['sources'], new['sources'],
                         lambda h: h[:12]) if both('sources') else ()
  topology = []
  for key in ('devices', 'processes', 'mesh', 'platform'):
    if both(key) and saved[key] != new[key]:
      topology.append(f'{key} {saved[key]} -> {new[key]}')
  versions = _value_lines('version', saved['versions'], new['versions'],
                          str) if both('versions') else ()
  return Diff(knobs=knobs, sources=sources, topology=tuple(topology), versions=versions)


def element_offsets(parameters: Sequence[Mapping[str, Any]]) -> list[tuple[str, int, int]]:
  """[(path, offset, count)]: where each parameter starts in a flat export, in elements."""
  out, offset = [], 0
  for row in parameters:
    count = math.prod(row['shape'])
    out.append((row['path'], offset, count))
    offset += count
  return out


def read_excluded(step_dir: str | os.PathLike, manifest: Mapping[str, Any]) -> dict[str, Any]:
  """{dotted name: array} of the parameters a checkpoint left out (frozen, from `init_from`).

  They are read from the pinned file after checking that it is the same file (size, sha256);
  a different or missing file raises ResumeError E-LOAD-001.
  """
  names = [t['name'] for t in manifest.get('excluded') or []]
  if not names:
    return {}
  pin = manifest.get('init_from') or {}
  path = pin.get('path')
  try:
    now = pin_file(path) if path else None
  except OSError:
    now = None
  if now is None or (now['size'], now['sha256']) != (pin.get('size'), pin.get('sha256')):
    raise ResumeError('E-LOAD-001', f'{step_dir} keeps {len(names)} frozen parameter(s) in '
                      f'its init_from file {path}, which is missing or changed (pinned: size '
                      f'{pin.get("size")}, sha256 {str(pin.get("sha256"))[:12]})',
                      'put the original file back at that path')
  from jaxckpt.export import safetensors_io
  tensors, _ = safetensors_io.read_model(path)
  dotted = {n: '.'.join(n.split('/')[1:]) for n in names}
  return {d: tensors[d] for d in dotted.values()}
