"""Parameter names: the dotted names of the model and exports, and the checkpoint's leaf names.

    dotted name   h.0.attn.c_attn.kernel                (exports, .bin order, the manifest)
    leaf name     params/h/0/attn/c_attn/kernel          (the checkpoint's tensors)
                  opt_state/1/0/mu/h/0/attn/c_attn/kernel (its Adam m; nu is Adam v)

This module is the one place that turns one into the other.
"""

from __future__ import annotations

from typing import Iterable

# Where optax's Adam keeps its moments inside `opt_state`, and what exports call them.
_ADAM = {'mu': 'm', 'nu': 'v'}


def dotted(path: Iterable) -> str:
  """The dotted name of a jax tree path (`tree_flatten_with_path`'s keys)."""
  return '.'.join(
      str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', None)))) for key in path)


def param_of_leaf(leaf: str) -> tuple[str, str] | None:
  """Which parameter tensor a checkpoint leaf is: (kind, dotted name), or None.

  kind is 'params', 'm' (Adam mu) or 'v' (Adam nu):
    'params/h/0/attn/c_attn/kernel'        -> ('params', 'h.0.attn.c_attn.kernel')
    'opt_state/1/0/mu/h/0/attn/c_attn/bias' -> ('m', 'h.0.attn.c_attn.bias')
    'opt_state/1/0/nu/wte/embedding'        -> ('v', 'wte.embedding')
    'opt_state/1/0/count'                  -> None (a counter, not a tensor of the model)
  The position of Adam's state inside the optax chain (`1/0` here) is not assumed: the moments
  are found by their `mu`/`nu` component. `leaf_of_param` is the inverse for weights.
  """
  parts = leaf.split('/')
  if parts[0] == 'params':
    return 'params', '.'.join(parts[1:])
  if parts[0] == 'opt_state':
    for i, part in enumerate(parts):
      if part in _ADAM:
        return _ADAM[part], '.'.join(parts[i + 1:])
  return None


def leaf_of_param(name: str, under: str = 'params') -> str:
  """The leaf name of dotted parameter `name` under a state path: `params/h/0/...`, or e.g.
  `opt_state/frozen/mu/h/0/...` for one of its optimizer states."""
  return f'{under}/{name.replace(".", "/")}'


def dotted_of_params_leaf(leaf: str) -> str | None:
  """`params/h/0/attn/c_attn/kernel` -> `h.0.attn.c_attn.kernel`; None for any other leaf."""
  kind_name = param_of_leaf(leaf)
  return kind_name[1] if kind_name and kind_name[0] == 'params' else None
