"""What a `CheckpointManager` is asked to do (`CheckpointOptions`) and what each commit cost
(`CommitInfo`, handed to `on_commit` callbacks)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # light to import: `jaxckpt inspect` reads manifests without numpy or jax
  import numpy as np

from .errors import ArgumentError

MODES = ('auto', 'async', 'sync')

STORAGES = ('auto', 'safetensors', 'orbax')
STAGINGS = ('auto', 'host', 'device')
_ALIASES = {'raw': 'safetensors'}  # the name of jaxckpt's single-file store before safetensors


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
  """How and when a manager saves. Zero turns a cadence or retention rule off.

  mode: async stages the state to host memory and writes it in the background; sync writes
    inline; auto is async when host memory has room for a staged copy, else it writes inline
    from the arrays themselves, holding no staged copy.
  staging: host copies the state to host memory before `save` returns; device copies it on the
    devices (the loop waits for that alone) and to host memory in the background, at the cost of
    a second copy of the state in device memory while the save is in flight; auto is device when
    the devices report room for that twice over, else host (always host on a CPU).
  storage: safetensors is one safetensors file at disk speed (`statefile`); orbax is
    orbax-checkpoint's tensorstore files (across processes too, with orbax's own commit); auto
    is safetensors: across processes, one file per process holding the shards it owns.
  """
  every_steps: int = 0  # save when step % every_steps == 0
  every_secs: float = 0.0  # save when this many seconds passed since the last save
  mode: str = 'auto'  # auto | async | sync
  keep: int = 3  # newest checkpoints kept (0 keeps all)
  keep_every: int = 0  # steps divisible by this are kept forever
  keep_best: int = 0  # also keep the N checkpoints with the lowest `best_metric` (0: off)
  best_metric: str = 'heldout_loss'  # a number in the manifest's `metrics` (save(metadata=...))
  verify_checksums: bool = True  # check every file's CRC before restoring it
  storage: str = 'auto'  # auto | safetensors | orbax
  staging: str = 'auto'  # auto | host | device
  # Across processes (jax.distributed): how long a save waits for every process to make its part
  # durable, and for process 0's commit, before it fails naming the ones missing.
  barrier_timeout_secs: float = 600.0
  # Each host's own disk (across processes): also keep the parts of this many other processes
  # (`replicas`), so a host lost with its disk is restored from its peers (`peers`).
  replicas: int = 0

  def __post_init__(self):
    if self.mode not in MODES:
      raise ArgumentError('E-CONFIG-004', f'checkpoint mode {self.mode!r} is not one of '
                          f'{MODES}', 'use auto, async or sync')
    object.__setattr__(self, 'storage', _ALIASES.get(self.storage, self.storage))
    if self.storage not in STORAGES:
      raise ArgumentError('E-CONFIG-004', f'checkpoint storage {self.storage!r} is not one of '
                          f'{STORAGES}', 'use auto, safetensors or orbax')
    if self.staging not in STAGINGS:
      raise ArgumentError('E-CONFIG-004', f'checkpoint staging {self.staging!r} is not one of '
                          f'{STAGINGS}', 'use auto, host or device')
    for field in COUNTS:
      value = getattr(self, field)
      if not whole(value) or value < 0:
        raise ArgumentError('E-CONFIG-004', f'checkpoint {field}={value!r} is not a whole number '
                            'of 0 or more', 'pass an int (0 turns it off)')
      object.__setattr__(self, field, int(value))  # numpy integers too: JSON and retention want int
    for field, least in (('every_secs', 'of 0 or more'), ('barrier_timeout_secs', 'above 0')):
      value, secs = getattr(self, field), finite(getattr(self, field))
      if secs is None or secs < 0 or (secs == 0 and field == 'barrier_timeout_secs'):
        raise ArgumentError(
            'E-CONFIG-004', f'checkpoint {field}={value!r} is not a finite number '
            f'of seconds {least}', 'pass a number of seconds' +
            (' (0 turns it off)' if field == 'every_secs' else ', e.g. 600'))
      object.__setattr__(self, field, secs)


# The options that count (steps, checkpoints, processes): ints of 0 or more, 0 turning them off.
COUNTS = ('every_steps', 'keep', 'keep_every', 'keep_best', 'replicas')


def whole(value: Any) -> bool:
  """An int or a numpy integer, not a bool (True would be a keep of 1; numpy's bool is neither)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def finite(value: Any) -> float | None:
  """`value` as a finite float (an int or float, numpy's too; not a bool); None when it is not
  one (NaN, inf, a string, an int too large for a float)."""
  if not isinstance(value, numbers.Real) or isinstance(value, bool):
    return None
  try:
    secs = float(value)
  except OverflowError:
    return None
  return secs if math.isfinite(secs) else None


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
  staging: str = 'host'  # where the state was copied first: host memory, or the devices
  # The host copy that was just written, by leaf name ('params/h/0/attn/c_attn/kernel', ...).
  # IMPORTANT: valid only until the next save starts (it reuses these buffers). The next save
  # waits for the callback, so reading them inside it (e.g. to export) is safe; keep no reference.
  staged: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict, repr=False)
  # {state file: `staging.InMemory`}: the files of this commit still in host memory, which an
  # upload reads instead of the disk. Safe to keep: once the next save stages over the buffer
  # they answer None (read the file then).
  in_memory: Mapping[str, Any] = dataclasses.field(default_factory=dict, repr=False)
  # With `replicas`: the fewest copies of any process's part on other hosts, each confirmed by
  # size and CRC-32, the same on every process (0: a part is on its owner's disk alone, and the
  # peer tier does not cover this checkpoint); None without replicas.
  replicas: int | None = None
