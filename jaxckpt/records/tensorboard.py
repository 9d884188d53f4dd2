"""The run's scalars as TensorBoard event files: `tensorboard --logdir WORKDIR` shows the run.

`RunLog` hands this the loss rows and the events it writes (`RunLog.mirror`); the event files
hold the same values, float32 as in `loss.jsonl`, under WORKDIR/tensorboard/:

    train/loss, train/lr, train/grad_norm     every step (the rows of loss.jsonl)
    train/tokens_per_sec                      each time rows are written: over the steps since
                                              the previous write (the first write of a start
                                              sets the clock: it would count the compile)
    eval/heldout_loss                         each `eval` event (config.train.eval_every)
    checkpoint/seconds_blocked, checkpoint/seconds_to_commit, checkpoint/bytes
                                              each committed checkpoint, at its step

Resumes continue the same curves: one directory, so one TensorBoard run with the same tags, and
one new event file per start (files sort by their start time). Each file begins with
TensorBoard's restart marker (`SessionLog.START`) at the first step that start trains: when a
run resumes from a checkpoint older than the steps it had logged, TensorBoard drops the values
the earlier file holds from that step on, and shows the replayed ones, as `read_loss_history`
keeps the newest segment. A start writes no value at or before the step it resumed from.

Writes are synchronous and flushed each time (a few records every `log_every` steps), so every
exit leaves the file complete up to its last write. A writer that fails (disk full, a missing
package) logs one WARNING and writes nothing more; training goes on. tensorboardX's own
`SummaryWriter` is not used: its background thread dies on a write error and the next ten
`add_scalar` calls fill its queue, after which the training loop would block for good.

A value that is not finite (a loss gone NaN) is written as it is, as `loss.jsonl` records it,
with one WARNING the first time; the summaries are built here, not by tensorboardX's
`summary.scalar`, whose check logs `NaN or Inf found in input tensor.` once per value per step.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

from absl import logging

from jaxckpt.records.workdir import EVENTS, LOSSES, tensorboard_dir

# Per loss row: the tag and the row's field.
ROW_TAGS = {'train/loss': 'loss', 'train/lr': 'lr', 'train/grad_norm': 'grad_norm'}
TOKENS_PER_SEC = 'train/tokens_per_sec'
HELDOUT_LOSS = 'eval/heldout_loss'
# Per `checkpoint` event: the tag and the event's field.
CHECKPOINT_TAGS = {
    'checkpoint/seconds_blocked': 'seconds_blocked',
    'checkpoint/seconds_to_commit': 'seconds_to_commit',
    'checkpoint/bytes': 'bytes',
}


def mirror(runlog, config, *, first_step: int) -> None:
  """`runlog` writes TensorBoard event files too, of the steps after `first_step`, unless
  `config.train.tensorboard` is False. Call it on process 0 alone: the others write no records."""
  if config.train.get('tensorboard', True):
    runlog.mirror(
        Scalars(
            tensorboard_dir(runlog.workdir),
            segment=runlog.segment,
            first_step=first_step,
            tokens_per_step=config.train.batch_size * config.model.block_size))


def _tensorboardx():
  """tensorboardX's event writer, and its Summary and Event protos.

  Its package `__init__` imports torch when that is installed (for `SummaryWriter`'s type
  hints): seconds at start-up and a second GPU runtime in a JAX process; and boto3 (0.2 s), for
  event files on S3, which are never written here. Both are kept out.
  """
  blocked = [name for name in ('torch', 'boto3') if name not in sys.modules]
  for name in blocked:
    sys.modules[name] = None  # `import torch` raises ImportError, which tensorboardX expects
  try:
    from tensorboardX import event_file_writer  # pylint: disable=import-outside-toplevel
    from tensorboardX.proto import event_pb2, summary_pb2  # pylint: disable=import-outside-toplevel
  finally:
    for name in blocked:
      if sys.modules.get(name, 0) is None:
        del sys.modules[name]
  return event_file_writer, summary_pb2, event_pb2


class Scalars:
  """One start's event file under `logdir`; `segment` is `RunLog.segment`.

  Args:
    logdir: the directory of the event files (`workdir.tensorboard_dir(WORKDIR)`).
    segment: this start's index among the run's starts (part of the file name).
    first_step: the step this start resumed from (0: a fresh run); it writes later steps only.
    tokens_per_step: batch_size * block_size, for tokens/s.
  """

  def __init__(self, logdir: str | os.PathLike, *, segment: int, first_step: int,
               tokens_per_step: int):
    self.logdir = Path(logdir)
    self.first_step, self.tokens_per_step = first_step, tokens_per_step
    self._lock = threading.Lock()  # rows come from the loop, commits from the save thread
    self._clock: tuple[int, float] | None = None  # (step, time) of the previous rows
    self._writer = None
    self._said_not_finite = False
    self._guarded(self._open, segment)

  def _open(self, segment: int) -> None:
    event_file_writer, self._summary_pb2, self._event_pb2 = _tensorboardx()
    self.logdir.mkdir(parents=True, exist_ok=True)
    # tensorboardX names the file events.out.tfevents.<seconds>.<host><suffix>: the segment and
    # pid keep two starts within one second apart, and in order.
    self._writer = event_file_writer.EventsWriter(
        str(self.logdir / 'events'), f'.{segment:06d}.{os.getpid()}')
    Event, SessionLog = self._event_pb2.Event, self._event_pb2.SessionLog
    # What tensorboardX's SummaryWriter(purge_step=...) writes: TensorBoard hides the earlier
    # files' values from this step on.
    self._writer.write_event(Event(step=self.first_step + 1, file_version='brain.Event:2'))
    self._writer.write_event(
        Event(step=self.first_step + 1, session_log=SessionLog(status=SessionLog.START)))
    self._writer.flush()

  def _guarded(self, fn, *args) -> None:
    """Runs `fn`; a failure is one WARNING, and nothing is written after it."""
    try:
      fn(*args)
    except Exception as e:  # pylint: disable=broad-except  # metrics never stop training
      logging.warning('TensorBoard event files in %s: not written from here on: %s: %s',
                      self.logdir,
                      type(e).__name__, e)
      writer, self._writer = self._writer, None
      if writer is not None:
        try:
          writer.close()
        except Exception:  # pylint: disable=broad-except  # the same failure, told above
          pass

  def _write(self, points: Iterable[tuple[str, float, int, float]]) -> None:
    """(tag, value, step, wall time) each; flushed, so a kill loses nothing written."""
    Summary = self._summary_pb2.Summary
    for tag, value, step, wall_time in points:
      if step > self.first_step:
        value = float(value)
        if not math.isfinite(value) and not self._said_not_finite:
          self._said_not_finite = True
          logging.warning(
              '%s is %s at step %d: written to the TensorBoard event files as it is (later '
              'values that are not finite are not warned of)', tag, value, step)
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._writer.write_event(
            self._event_pb2.Event(wall_time=wall_time, step=step, summary=summary))
    self._writer.flush()

  def records(self, name: str, rows: list[Mapping[str, Any]]) -> None:
    """The rows `RunLog` just appended to the record file `name` (`loss.jsonl`, events)."""
    with self._lock:
      if self._writer is None or not rows:
        return
      if name == LOSSES:
        points = self._loss_points(rows)
      elif name == EVENTS:
        points = [p for e in rows for p in self._event_points(e)]
      else:
        return
      if points:
        self._guarded(self._write, points)

  def _loss_points(self, rows: list[Mapping[str, Any]]) -> list[tuple[str, float, int, float]]:
    points = [(tag, r[field], r['step'], r['time'])
              for r in rows
              for tag, field in ROW_TAGS.items()
              if field in r]
    last = rows[-1]
    if self._clock is not None:
      steps, seconds = last['step'] - self._clock[0], last['time'] - self._clock[1]
      if steps > 0 and seconds > 0:
        points.append(
            (TOKENS_PER_SEC, steps * self.tokens_per_step / seconds, last['step'], last['time']))
    self._clock = (last['step'], last['time'])
    return points

  @staticmethod
  def _event_points(e: Mapping[str, Any]) -> list[tuple[str, float, int, float]]:
    if e.get('event') == 'eval' and 'heldout_loss' in e:
      return [(HELDOUT_LOSS, e['heldout_loss'], e['step'], e['time'])]
    if e.get('event') == 'checkpoint':
      return [(tag, e[field], e['step'], e['time'])
              for tag, field in CHECKPOINT_TAGS.items()
              if e.get(field) is not None]
    return []

  def close(self) -> None:
    with self._lock:
      if self._writer is not None:
        self._guarded(self._writer.close)
        self._writer = None
