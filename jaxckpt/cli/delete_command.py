"""`jaxckpt delete CKPT [--kept] [--newest]`: delete one checkpoint, on purpose.

    jaxckpt delete runs/tiny/checkpoints/step_00000300
    jaxckpt delete runs/tiny/checkpoints/step_00001000 --kept     its manifest says it is kept

Retention never deletes a checkpoint whose own manifest says it is kept (`--keep_every`,
`--keep_best` when it was written), whatever a later run's flags: deleting one takes `--kept`.
The newest committed checkpoint is what `--resume=latest` continues from: deleting it takes
`--newest`. The run must be stopped (its workdir lock is held while the checkpoint goes). The
checkpoint is renamed aside first, so a crash midway leaves debris (removed by the next writer),
never a half-deleted checkpoint; a remote copy (`--remote`) is left as it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

from jaxckpt.checkpoint import abandoned, atomic, discovery, layout, policy, retention
from jaxckpt.checkpoint.discovery import NOT_A_CHECKPOINT
from jaxckpt.cli import remote_args
from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.errors import JaxckptError, UsageError
from jaxckpt.records.runlog import RunLog
from jaxckpt.records.workdir import CHECKPOINTS, WorkdirLock


def main(argv: list[str]) -> int:
  parser = ArgumentParser(
      prog='jaxckpt delete',
      description='Delete one committed checkpoint; '
      'one its manifest says is kept only with --kept.')
  parser.add_argument('path', help='a checkpoints/step_<n> directory')
  parser.add_argument(
      '--kept',
      action='store_true',
      help='delete it even though its manifest says it is kept (--keep_every, --keep_best)')
  parser.add_argument(
      '--newest',
      action='store_true',
      help='delete it even though it is the newest committed checkpoint, the one the next '
      'start would resume from')
  args = parser.parse_args(argv)
  if remote_args.is_url(args.path):
    raise UsageError('E-DELETE-003', f'{args.path} is a URL: delete works on a local checkpoint',
                     'pass a checkpoints/step_<n> directory')
  path = Path(args.path).absolute()
  step = layout.parse_step(path.name)
  if step is None or not (path / layout.MANIFEST).is_file():
    raise UsageError(NOT_A_CHECKPOINT, f'{path} is not a committed checkpoint',
                     'pass a checkpoints/step_<n> directory that holds a manifest.json')
  root = path.parent
  if root.name != CHECKPOINTS:  # a bare checkpoint directory: no run, no lock to hold
    _delete(root, step, path, args)
    return 0
  with WorkdirLock(root.parent):  # refuses while a trainer runs here
    reasons = _delete(root, step, path, args)
    RunLog(root.parent).event('checkpoint_deleted', step=step, path=str(path), kept=reasons)
  return 0


def _resumed_from(root: Path) -> int | None:
  """The step a start would resume from: the newest that passes verification, every byte."""
  found, _ = discovery.latest_intact(root)
  return None if found is None else layout.parse_step(found.name)


def _delete(root: Path, step: int, path: Path, args) -> list[str]:
  """Delete checkpoint `step` of `root` unless refused; returns why it had been kept."""
  committed = layout.committed_steps(root)
  if step not in committed:  # deleted or replaced since it was named
    raise UsageError(NOT_A_CHECKPOINT, f'{path} is not a committed checkpoint',
                     'pass a checkpoints/step_<n> directory that holds a manifest.json')
  records = retention.fields(committed)
  reasons = policy.pins(records).get(step, [])
  if reasons and not args.kept:
    why = '; '.join(_why(r, step, records[step]) for r in reasons)
    raise UsageError('E-DELETE-001', f'{path} is kept: {why}',
                     'pass --kept to delete a checkpoint that is kept')
  # A checkpoint the run abandoned (`abandoned`) is never the one it resumes from.
  left = abandoned.steps(root, committed)
  newest = max(set(committed) - left, default=max(committed))
  if not args.newest and (step == newest or _resumed_from(root) == step):
    older = [s for s in committed if s < step and s not in left]
    then = f'from step {older[-1]}' if older else 'from scratch'
    which = 'newest committed' if step == newest else 'newest intact (the newer ones ' \
        'are damaged)'
    raise UsageError(
        'E-DELETE-002', f'{path} is the {which} checkpoint of {root}: the next start would resume '
        f'{then}', 'pass --newest to delete it all the same')
  gone = layout.deleting_dir(root, step)
  try:
    path.rename(gone)
    atomic.fsync_dir(root)  # from here it is debris: never read, removed by the next writer
    shutil.rmtree(gone)
    atomic.fsync_dir(root)
  except OSError as e:
    raise JaxckptError(
        'E-DELETE-004', f'deleting {path} failed: {e.strerror or e}',
        f'fix the permissions of {root}; a {gone.name} left behind is debris the next '
        'writer removes') from e
  print(f'deleted {path}' + (f' (it was kept: {", ".join(reasons)})' if reasons else ''))
  return reasons


def _why(reason: str, step: int, fields: Mapping[str, Any] | None) -> str:
  record = (fields or {}).get(policy.RECORD) or {}
  if reason == policy.KEEP_EVERY:
    every = record.get(policy.KEEP_EVERY)
    return f'keep_every (step {step} was written under --keep_every={every})'
  if reason == policy.BEST:
    best = record[policy.BEST]
    value = ((fields or {}).get('metrics') or {}).get(best['metric'])
    return f'best (its {best["metric"]} {value:.6g} is among the {best["among"]} lowest)'
  if reason == policy.UNREADABLE:
    return 'its manifest cannot be read, so whether it is kept is unknown'
  return reason
