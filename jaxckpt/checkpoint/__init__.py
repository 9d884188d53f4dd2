"""An async, preemption-safe checkpoint manager for any JAX loop.

It imports nothing outside itself: the package can be copied into another project and used
alone (see `CheckpointManager`). The manager (and with it jax and orbax) is imported on first
use, so light tools can read manifests through `manifest`, `layout` and `discovery` without
paying for jax.

    manager     CheckpointManager: async save, atomic commit, retention, restore
    formats     which state format a checkpoint holds (safetensors, the first raw format, orbax)
    options     CheckpointOptions (cadence, mode, retention) and CommitInfo (what a commit cost)
    staging     the device -> host copy a save waits for, into one page-aligned region
    statefile   the state as one safetensors file, O_DIRECT; orbaxstore: orbax-checkpoint's files;
                rawstore: reads the first format (arrays.bin + index.json)
    multihost   across jax.distributed processes: each writes the shards it owns, one commit;
                restores read each process's byte ranges, whatever process count wrote them
    directio    aligned buffers and O_DIRECT I/O with its fallbacks
    manifest    the commit marker: every file's size and CRC-32, the tensor table, its seal
    layout      names on disk, committed steps, debris;  atomic: durable writes and swaps
    discovery   the newest intact checkpoint; checking one while a live run changes it
    abandoned   checkpoints a run left above the older one it went back to: never the newest
    single_writer  one writer per directory: a lock from open to close (E-CKPT-020)
    policy      when to save and what to keep;  retention: deleting what it lets go
    signals     preemption signals as flags
    cadence     how often to save: Young-Daly from a checkpoint's cost and the interruption rate
    tree        leaf names and tensor tables;  checksum: CRC-32;  errors: CheckpointError
"""

import importlib

from .cadence import CadenceOptions
from .errors import ArgumentError, CheckpointError
from .layout import committed_steps, step_dirname
from .options import CheckpointOptions, CommitInfo
from .policy import RetentionPolicy, SavePolicy

_LAZY = {
    'CheckpointManager': 'manager', 'CheckpointOptions': 'manager', 'CommitInfo': 'manager',
    'named_leaves': 'tree'
}

__all__ = [
    'ArgumentError', 'CadenceOptions', 'CheckpointError', 'CheckpointManager', 'CheckpointOptions',
    'CommitInfo', 'RetentionPolicy', 'SavePolicy', 'committed_steps', 'named_leaves', 'step_dirname'
]


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(f'{__name__}.{_LAZY[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
