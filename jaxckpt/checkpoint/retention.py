"""Deleting what the retention policy lets go, right after a commit (`CheckpointManager`).

What a checkpoint's own manifest says is kept (`policy.pins`) is never deleted here, whatever
the flags of the run deleting: only `jaxckpt delete CKPT --kept` removes it. `keep` does not
count a checkpoint a run abandoned when it went back to an older one (`abandoned`); one numbered
above the step just committed stays (the replay replaces it), one below it goes (the replay
passed it without saving it again), unless its manifest keeps it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import abandoned, atomic, layout, manifest
from .errors import CheckpointError
from .options import CheckpointOptions
from .policy import RECORD, RetentionPolicy, manifest_fields, pins

_log = logging.getLogger(__name__)

# {path: ((inode, size, mtime), fields)}: a committed manifest never changes in place (a replay
# swaps in a new directory, with a new inode), so each is parsed once, not at every commit.
_FIELDS: dict[str, tuple[tuple[int, int, int], dict[str, Any] | None]] = {}


def record(step: int, options: CheckpointOptions, replacing: Path | None = None) -> dict[str, Any]:
  """The `retention` entry of checkpoint `step`'s manifest (`RetentionPolicy.record`). When it
  replaces a committed checkpoint of the same step (a replay), what that one's manifest kept it
  for stays: a replay under other flags never un-keeps a step."""
  policy = RetentionPolicy(options.keep, options.keep_every, options.keep_best)
  out = policy.record(step, options.best_metric)
  if replacing is not None and (replacing / layout.MANIFEST).is_file():
    merge(out, (fields({step: replacing})[step] or {}).get(RECORD) or {})
  return out


def merge(out: dict[str, Any], old: Any) -> None:
  """Adds to the record `out` what the record `old` (of another commit of the step: read, so
  checked) keeps it for, with each reason's own entry."""
  if not isinstance(old, Mapping) or not isinstance(old.get('kept') or [], list):
    return
  for reason in old.get('kept') or ():
    if isinstance(reason, str) and reason not in out['kept']:
      out['kept'].append(reason)
      if reason in old and reason not in out:
        out[reason] = old[reason]


def fields(committed: Mapping[int, Path]) -> dict[int, dict[str, Any] | None]:
  """{step: `manifest_fields` of its manifest, or None when it cannot be read}."""
  out = {}
  for step, path in committed.items():
    where = path / layout.MANIFEST
    try:
      st = where.stat()
      key = (st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
      out[step] = None
      continue
    cached = _FIELDS.get(str(where))
    if cached is None or cached[0] != key:
      try:
        got = manifest_fields(manifest.parse(path, where.read_bytes()))
      except (CheckpointError, OSError):
        got = None  # unreadable: it may say it is kept, so it is never deleted here
      cached = _FIELDS[str(where)] = (key, got)
    out[step] = cached[1]
  return out


def best_metric(records: Mapping[int, Mapping[str, Any] | None],
                options: CheckpointOptions) -> dict[int, float]:
  """{step: the manifest's `metrics[best_metric]`} of the committed steps that recorded one."""
  if not options.keep_best:
    return {}
  out = {}
  for step, got in records.items():
    value = ((got or {}).get('metrics') or {}).get(options.best_metric)
    if isinstance(value, (int, float)):
      out[step] = float(value)
  return out


def apply(directory: Path,
          policy: RetentionPolicy,
          options: CheckpointOptions,
          *,
          newest: int | None = None,
          held: Iterable[int] = ()) -> tuple[list[int], list[str]]:
  """Delete what retention lets go; only ever called right after a commit, of step `newest`.
  `held`: steps a reader still needs (an upload in progress): kept until a later commit.

  Returns (deleted steps, problems). A step that cannot be removed is a warning, not a failed
  save: the checkpoint just committed is intact, and the next commit tries again.
  """
  deleted, problems = [], []
  try:
    committed = layout.committed_steps(directory)
    for gone in set(_FIELDS) - {str(p / layout.MANIFEST) for p in committed.values()}:
      if Path(gone).parent.parent == directory:
        _FIELDS.pop(gone, None)
    left = abandoned.left(directory, committed)  # never counted in `keep`
    current = {s: p for s, p in committed.items() if s not in left}
    records = fields(current)
    doomed = policy.to_delete(
        current, best_metric(records, options), newest=newest, pinned=pins(records))
    # What the run abandoned below the step just committed (the replay passed it without saving
    # it again): deleted, unless its own manifest keeps it. Above that step it stays.
    below = {s: p for s, p in committed.items() if s in left and s < (newest or -1)}
    doomed += [s for s, r in fields(below).items() if not pins({s: r})]
    held = set(held)
    for step in [s for s in doomed if s not in held]:
      try:
        # Rename first so a half-deleted directory never looks like a checkpoint.
        gone = layout.deleting_dir(directory, step)
        os.rename(committed[step], gone)
        deleted.append(step)
        shutil.rmtree(gone)
      except OSError as e:
        problems.append(f'step {step}: {type(e).__name__}: {e}')
    if deleted:
      atomic.fsync_dir(directory)
  except Exception as e:  # listing or fsync failed: the commit before it stands all the same
    problems.append(f'{type(e).__name__}: {e}')
  for problem in problems:
    _log.warning('retention under %s could not delete %s', directory, problem)
  return deleted, problems
