"""The run's records in its workdir: `status.json`, `events.jsonl` and the loss history.

- `status.json` is rewritten atomically: running / interrupted / finished / failed, the step, the
  last committed checkpoint, pid, host, start and update times. A second stop signal, which exits
  at once, marks it `interrupted` on its way out (`signals.on_exit_now`).
- `events.jsonl` and `loss.jsonl` are append-only. A crash can cut their last line short; readers
  skip a line that does not parse. The loss history is never rewritten: steps replayed after a
  resume are appended again under a new `segment`, and `read_loss_history` keeps the newest
  segment's value for each step, and leaves out the steps a later start went back past.
- With `mirror(scalars)`, the loss rows and the `eval` and `checkpoint` events also go to
  TensorBoard event files (`jaxckpt.records.tensorboard`), after the line is written here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from jaxckpt.checkpoint import atomic, signals
from jaxckpt.errors import JaxckptError
from jaxckpt.records.workdir import EVENTS, LOSSES, STATUS


def read_jsonl(path: Path) -> list[dict[str, Any]]:
  rows = []
  try:
    lines = _lines(path.read_bytes())
  except FileNotFoundError:
    return rows
  for line in lines:
    try:
      row = json.loads(line)
    except (ValueError, RecursionError):
      continue  # a line cut short by a crash
    if isinstance(row, dict):  # a record; anything else is no line of ours
      rows.append(row)
  return rows


def _lines(data: bytes) -> list[str]:
  """The lines of `data`, less those that are not UTF-8: bytes no jaxckpt wrote (a line of ours is
  ASCII) are passed over as a line cut short is."""
  try:
    return data.decode().splitlines()
  except UnicodeDecodeError:
    lines = data.decode(errors='surrogateescape').splitlines()
    return [line for line in lines if _utf8(line)]


def _utf8(line: str) -> bool:
  try:
    line.encode()  # the bytes that were not UTF-8 are lone surrogates here, which do not encode
  except UnicodeEncodeError:
    return False
  return True


def _segment(e: Mapping[str, Any], ordinal: int) -> int:
  """A `started` event's segment: its own field (records from before it: its place)."""
  seg = e.get('segment')
  return seg if type(seg) is int else ordinal  # pylint: disable=unidiomatic-typecheck


def cuts(events: list[dict[str, Any]]) -> dict[int, float]:
  """{segment: the step past which its records are void}: a later start that went back to an
  older checkpoint abandoned what this one logged after it. A start that passed over a damaged
  checkpoint says `started` again in its segment: the last one is where it started."""
  starts: dict[int, float] = {}
  for ordinal, e in enumerate(e for e in events if e.get('event') == 'started'):
    step = e.get('step')
    starts[_segment(e, ordinal)] = step if type(step) is int else math.inf  # pylint: disable=unidiomatic-typecheck
  out, lowest = {}, math.inf
  for seg in sorted(starts, reverse=True):
    out[seg] = lowest
    lowest = min(lowest, starts[seg])
  return out


def current(rows: Iterable[tuple[int, int, Any]], events: list[dict[str, Any]]) -> dict[int, Any]:
  """{step: value} of (step, segment, value) records: for each step, the newest segment's, left
  out where a later start went back past it (the run's history as it stands)."""
  limit = cuts(events)
  best: dict[int, tuple[int, Any]] = {}
  for step, segment, value in rows:
    if step > limit.get(segment, math.inf):
      continue
    if step not in best or segment >= best[step][0]:
      best[step] = (segment, value)
  return {step: best[step][1] for step in sorted(best)}


def read_loss_history(workdir: str | os.PathLike) -> dict[int, dict[str, Any]]:
  """{step: row} with, for each step, the row of the newest segment that trained it; the steps a
  later start went back past (a resume from an older checkpoint) are not in it, as TensorBoard's
  restart marker drops them there."""
  workdir = Path(workdir)
  rows = [r for r in read_jsonl(workdir / LOSSES) if 'step' in r and 'segment' in r]
  return current(((r['step'], r['segment'], r) for r in rows), read_jsonl(workdir / EVENTS))


def read_evals(events: list[dict[str, Any]]) -> dict[int, float]:
  """{step: held-out loss} of the `eval` events, by the same rule (an event's segment is the
  start it follows)."""
  rows, segment, ordinal = [], -1, 0
  for e in events:
    if e.get('event') == 'started':
      segment, ordinal = _segment(e, ordinal), ordinal + 1
    elif e.get('event') == 'eval':
      rows.append((e['step'], segment, e['heldout_loss']))
  return current(rows, events)


class RunLog:
  """Writes the records of one run; safe to call from the checkpoint thread."""

  def __init__(self, workdir: str | os.PathLike):
    self.workdir = Path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self._lock = threading.Lock()
    self._status: dict[str, Any] = {}
    # Each start of the trainer is a new segment of the loss history.
    self.segment = sum(1 for e in read_jsonl(self.workdir / EVENTS) if e.get('event') == 'started')
    self._scalars = None  # a `tensorboard.Scalars`, or None
    self._unhook = lambda: None
    self.started = False

  def mirror(self, scalars) -> None:
    """Also hand what `losses` and `event` write to `scalars` (a `tensorboard.Scalars`)."""
    self._scalars = scalars

  def close(self) -> None:
    """Closes the mirror's event file; the records here need no closing (each line is synced)."""
    self._unhook()
    scalars, self._scalars = self._scalars, None
    if scalars is not None:
      scalars.close()

  def _append(self, name: str, rows: Iterable[Mapping[str, Any]], *, sync: bool) -> None:
    rows = list(rows)
    data = ''.join(json.dumps(r, separators=(',', ':')) + '\n' for r in rows)
    if not data:
      return
    with self._lock, _written(self.workdir / name), open(self.workdir / name, 'a+b') as f:
      # A crash can leave the last line cut short; start on a fresh line so only that one
      # record is lost, not the next one too.
      if f.tell() and (f.seek(f.tell() - 1), f.read(1))[1] != b'\n':
        data = '\n' + data
      f.write(data.encode())
      f.flush()
      if sync:
        os.fsync(f.fileno())
    scalars = self._scalars
    if scalars is not None:  # only what is in the records reaches TensorBoard
      scalars.records(name, rows)

  def event(self, event: str, **fields: Any) -> None:
    self.started |= event == 'started'  # from here on, a failure is this start's end record
    # Each row names the start that wrote it: rows from before its `started` are its own.
    self._append(
        EVENTS, [{'event': event, 'time': time.time(), 'segment': self.segment, **fields}],
        sync=True)

  def losses(self, rows: Iterable[Mapping[str, Any]]) -> None:
    self._append(LOSSES, ({**r, 'segment': self.segment} for r in rows), sync=True)

  def _exited_now(self, name: str) -> None:
    # The end record of this start, as a stop's is (a second Ctrl-C is no machine lost).
    self.event('interrupted', step=self._status.get('step'), signal=name, exited_at_once=True)
    self.status(
        state='interrupted',
        signal=name,
        error=f'a second {name}: exited at once, '
        'without a checkpoint of this step')

  def status(self, **fields: Any) -> None:
    with self._lock:
      if not self._status:
        self._status = {'pid': os.getpid(), 'host': socket.gethostname(), 'started_at': time.time()}
        # A second stop signal exits at once: the status says so, not `running` for a dead pid.
        self._unhook = signals.on_exit_now(self._exited_now)
      self._status.update(fields, updated_at=time.time())
      with _written(self.workdir / STATUS):
        atomic.write_json_durably(self.workdir / STATUS, self._status)


@contextlib.contextmanager
def _written(path: Path) -> Iterator[None]:
  """A record that cannot be written (a full or failing disk, a directory where the file goes)
  is one line, E-RECORD-001, not a traceback."""
  try:
    yield
  except OSError as e:
    raise JaxckptError(
        'E-RECORD-001', f'cannot write the run record {path}: {e.strerror or e}',
        "free space on (or fix) the workdir's disk, then run the same command: it resumes from "
        'the last committed checkpoint') from None


def read_status(workdir: str | os.PathLike) -> dict[str, Any]:
  return json.loads((Path(workdir) / STATUS).read_text())
