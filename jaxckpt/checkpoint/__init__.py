"""jaxckpt.checkpoint: an async, preemption-safe checkpoint manager for any JAX loop.

It imports nothing of the trainer; see `CheckpointManager`. The manager (and with it jax and
orbax) is imported on first use, so light tools (`jaxckpt inspect`) can read manifests through
`jaxckpt.checkpoint.manifest` and `layout` without paying for jax.
"""

import importlib

from jaxckpt.checkpoint.layout import committed_steps, step_dirname
from jaxckpt.checkpoint.policy import RetentionPolicy, SavePolicy

_LAZY = {'CheckpointManager': 'manager', 'CheckpointOptions': 'manager', 'CommitInfo': 'manager',
         'named_leaves': 'manager'}

__all__ = ['CheckpointManager', 'CheckpointOptions', 'CommitInfo', 'RetentionPolicy',
           'SavePolicy', 'committed_steps', 'named_leaves', 'step_dirname']


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f'jaxckpt.checkpoint.{_LAZY[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
