"""When to save and what to keep: small pure functions, tested with a fake clock."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping


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


# A checkpoint's manifest says why it is kept, under this key (`RetentionPolicy.record`).
RECORD = 'retention'
KEEP_EVERY, BEST, UNREADABLE = 'keep_every', 'best', 'unreadable'


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
  """Keep the newest `keep` checkpoints (0 = all), every step divisible by `keep_every`, and the
  `keep_best` with the lowest metric (a checkpoint without one never counts as best).

  The flags are read by each invocation, but what they keep is a property of each checkpoint:
  its manifest records why it is kept (`record`), and no later invocation deletes it, whatever
  flags it passes (`pins`, handed to `to_delete`).
  """
  keep: int = 3
  keep_every: int = 0
  keep_best: int = 0

  def record(self, step: int, best_metric: str) -> dict[str, Any]:
    """What the manifest of checkpoint `step` says about keeping it, decided as it commits.

    `kept` holds the reasons that keep it for good (`keep_every`: its step was divisible by
    `keep_every` when it was written). `best` keeps it while it is among the `among` lowest
    `metric` of the checkpoints that are candidates for best (those whose manifests say `best`).
    """
    out: dict[str, Any] = {
        'kept': [KEEP_EVERY] if self.keep_every and step % self.keep_every == 0 else []
    }
    if self.keep_every:
      out[KEEP_EVERY] = self.keep_every
    if self.keep_best:
      out[BEST] = {'metric': best_metric, 'among': self.keep_best}
    return out

  def to_delete(self,
                committed: Iterable[int],
                metric: Mapping[int, float] | None = None,
                *,
                newest: int | None = None,
                pinned: Iterable[int] = ()) -> list[int]:
    """Steps to delete from `committed` ({step: metric} where one was recorded).

    `newest` is the step just committed (default: the highest). It is never deleted, nor is any
    step numbered above it: after a resume from an older checkpoint those belong to an
    abandoned history, which the replay replaces step by step as it reaches them. The newest
    `keep` are counted in this history, the steps up to `newest`. `pinned` steps (`pins`: their
    own manifests say they are kept) are never deleted, whatever this policy's flags.
    """
    steps = sorted(committed)
    if newest is None:
      newest = steps[-1] if steps else 0
    history = [s for s in steps if s <= newest]
    if not history or self.keep <= 0:
      return []
    kept = set(history[-self.keep:]) | {newest} | set(pinned)
    if self.keep_every > 0:
      kept |= {s for s in history if s % self.keep_every == 0}
    if self.keep_best > 0:
      scored = sorted((v, s) for s, v in (metric or {}).items() if s in set(steps) and v == v)
      kept |= {s for _, s in scored[:self.keep_best]}  # ties: the earlier step
    return [s for s in history if s not in kept]


def pins(records: Mapping[int, Mapping[str, Any] | None]) -> dict[int, list[str]]:
  """{step: why its own manifest keeps it} of the steps whose manifests say they are kept.

  `records` maps each committed step to the two fields of its manifest that matter here,
  `{'retention': ..., 'metrics': ...}` (`manifest_fields`), or to None when its manifest cannot
  be read: such a step may be kept, so it is treated as kept (`UNREADABLE`), as is one whose
  fields are not of the types a writer gives them (`malformed`: a manifest is read from disks
  and buckets, and doubt never deletes). A `best` record counts while the step is among its
  `among` lowest `metric` of the steps whose records name the same metric (ties: the earlier
  step); a step without a finite value is never best.
  """
  out: dict[int, list[str]] = {}
  contenders: dict[str, list[tuple[float, int]]] = {}
  for step, fields in records.items():
    if fields is None or malformed(fields):
      out[step] = [UNREADABLE]
      continue
    record = fields.get(RECORD) or {}
    kept = list(record.get('kept') or ())
    if kept:
      out[step] = kept
    best = record.get(BEST)
    if best is not None:
      value = (fields.get('metrics') or {}).get(best['metric'])
      if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        contenders.setdefault(best['metric'], []).append((float(value), step))
  for scored in contenders.values():
    for rank, (_, step) in enumerate(sorted(scored)):
      if rank < (records[step] or {})[RECORD][BEST].get('among', 0):
        out.setdefault(step, []).append(BEST)
  return dict(sorted(out.items()))


def malformed(fields: Any) -> str | None:
  """Why `manifest_fields` `fields` are not of the types `RetentionPolicy.record` and a writer's
  metrics give them (None: they are): `retention` an object or absent, its `kept` a list of
  reasons, its `best` {metric: name, among: count}; `metrics` an object or absent."""
  if not isinstance(fields, Mapping):
    return 'not an object'
  record, metrics = fields.get(RECORD), fields.get('metrics')
  if metrics is not None and not isinstance(metrics, Mapping):
    return f'metrics is {type(metrics).__name__}, not an object'
  if record is None:
    return None
  if not isinstance(record, Mapping):
    return f'{RECORD} is {type(record).__name__}, not an object'
  kept = record.get('kept')
  if kept is not None and (not isinstance(kept, list) or not all(isinstance(r, str) for r in kept)):
    return f'{RECORD}.kept is not a list of reasons'
  best = record.get(BEST)
  if best is None:
    return None
  among = best.get('among', 0) if isinstance(best, Mapping) else None
  if not isinstance(best, Mapping) or not isinstance(best.get('metric'), str) or \
      type(among) is not int or among < 0:  # pylint: disable=unidiomatic-typecheck
    return f'{RECORD}.{BEST} is not {{"metric": <name>, "among": <count>}}'
  return None


def manifest_fields(m: Mapping[str, Any]) -> dict[str, Any] | None:
  """What `pins` reads of a manifest; None when it is `malformed` (read as kept, like a manifest
  that cannot be read)."""
  fields = {RECORD: m.get(RECORD), 'metrics': m.get('metrics')}
  return None if malformed(fields) else fields
