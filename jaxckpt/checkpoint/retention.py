"""Deleting what the retention policy lets go, right after a commit (`CheckpointManager`)."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Mapping

from . import atomic, layout, manifest
from .errors import CheckpointError
from .options import CheckpointOptions
from .policy import RetentionPolicy

_log = logging.getLogger(__name__)


def best_metric(committed: Mapping[int, Path], options: CheckpointOptions) -> dict[int, float]:
  """{step: the manifest's `metrics[best_metric]`} of the committed steps that recorded one."""
  if not options.keep_best:
    return {}
  out = {}
  for step, path in committed.items():
    try:
      value = (manifest.read(path).get('metrics') or {}).get(options.best_metric)
    except CheckpointError:
      continue  # unreadable: never the best
    if isinstance(value, (int, float)):
      out[step] = float(value)
  return out


def apply(directory: Path, policy: RetentionPolicy,
          options: CheckpointOptions) -> tuple[list[int], list[str]]:
  """Delete what retention lets go; only ever called right after a commit.

  Returns (deleted steps, problems). A step that cannot be removed is a warning, not a failed
  save: the checkpoint just committed is intact, and the next commit tries again.
  """
  deleted, problems = [], []
  try:
    committed = layout.committed_steps(directory)
    for step in policy.to_delete(committed, best_metric(committed, options)):
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
