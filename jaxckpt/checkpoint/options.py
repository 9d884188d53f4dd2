"""What a `CheckpointManager` is asked to do (`CheckpointOptions`) and what each commit cost
(`CommitInfo`, handed to `on_commit` callbacks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # light to import: `jaxckpt inspect` reads manifests without numpy or jax
  import numpy as np

from .errors import ArgumentError

MODES = ('auto', 'async', 'sync')

STORAGES = ('auto', 'raw', 'orbax')


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """How and when a manager saves. Zero turns a cadence or retention rule off."""
  every_steps: int = 0  # save when step % every_steps == 0
  every_secs: float = 0.0  # save when this many seconds passed since the last save
  mode: str = 'auto'  # async: stage then write in the background; sync: write inline;
  # auto: async when host memory has room for a staged copy, else
  # write inline from the arrays themselves (no staged copy)
  keep: int = 3  # newest checkpoints kept (0 keeps all)
  keep_every: int = 0  # steps divisible by this are kept forever
  verify_checksums: bool = True  # check every file's CRC before restoring it
  storage: str = 'auto'  # raw: jaxckpt's flat file; orbax: tensorstore; auto: raw when

  # one process holds every array, orbax across processes

  def __post_init__(self):
    if self.mode not in MODES:
      raise ArgumentError('E-CONFIG-004', f'checkpoint mode {self.mode!r} is not one of '
                          f'{MODES}', 'use auto, async or sync')
    if self.storage not in STORAGES:
      raise ArgumentError('E-CONFIG-004', f'checkpoint storage {self.storage!r} is not one of '
                          f'{STORAGES}', 'use auto, raw or orbax')
    for field in ('every_steps', 'every_secs', 'keep', 'keep_every'):
      if getattr(self, field) < 0:
        raise ArgumentError('E-CONFIG-004', f'checkpoint {field}={getattr(self, field)} is '
                            'negative', 'use 0 to turn it off')


@dataclasses.dataclass(frozen=True)
class CommitInfo:
  """What one committed save cost; handed to `on_commit` callbacks."""
  step: int
  path: Path
  bytes: int
  seconds_blocked: float  # the caller's wait: previous save + device->host copy
  seconds_to_commit: float  # from the call of save() to the manifest being durable
  deleted: tuple[int, ...]  # older steps removed by retention after this commit
  # Older steps retention could not remove, with why ('step 100: PermissionError: ...'). The
  # commit stands; the next commit tries again, and the next writer's start removes half-deleted
  # ones as debris.
  retention_errors: tuple[str, ...] = ()
  # The host copy that was just written, by leaf name ('params/h/0/attn/c_attn/kernel', ...).
  # IMPORTANT: valid only until the next save starts (it reuses these buffers). The next save
  # waits for the callback, so reading them inside it (e.g. to export) is safe; keep no reference.
  staged: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
