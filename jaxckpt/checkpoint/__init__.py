"""jaxckpt.checkpoint: an async, preemption-safe checkpoint manager for any JAX loop.

It imports nothing of the trainer; see `CheckpointManager`.
"""

from jaxckpt.checkpoint.layout import committed_steps, step_dirname
from jaxckpt.checkpoint.manager import (CheckpointManager, CheckpointOptions, CommitInfo,
                                        named_leaves)
from jaxckpt.checkpoint.policy import RetentionPolicy, SavePolicy

__all__ = ['CheckpointManager', 'CheckpointOptions', 'CommitInfo', 'RetentionPolicy',
           'SavePolicy', 'committed_steps', 'named_leaves', 'step_dirname']
