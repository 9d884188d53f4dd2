"""What `CheckpointManager.save` checks at the call, before anything is staged or written.

A save that cannot be restored must not be committed: the step is a step number, every leaf is
an array that still holds its bytes, and `metadata` leaves the manifest's own fields to the
library (a `files` or `tensors` key of the caller's would stand in for the checksums a reader
verifies). Each is an `ArgumentError` (E-CKPT-021) naming what is wrong, raised in the caller's
thread; nothing of that save is written.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import jax

from . import manifest, shardtable
from .errors import ArgumentError, CheckpointError
from .options import whole

# The manifest's fields the library writes (`manifest.build`, the manager's `_write`,
# `jobcommit.listing`, the seal): never the caller's metadata.
RESERVED = frozenset({
    'format', 'format_version', 'step', 'committed_at', 'tensors', 'files', 'excluded', 'storage',
    'retention', 'state_files', shardtable.KEY, manifest.SEAL
})


def step(value: Any) -> int:
  """`value` as a step: an int (a numpy integer too; not a bool) of 0 or more."""
  if whole(value) and value >= 0:
    return int(value)
  raise ArgumentError('E-CKPT-021', f'step {value!r} ({type(value).__name__}) is not a step '
                      'number', 'pass an int of 0 or more')


def leaves(named: Mapping[str, Any]) -> None:
  """Every leaf is an array (a shape and a dtype) whose buffers are still there: a donated or
  deleted `jax.Array` has nothing to save."""
  for name, x in named.items():
    if not (hasattr(x, 'shape') and hasattr(x, 'dtype')):
      raise ArgumentError('E-CKPT-021', f'leaf {name!r} is a {type(x).__name__}, not an array',
                          'pass arrays (jnp.asarray(x)), or put plain values in run_state')
    if isinstance(x, jax.Array) and x.is_deleted():
      raise ArgumentError('E-CKPT-021',
                          f'leaf {name!r} was deleted (donated to a jitted call) before save',
                          'save the state a step returns before it is donated to the next step')


def metadata_keys(metadata: Mapping[str, Any] | None) -> None:
  taken = sorted(RESERVED.intersection(metadata or {}))
  if taken:
    raise ArgumentError('E-CKPT-021',
                        f'metadata key(s) {", ".join(taken)} are the manifest\'s own fields',
                        'use other keys (nest yours under one, e.g. {"user": {...}})')


def json_bytes(obj: Any) -> bytes:
  """`obj` as indented JSON with a final newline; E-CKPT-011 when it is not JSON."""
  try:
    return (json.dumps(obj, indent=1) + '\n').encode()
  except (TypeError, ValueError) as e:
    raise CheckpointError('E-CKPT-011', f'run_state and metadata must be JSON: {e}',
                          'pass plain dicts, lists, strings and numbers') from e


def closed(what: str) -> ArgumentError:
  return ArgumentError('E-CKPT-022', f'{what} on a CheckpointManager that was closed',
                       'open a new CheckpointManager on the directory')


__all__ = ['RESERVED', 'closed', 'json_bytes', 'leaves', 'metadata_keys', 'step']
