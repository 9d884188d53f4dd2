"""Satellite files with phase lifetimes, and the pivot between phases.

A run's life has two clocks. The loss history (`loss.jsonl`) lives as long as the run: it is
never archived or reset. `samples.json` (recent generated samples, for audit) and `bandit.json`
(a readable mirror of the data-source bandit) live for one *phase*. A pivot is a policy change,
not a reset: on a stopped run, `jaxckpt pivot --workdir=DIR` archives the phase's satellites to
`archive/phase-<k>/` and records a `pivot` event; the next start resumes weights, Adam m and v,
the step and the loss history, with a fresh bandit under the (possibly new) config's floors and
ceilings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from jaxckpt.checkpoint import atomic, layout
from jaxckpt.errors import UsageError
from jaxckpt.records.runlog import RunLog, read_jsonl
from jaxckpt.records.workdir import ARCHIVE, BANDIT, CHECKPOINTS, EVENTS, SAMPLES, WorkdirLock


def current_phase(workdir: str | os.PathLike) -> int:
  """Phases start at 0; each pivot starts the next."""
  # Rows are read, not trusted: a foreign line (not an object, no `event`) is no pivot.
  return sum(1 for e in read_jsonl(Path(workdir) / EVENTS)
             if isinstance(e, dict) and e.get('event') == 'pivot')


def write_samples(workdir: Path, phase: int, step: int, texts: Sequence[str], keep: int) -> None:
  path = workdir / SAMPLES
  try:
    old = json.loads(path.read_text())
  except (OSError, ValueError):
    old = {}
  old = old if isinstance(old, dict) else {}
  rounds = old.get('rounds', []) if old.get('phase') == phase else []
  rounds = rounds if isinstance(rounds, list) else []
  # A replayed step replaces its old round; a foreign row goes.
  rounds = [
      r for r in rounds if isinstance(r, dict) and type(r.get('step')) is int and r['step'] < step
  ]
  rounds.append({'step': step, 'samples': list(texts)})
  # keep=0 keeps none (`rounds[-0:]` would be all of them).
  atomic.write_json_durably(path, {'phase': phase, 'rounds': rounds[-keep:] if keep > 0 else []})


def write_bandit_mirror(workdir: Path, step: int, snapshot: Mapping[str, Any]) -> None:
  atomic.write_json_durably(workdir / BANDIT, {'step': step, **snapshot})


def pivot(workdir: str | os.PathLike) -> tuple[int, list[str]]:
  """Archive the phase's satellites of a stopped run; returns (new phase, archived names)."""
  workdir = Path(workdir)
  if not workdir.is_dir():
    what = 'is a file, not a run directory' if workdir.exists() else 'does not exist'
    raise UsageError('E-PIVOT-001', f'{workdir} {what}', 'pivot a run that has trained and stopped')
  if not (workdir / CHECKPOINTS).is_dir():
    raise UsageError('E-PIVOT-001', f'{workdir} has no checkpoints to pivot from',
                     'pivot a run that has trained and stopped')
  with WorkdirLock(workdir):  # refuses while a trainer runs here
    ending = current_phase(workdir)
    # The pivot event is appended to events.jsonl, whose readers (the trainer's too) rely on
    # every row being an event: a foreign row is refused before anything moves.
    for i, e in enumerate(read_jsonl(workdir / EVENTS), 1):
      if not isinstance(e, dict) or not isinstance(e.get('event'), str):
        raise UsageError(
            'E-PIVOT-001', f'{workdir / EVENTS} holds a row that is not a jaxckpt event '
            f'(row {i}: {json.dumps(e)[:60]})', 'remove that line, then pivot again')
    dest = workdir / ARCHIVE / f'phase-{ending}'
    if os.path.lexists(workdir / ARCHIVE) and not (workdir / ARCHIVE).is_dir():
      raise UsageError('E-PIVOT-002', f'{workdir / ARCHIVE} is not a directory',
                       'move it away and pivot again')
    # A pivot cut short (killed after it moved files, before its event was recorded) left the
    # phase's archive holding satellites and nothing else: this one finishes it.
    moved = _cut_short(dest)
    # Every save writes bandit.json: none (and no samples.json) means the phase has not trained
    # since the last pivot, or the run never saved. A pivot then would archive nothing and only
    # count a phase; it is refused before anything is created or recorded.
    if not moved and not any((workdir / name).exists() for name in (SAMPLES, BANDIT)):
      since = ' since its last pivot' if ending else ''
      raise UsageError(
          'E-PIVOT-001', f'{workdir} has nothing to pivot: no {SAMPLES} or {BANDIT} '
          f'(the run has not trained{since})', 'train the run, then pivot it')
    if dest.exists() and moved is None:
      raise UsageError('E-PIVOT-002', f'{dest} already exists', 'move it away and pivot again')
    dest.parent.mkdir(exist_ok=True)
    dest.mkdir(exist_ok=True)
    # The new directories' entries must be durable before files move into them: a crash could
    # otherwise lose phase-<k> (and what was moved there) while the originals are already gone.
    atomic.fsync_dir(dest.parent)
    atomic.fsync_dir(workdir)
    for name in (SAMPLES, BANDIT):
      if (workdir / name).exists():
        os.replace(workdir / name, dest / name)
    archived = [name for name in (SAMPLES, BANDIT) if (dest / name).exists()]
    atomic.fsync_dir(dest)
    atomic.fsync_dir(workdir)
    steps = layout.committed_steps(workdir / CHECKPOINTS)
    RunLog(workdir).event(
        'pivot',
        phase=ending + 1,
        archived=archived,
        archive=str(dest),
        step=max(steps) if steps else 0)
  return ending + 1, archived


def _cut_short(dest: Path) -> list[str] | None:
  """The satellites a pivot cut short moved into `dest`, which it may finish (None when `dest`
  is absent or holds anything else: not a pivot's)."""
  try:
    names = sorted(p.name for p in dest.iterdir())
  except OSError:
    return None
  return names if set(names) <= {SAMPLES, BANDIT} else None  # [] : cut short before a move
