"""`jaxckpt plot --workdir=DIR`: the loss history as a PNG, with resumes and pivots marked."""

from __future__ import annotations

from pathlib import Path

from jaxckpt.errors import UsageError
from jaxckpt.records.runlog import EVENTS, read_jsonl, read_loss_history


def plot(workdir: str | Path, out: str | Path | None = None) -> Path:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  workdir = Path(workdir)
  history = read_loss_history(workdir)
  if not history:
    raise UsageError('E-PLOT-001', f'{workdir} has no loss history (loss.jsonl)',
                     'point --workdir at a run that has trained')
  events = read_jsonl(workdir / EVENTS)
  out = Path(out) if out else workdir / 'loss.png'
  fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
  ax.plot(
      list(history), [r['loss'] for r in history.values()],
      lw=1.0,
      color='tab:blue',
      label='training loss')
  marks = [(e['step'], 'resumed', 'tab:green', '--') for e in events if e['event'] == 'resumed']
  marks += [(e['step'], f'pivot to phase {e["phase"]}', 'tab:red', '-')
            for e in events
            if e['event'] == 'pivot']
  labelled = set()
  for step, label, color, style in marks:
    kind = label.split()[0]
    ax.axvline(
        step, color=color, ls=style, lw=1.0, alpha=0.8, label=None if kind in labelled else label)
    labelled.add(kind)
  evals = [(e['step'], e['heldout_loss']) for e in events if e['event'] == 'eval']
  if evals:
    ax.plot(*zip(*evals), 'o-', ms=3, color='tab:orange', label='held-out loss')
  ax.set_xlabel('step')
  ax.set_ylabel('loss')
  ax.set_title(
      f'{workdir.name}: {len(history)} steps, {len({r["segment"] for r in history.values()})} segment(s)'
  )
  ax.grid(alpha=0.3)
  ax.legend(loc='upper right')
  fig.tight_layout()
  fig.savefig(out)
  plt.close(fig)
  return out
