"""Names of a state's leaves, and the tensor table a manifest keeps of them.

A leaf's name is its tree path joined by '/': `params/h/0/attn/c_attn/kernel`,
`opt_state/1/0/mu/wte/embedding`. Saves, restores and subset reads (`only=`) all speak it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from .errors import ArgumentError, CheckpointError


def leaf_name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator='/')


def named_leaves(tree) -> dict[str, Any]:
  """{'params/h/0/attn/c_attn/kernel': leaf, ...} in tree order."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  names = _NAMES.get(treedef)
  if names is None:
    # Building 449 path strings costs ~1 ms, on every save; a tree structure's names never change.
    if len(_NAMES) >= 64:
      _NAMES.clear()
    names = tuple(leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    _check_names(names)
    _NAMES[treedef] = names
  return dict(zip(names, leaves))


def _check_names(names: tuple[str, ...]) -> None:
  """Each leaf has a name of its own (`{'a/b': x, 'a': {'b': y}}` would give two leaves one
  tensor), and none is the safetensors header's `__metadata__`."""
  seen: dict[str, int] = {}
  for i, name in enumerate(names):
    if name == '__metadata__' or name in seen:
      why = ('is the name safetensors keeps for its header'
             if name == '__metadata__' else f'names leaves {seen[name]} and {i} of the tree')
      raise ArgumentError('E-CKPT-021', f'leaf name {name!r} {why}',
                          "rename a key: a leaf's name is its path joined by '/'")
    seen[name] = i


_NAMES: dict[Any, tuple[str, ...]] = {}


def avals(leaves: Mapping[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
  """{name: (shape, dtype, sharding)}: what `tensor_table` needs, without holding the arrays."""
  return {n: (np.shape(x), x.dtype, getattr(x, 'sharding', None)) for n, x in leaves.items()}


def tensor_table(avals: Mapping[str, tuple[Any, Any, Any]]) -> list[dict[str, Any]]:
  """The manifest's tensor list: name, shape, dtype and partition spec of each leaf."""
  return [{'name': n, 'shape': list(shape), 'dtype': str(np.dtype(dtype)), 'spec': _spec(sharding)}
          for n, (shape, dtype, sharding) in avals.items()]


def _spec(sharding) -> str | None:
  spec = getattr(sharding, 'spec', None)
  return None if spec is None else str(tuple(spec))


def check_fits(step_dir: Path, saved: Mapping[str, Any], want: Mapping[str, Any]) -> None:
  new, gone = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
  if new or gone:
    raise CheckpointError(
        'E-PARAM-001', f'{step_dir} does not fit this model: ' + '; '.join(
            filter(None, [f'new {new[:5]}' if new else '', f'gone {gone[:5]}' if gone else ''])),
        'resume with the config that wrote it, or start a new workdir')
  for name, x in want.items():
    s = saved[name]
    if tuple(s['shape']) != tuple(x.shape) or s['dtype'] != str(np.dtype(x.dtype)):
      raise CheckpointError(
          'E-PARAM-002', f'{name}: checkpoint has {s["dtype"]}{s["shape"]}, '
          f'model wants {np.dtype(x.dtype)}{list(x.shape)}',
          'resume with the config that wrote it, or start a new workdir')
