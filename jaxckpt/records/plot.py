"""`jaxckpt plot --workdir=DIR`: the loss history as a PNG, with resumes and pivots marked, and
the held-out losses: the trainer's (`--config.train.eval_every`) and `jaxckpt evaluate`'s
(`evaluated.json`; one that is not such a file is said on stderr and not drawn).

Rows of `loss.jsonl` and `events.jsonl` that are not what jaxckpt writes (a step or segment that
is no whole number, a loss that is no number, a line that is not UTF-8 JSON) are passed over, and
what is sound is drawn; a records file that cannot be read at all is refused (E-PLOT-001).

`--out` names the file, and its suffix the format (any matplotlib writes: `.png`, `.pdf`,
`.svg`, ...); a name without a suffix gets `.png`, and a directory (an existing one, or any name
ending in `/`) gets `loss.png` in it.
The file is written atomically: a plot that fails leaves an older file of that name as it was.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from jaxckpt.checkpoint import atomic
from jaxckpt.errors import UsageError
from jaxckpt.records.runlog import EVENTS, current, read_evals, read_jsonl
from jaxckpt.records.workdir import EVALUATED, LOSSES

DEFAULT_NAME = 'loss.png'


def plot(workdir: str | Path, out: str | Path | None = None) -> Path:
  """Draws the loss history of `workdir`; returns the path written (see `output_path`)."""
  workdir = Path(workdir)
  history, events = read_records(workdir)
  out = output_path(workdir, out)
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
  ax.plot(
      list(history), [float(r['loss']) for r in history.values()],
      lw=1.0,
      color='tab:blue',
      label='training loss')
  marks = [(e['step'], 'resumed', 'tab:green', '--') for e in events if e.get('event') == 'resumed']
  marks += [(e['step'], f'pivot to phase {e.get("phase", "?")}', 'tab:red', '-')
            for e in events
            if e.get('event') == 'pivot']
  labelled = set()
  for step, label, color, style in marks:
    kind = label.split()[0]
    ax.axvline(
        step, color=color, ls=style, lw=1.0, alpha=0.8, label=None if kind in labelled else label)
    labelled.add(kind)
  evals = read_evals(events)  # the history as it stands: abandoned steps left out
  if evals:
    ax.plot(
        list(evals), list(evals.values()), 'o-', ms=3, color='tab:orange', label='held-out loss')
  evaluated = evaluated_losses(workdir)
  if evaluated:
    ax.plot(
        list(evaluated),
        list(evaluated.values()),
        's',
        ms=4,
        color='tab:purple',
        label='held-out loss (jaxckpt evaluate)')
  ax.set_xlabel('step')
  ax.set_ylabel('loss')
  ax.set_title(
      f'{workdir.name}: {len(history)} steps, {len({r["segment"] for r in history.values()})} segment(s)'
  )
  ax.grid(alpha=0.3)
  ax.legend(loc='upper right')
  fig.tight_layout()
  try:
    _save(fig, out)
  finally:
    plt.close(fig)
  return out


def read_records(workdir: Path) -> tuple[dict[int, dict], list[dict]]:
  """What `plot` draws of `workdir`: ({step: loss row} as the history stands, the events), with
  the rows that are not what jaxckpt writes passed over. Refuses (E-PLOT-001) a workdir that is
  not a run's, a records file that cannot be read and a history with no sound row."""
  if not workdir.is_dir():
    what = 'is a file, not a run directory' if workdir.exists() else 'does not exist'
    raise UsageError('E-PLOT-001', f'{workdir} {what}',
                     'point --workdir at the directory of a run that has trained')
  rows = [r for r in _read(workdir / LOSSES) if _sound_loss(r)]
  events = [e for e in _read(workdir / EVENTS) if _sound_event(e)]
  # As `runlog.read_loss_history`, on the sound rows: the newest segment's, cut where a later
  # start went back.
  history = current(((r['step'], r['segment'], r) for r in rows), events)
  if not history:
    raise UsageError('E-PLOT-001', f'{workdir} has no loss history ({LOSSES})',
                     'point --workdir at a run that has trained')
  return history, events


def _read(path: Path) -> list[dict]:
  """The rows of the records file `path` ([] when there is none); one that cannot be read at all
  (a directory, a pipe, no permission) is E-PLOT-001."""
  fix = 'make it a file you can read, or point --workdir at another run'
  try:
    if path.exists() and not path.is_file():  # a pipe or a device would be read forever
      what = 'a directory' if path.is_dir() else 'a pipe or a device'
      raise UsageError('E-PLOT-001', f'{path} is {what}, not a file', fix)
    return read_jsonl(path)
  except OSError as e:
    raise UsageError('E-PLOT-001', f'{path} cannot be read: {e.strerror or e}', fix) from None


def _whole(value) -> bool:
  """Whether `value` is a step or a segment as jaxckpt writes them: an int of 0 or more (not a
  bool, a float, a string, None)."""
  return type(value) is int and 0 <= value < 2**63  # pylint: disable=unidiomatic-typecheck


def _number(value) -> bool:
  """Whether `value` is a loss as jaxckpt writes it: a float (NaN for a diverged step) or int."""
  if type(value) not in (int, float):  # pylint: disable=unidiomatic-typecheck
    return False  # a bool, a string, None, a list
  try:
    float(value)
  except OverflowError:  # an int past what a float holds
    return False
  return True


def _sound_loss(row: dict) -> bool:
  return _whole(row.get('step')) and _whole(row.get('segment')) and _number(row.get('loss'))


def _sound_event(e: dict) -> bool:
  """Whether `e` can be drawn: the steps of resumes, pivots and evals are steps, an eval's loss a
  number. (A `started` event's fields are read with care: `runlog.cuts`.)"""
  kind = e.get('event')
  if kind in ('resumed', 'pivot'):
    return _whole(e.get('step'))
  if kind == 'eval':
    return _whole(e.get('step')) and _number(e.get('heldout_loss'))
  return True


def evaluated_losses(workdir: Path) -> dict[int, float]:
  """{step: held-out loss} of `jaxckpt evaluate`'s `WORKDIR/evaluated.json`, by step; {} when there
  is none. A file that is not one (not JSON, a step that is no number, a loss that is not finite)
  is said on stderr, and nothing of it is drawn."""
  path = workdir / EVALUATED
  try:
    with open(path, 'rb') as f:
      raw = f.read(_MAX_EVALUATED + 1)
    found = json.loads(raw) if len(raw) <= _MAX_EVALUATED else None
    losses = {int(step): float(r['heldout_loss']) for step, r in found.items()}
    if all(step >= 0 and math.isfinite(v) for step, v in losses.items()):
      return dict(sorted(losses.items()))
    why = 'a negative step or a loss that is not finite'
  except FileNotFoundError:
    return {}
  except OSError as e:
    why = e.strerror or str(e)
  except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
    why = 'not the {"<step>": {"heldout_loss": ...}} that jaxckpt evaluate writes'
  print(f'jaxckpt: not drawing {path}: {why}', file=sys.stderr)
  return {}


_MAX_EVALUATED = 64 << 20  # about 200 bytes a checkpoint: far more than any run holds


def formats() -> list[str]:
  """The suffixes (without the dot) matplotlib can write."""
  from matplotlib.backend_bases import FigureCanvasBase
  return sorted(FigureCanvasBase.get_supported_filetypes())


def output_path(workdir: Path, out: str | Path | None) -> Path:
  """The file `plot` writes: `--out` as given; with `.png` added when it has no suffix;
  `out/loss.png` when it is a directory or ends in a separator; `WORKDIR/loss.png` without one.
  Refuses (E-PLOT-002) a suffix matplotlib cannot write and a file whose directory is missing or
  not a directory."""
  path = workdir / DEFAULT_NAME if not out else Path(out)
  # Path() drops a trailing '/': `--out=plots/` names a directory even when there is none.
  if path.is_dir() or (out and str(out).endswith(tuple(filter(None, (os.sep, os.altsep))))):
    path = path / DEFAULT_NAME
  elif not path.suffix:
    path = path.with_name(f'{path.name}.png')
  known = formats()
  if path.suffix[1:].lower() not in known:
    raise UsageError('E-PLOT-002', f'--out={out}: matplotlib cannot write {path.suffix} files',
                     f'end --out with one of .{", .".join(known)} (or with no suffix, for .png)')
  parent = path.parent
  if not parent.is_dir():
    what = f'{parent} is a file, not a directory' if parent.exists() else (
        f'its directory {parent} does not exist')
    raise UsageError('E-PLOT-002', f'--out={path}: {what}',
                     'create that directory, or pass an --out in an existing one')
  return path


def _save(fig, path: Path) -> None:
  """`fig` as `path`, in the format its suffix names, whole or not at all."""
  try:
    with atomic.atomic_file(path) as tmp:
      fig.savefig(tmp, format=path.suffix[1:].lower())
  except OSError as e:
    raise UsageError('E-PLOT-002', f'{path} cannot be written: {e.strerror or e}',
                     'pass an --out in a directory you can write') from None
  except (RuntimeError, ValueError) as e:  # a format whose backend needs more (pgf: a TeX)
    why = ' '.join(f'{type(e).__name__}: {e}'.split())
    raise UsageError('E-PLOT-002', f'{path} could not be written as {path.suffix}: {why}',
                     'pass an --out ending in .png') from None
