"""When to save and what to keep: small pure functions, tested with a fake clock."""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class SavePolicy:
  """Save every `every_steps` steps and/or every `every_secs` seconds (0 turns either off).

  Time-based saves are measured from the last save (or the start of the run), so a run that is
  restarted often still gets a checkpoint at least every `every_secs` seconds of training.
  """
  every_steps: int = 0
  every_secs: float = 0.0

  def due(self, step: int, now: float, last_save_step: int, last_save_time: float) -> bool:
    if step <= last_save_step:
      return False
    if self.every_steps and step % self.every_steps == 0:
      return True
    return bool(self.every_secs) and now - last_save_time >= self.every_secs


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
  """Keep the newest `keep` checkpoints (0 = all), every step divisible by `keep_every`, and the
  `keep_best` with the lowest metric (a checkpoint without one never counts as best)."""
  keep: int = 3
  keep_every: int = 0
  keep_best: int = 0

  def to_delete(self,
                committed: Iterable[int],
                metric: Mapping[int, float] | None = None) -> list[int]:
    """Steps to delete from `committed` ({step: metric} where one was recorded); the newest
    committed step is never among them."""
    steps = sorted(committed)
    if not steps or self.keep <= 0:
      return []
    kept = set(steps[-max(self.keep, 1):])
    if self.keep_every > 0:
      kept |= {s for s in steps if s % self.keep_every == 0}
    if self.keep_best > 0:
      scored = sorted((v, s) for s, v in (metric or {}).items() if s in set(steps) and v == v)
      kept |= {s for _, s in scored[:self.keep_best]}  # ties: the earlier step
    return [s for s in steps if s not in kept]
