"""What a checkpoint is, and whether a run may continue from it.

`build(...)` assembles the identity block a checkpoint's `manifest.json` carries (it is passed to
`CheckpointManager.save(..., metadata=...)` and lands at the top level of the manifest):

    knobs       every config leaf: {'train.lr': {'value': 0.001, 'source': 'flag'}, ...}
    sources     sha256 of every module of the jaxckpt package and of the config file, and a
                fingerprint of each data source's files ('data:main': count, sizes, both ends)
    parameters  [{path, shape, dtype, trainable, spec}] in canonical (flat `.bin`) order
    optimizer   optimizer state names per parameter: {'wte.embedding': ['1/0/mu', '1/0/nu'], ...}
    counters, seed, mesh, devices, processes, platform, versions, finished, init_from (optional)

`compare(saved_manifest, new_identity)` is the resume check. It raises `ResumeError` (exit 2, one
line with the fix) for what cannot continue:

    E-PARAM-001  a parameter new or gone          E-PARAM-002  a shape or dtype changed
    E-PARAM-003  trainable <-> frozen changed     E-OPT-001    the optimizer state structure changed

(`init_from` pins are compared per file by `jaxckpt.train.init_from.check_resume`.)

and returns a `Diff` of what may change and is recorded, one line each:

    knob train.lr 0.001 -> 0.0005
    source jaxckpt/model/gpt.py 91d77bdc76be -> b05c928e631c
    devices 8 -> 4
    mesh {'data': 4, 'model': 2} -> {'data': 4, 'model': 1}
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
from pathlib import PurePath
from typing import Any, Callable, Mapping, Sequence

from jaxckpt.errors import ResumeError
from jaxckpt.model import names
from jaxckpt.records.provenance import (DATA_KEY, flatten_config, jsonable, knob_table,
                                        source_hashes)
from jaxckpt.records.provenance import versions as package_versions

_NONE = '(none)'
_SHOW = 5  # names listed in a refusal before "(+k more)"
_FIX = ('resume with the config that wrote the checkpoint (`jaxckpt inspect CKPT` shows it), '
        'or start a new --workdir')


# ------------------------------------------------------------------ parameters, optimizer
def _spec_str(spec_or_sharding) -> str | None:
  spec = getattr(spec_or_sharding, 'spec', spec_or_sharding)
  return None if spec is None else str(tuple(spec))


def trainable_fn(frozen: Sequence[str] = ()) -> Callable[[str], bool]:
  """A `trainable(dotted name)` predicate: frozen are the names matching a glob in `frozen`."""
  frozen = tuple(frozen)
  return lambda name: not any(fnmatch.fnmatchcase(name, pattern) for pattern in frozen)


def parameter_table(params_tree,
                    partition_specs=None,
                    trainable: Callable[[str], bool] = lambda name: True,
                    *,
                    order: Sequence[str] | None = None) -> list[dict[str, Any]]:
  """One row per parameter: {path, shape, dtype, trainable, spec}.

  Args:
    params_tree: the params (arrays or `jax.ShapeDtypeStruct`s).
    partition_specs: a tree like `params_tree` of `PartitionSpec`s or `NamedSharding`s, or None
      (then each leaf's own `.sharding` is used when it has one).
    trainable: dotted name -> whether the optimizer updates it.
    order: dotted names in canonical order (`jaxckpt.model.gpt.parameter_names(config.model)`);
      rows follow it, so cumulative element counts are offsets in the flat `.bin` export.
  """
  import jax
  import numpy as np
  leaves = jax.tree_util.tree_flatten_with_path(params_tree)[0]
  if partition_specs is None:
    specs = [getattr(x, 'sharding', None) for _, x in leaves]
  else:
    specs = jax.tree_util.tree_leaves(
        partition_specs,
        is_leaf=lambda s: s is None or hasattr(s, 'spec') or type(s).__name__ == 'PartitionSpec')
    if len(specs) != len(leaves):
      raise ValueError(f'{len(specs)} partition specs for {len(leaves)} parameters')
  rows = {}
  for (path, x), spec in zip(leaves, specs):
    name = names.dotted(path)
    rows[name] = {
        'path': name, 'shape': [int(d) for d in np.shape(x)], 'dtype': str(np.dtype(x.dtype)),
        'trainable': bool(trainable(name)), 'spec': _spec_str(spec)
    }
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
    state = '/'.join(
        str(getattr(k, 'name', getattr(k, 'idx', getattr(k, 'key', k)))) for k in path[:split])
    param = names.dotted(path[split:]) if split < len(path) else GLOBAL_STATES
    table.setdefault(param, []).append(state)
  return {k: sorted(v) for k, v in sorted(table.items())}


# ------------------------------------------------------------------------------ identity
def build(*,
          config,
          params,
          opt_state,
          partition_specs=None,
          mesh_shape: Mapping[str, int],
          devices: int,
          processes: int = 1,
          platform: str | None = None,
          knobs: Mapping[str, Any] | None = None,
          sources: Mapping[str, str] | None = None,
          trainable: Callable[[str], bool] = lambda name: True,
          counters: Mapping[str, Any] | None = None,
          finished: bool = False,
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
    versions: default `jaxckpt.records.provenance.versions()`.
  """
  from jaxckpt.model import gpt as model_lib
  if versions is None:
    versions = package_versions()
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
      'counters': jsonable(dict(counters or {})),
      'seed': jsonable(config.get('seed') if hasattr(config, 'get') else None),
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
  return jsonable(identity)


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
  return {
      names.dotted_of_params_leaf(t['name']): {**t, 'trainable': None}
      for t in saved['tensors']
      if t['name'].startswith('params/')
  }


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
    raise ResumeError('E-PARAM-001',
                      f'{where} does not fit the model: parameters ' + '; '.join(parts), _FIX)
  changed = [
      n for n, row in new_rows.items() if list(saved_rows[n]['shape']) != list(row['shape'])
      or saved_rows[n]['dtype'] != row['dtype']
  ]
  if changed:
    details = '; '.join(f'{n} {saved_rows[n]["dtype"]}{list(saved_rows[n]["shape"])} -> '
                        f'{new_rows[n]["dtype"]}{list(new_rows[n]["shape"])}'
                        for n in changed[:_SHOW])
    more = f' (+{len(changed) - _SHOW} more)' if len(changed) > _SHOW else ''
    raise ResumeError(
        'E-PARAM-002', f'{where} does not fit the model: shape or dtype changed: '
        f'{details}{more}', _FIX)
  flipped = [
      n for n, row in new_rows.items() if saved_rows[n].get('trainable') is not None
      and bool(saved_rows[n]['trainable']) != bool(row.get('trainable', True))
  ]
  if flipped:
    frozen = [n for n in flipped if saved_rows[n]['trainable']]
    thawed = [n for n in flipped if not saved_rows[n]['trainable']]
    parts = ([f'trainable in the checkpoint, frozen now: {_names(frozen)}'] if frozen else []) + \
            ([f'frozen in the checkpoint, trainable now: {_names(thawed)}'] if thawed else [])
    raise ResumeError(
        'E-PARAM-003', f'{where}: ' + '; '.join(parts),
        'freeze the same parameters as the run that wrote it, or start a new '
        '--workdir (initialize it from an export of this one)')


def _check_optimizer(saved_opt, new_opt, where: str) -> None:
  if saved_opt is None or new_opt is None or saved_opt == new_opt:
    return
  keys = sorted(set(saved_opt) | set(new_opt), key=lambda k: (k != GLOBAL_STATES, k))
  changed = [k for k in keys if saved_opt.get(k) != new_opt.get(k)]
  details = '; '.join(f'{k} {saved_opt.get(k, [])} -> {new_opt.get(k, [])}' for k in changed[:3])
  more = f' (+{len(changed) - 3} more)' if len(changed) > 3 else ''
  raise ResumeError(
      'E-OPT-001', f'{where}: the optimizer state structure changed: '
      f'{details}{more}', 'resume with the optimizer that wrote the checkpoint '
      '(same transformations in the same chain), or start a new --workdir')


def _value_lines(kind: str, old: Mapping[str, Any], new: Mapping[str, Any],
                 fmt: Callable[[Any], str]) -> tuple[str, ...]:
  lines = []
  for name in sorted(set(old) | set(new)):
    a, b = old.get(name, _NONE), new.get(name, _NONE)
    if a != b:
      lines.append(f'{kind} {name} {_NONE if a is _NONE else fmt(a)} -> '
                   f'{_NONE if b is _NONE else fmt(b)}')
  return tuple(lines)


def _path_parts(key: str) -> list[str]:
  """A path's names, without what only its spelling adds (the root, `./`, `../`)."""
  return [p for p in PurePath(os.path.normpath(key)).parts if p not in (os.sep, '.', '..')]


def _same_file(a: str, b: str) -> bool:
  """Whether two spellings can name one file: one ends the other (`configs/tiny.py`,
  `/abs/configs/tiny.py`)."""
  a_parts, b_parts = _path_parts(a), _path_parts(b)
  n = min(len(a_parts), len(b_parts))
  return n > 0 and a_parts[-n:] == b_parts[-n:]


def _source_lines(old: Mapping[str, str], new: Mapping[str, str]) -> tuple[str, ...]:
  """The `source` lines. Package modules have one name (`jaxckpt/model/gpt.py`), but the config
  file and its `default.py` are named as the command line typed them: one named on one side only
  is compared as the one name on the other side that spells the same file, and its line names
  it as the resuming run does."""
  old = dict(old)
  if not any(k.startswith(DATA_KEY) for k in old):  # a checkpoint from before data fingerprints
    new = {k: v for k, v in new.items() if not k.startswith(DATA_KEY)}
  gone = [k for k in old if k not in new and not k.startswith('jaxckpt/')]
  for key in [k for k in new if k not in old and not k.startswith('jaxckpt/')]:
    same = [k for k in gone if _same_file(k, key)]
    if len(same) == 1:
      old[key] = old.pop(same[0])
      gone.remove(same[0])
  return _value_lines('source', old, new, lambda h: h[:12])


def compare(saved: Mapping[str, Any],
            new: Mapping[str, Any],
            *,
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

  # A section one side does not record (a manifest older than it) is not a change.
  both = lambda key: saved.get(key) is not None and new.get(key) is not None
  has_knobs = lambda m: m.get('knobs') is not None or m.get('config') is not None
  knobs = _value_lines('knob', _saved_knobs(saved), _saved_knobs(new),
                       _fmt) if has_knobs(saved) and has_knobs(new) else ()
  sources = _source_lines(saved['sources'], new['sources']) if both('sources') else ()
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
