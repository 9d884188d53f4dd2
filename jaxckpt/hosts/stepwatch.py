"""A step that never ends ends the run: E-DIST-010, exit 1, so the scheduler restarts it.

A collective can hang with every process alive (a peer stopped, a stuck device; NCCL on GPUs).
The loop is then stuck inside the step, in C++: no stop signal reaches it, no heartbeat misses.
`watching` runs a thread that expects `beat(step)` from the loop after each step; when none
comes within the timeout it logs every thread's stack (`faulthandler`), records the run as
`failed` (event and `status.json`) and exits 1 with one line naming the step and the wait.

The timeout is `--step_timeout_secs`, else max(600 s, 50 x the median time between beats). The
first `WARMUP` steps of a start (which compile: the first call, and the second, whose inputs are
the first's outputs) get at least 600 s whatever the flag, and are not measured.

Work between two steps (`paused`) is not a step: a save is left to its own bounded waits (the
checkpoint library's, E-CKPT-018 for the devices), and an evaluation or the samples, which wait on
the devices as a step does, get max(`PAUSED_MIN_SECS`, the step timeout) before the same end.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import math
import os
import statistics
import sys
import threading
import time
from typing import Iterator

from absl import logging

from jaxckpt.errors import UsageError

MIN_SECS = 600.0  # the default timeout, and the warm-up steps'
WARMUP = 2  # steps
MEDIAN_FACTOR = 50
RECORD_SECS = 10.0  # for the records of a hung run, before it exits anyway
PAUSED_MIN_SECS = 3600.0  # an evaluation or the samples between two steps


def check(timeout_secs: float | None) -> None:
  """E-CONFIG-004 (exit 2) unless `timeout_secs` is None (the flag left out: the default) or a
  positive, finite number of seconds. No value turns the watchdog off: inf would, silently, so
  it is refused as the other timeout flags refuse it."""
  if timeout_secs is not None and not 0 < timeout_secs < math.inf:  # NaN too
    raise UsageError(
        'E-CONFIG-004', f'--step_timeout_secs={timeout_secs:g} is not a positive number of '
        'seconds', 'pass a number of seconds a step may take, e.g. --step_timeout_secs=1800, or '
        'leave it out (the default: max(600, 50 x the median step))')


def timeout(fixed: float | None, intervals, *, warming: bool) -> float:
  """Seconds a step may take: `fixed` (the flag) or max(MIN_SECS, 50 x median of `intervals`,
  the measured seconds per step); a warm-up step at least MIN_SECS."""
  if fixed is None:
    fixed = max(MIN_SECS, MEDIAN_FACTOR * statistics.median(intervals)) if intervals else MIN_SECS
  return max(fixed, MIN_SECS) if warming else fixed


class StepWatch(threading.Thread):
  """The thread `watching` runs; `beat(step)` says `step` is done."""

  def __init__(self, timeout_secs: float | None, runlog, step: int):
    super().__init__(name='jaxckpt-stepwatch', daemon=True)
    self.fixed, self.runlog = timeout_secs, runlog
    self.done = (step, time.monotonic())  # the last step done, and when: one tuple, one read
    self.beats = 0
    self.intervals: collections.deque[float] = collections.deque(maxlen=101)
    self.paused = 0  # inside `paused()`: not a step
    self.within: list[str] = []  # the watched work under way between two steps (`paused(what)`)
    self._closed = threading.Event()

  def beat(self, step: int) -> None:
    now = time.monotonic()
    if self.beats >= WARMUP:  # a warm-up step compiles: not a step time
      self.intervals.append(now - self.done[1])
    self.done, self.beats = (step, now), self.beats + 1

  def close(self) -> None:
    self._closed.set()

  def run(self) -> None:
    while True:
      limit = timeout(self.fixed, list(self.intervals), warming=self.beats < WARMUP)
      what = self.within[-1] if self.within else None
      if what is not None:
        limit = max(limit, PAUSED_MIN_SECS)
      step, last = self.done
      waited = time.monotonic() - last
      if waited >= limit and (not self.paused or what is not None):
        self._stuck(step, waited, what)
      if self._closed.wait(min(1.0, max(0.05, limit - waited))):
        return

  def _stuck(self, step: int, waited: float, what: str | None = None) -> None:
    if what is None:
      what, limit = f'step {step + 1}', '--step_timeout_secs, or max(600 s, 50 x the median step)'
    else:
      what, limit = f'{what} after step {step}', f'max({PAUSED_MIN_SECS:.0f} s, the step timeout)'
    line = (f'E-DIST-010: {what} did not complete within {waited:.0f} s (the last step done: '
            f"{step}; the timeout: {limit}); every thread's stack is in the log above; start the "
            'run again: it resumes from its last checkpoint (a hung collective: look for a '
            'stopped or stuck process)')
    try:
      logging.error('%s has not completed after %.0f s: every thread of this process:', what,
                    waited)
      sys.stdout.flush()
      sys.stderr.flush()
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
      # In a thread of its own, for a while: the stuck main thread may hold what they need.
      recording = threading.Thread(target=self._record, args=(line, step), daemon=True)
      recording.start()
      recording.join(RECORD_SECS)
    finally:
      print(f'jaxckpt: {line}', file=sys.stderr, flush=True)
      os._exit(1)  # pylint: disable=protected-access  # the main thread is stuck for good

  def _record(self, line: str, step: int) -> None:
    self.runlog.event('failed', error=line, step=step)
    self.runlog.status(state='failed', error=line, step=step)
    from jaxckpt.hosts import distributed  # pylint: disable=import-outside-toplevel
    distributed.failing()  # the other processes stop at once, naming this one


_active: list[StepWatch] = []


@contextlib.contextmanager
def watching(timeout_secs: float | None, runlog, step: int) -> Iterator[StepWatch]:
  """Watch the steps from `step` on while the block runs (the loop calls `beat`)."""
  watch = StepWatch(timeout_secs, runlog, step)
  watch.start()
  _active.append(watch)
  try:
    yield watch
  finally:
    _active.remove(watch)
    watch.close()


def beat(step: int) -> None:
  """`step` is done (a no-op outside `watching`)."""
  for watch in _active:
    watch.beat(step)


@contextlib.contextmanager
def paused(what: str | None = None) -> Iterator[None]:
  """Work between steps that is not a step: not timed as one, and the next step is timed from
  its end. `what` (an evaluation, the samples) is watched with a bound of its own (module
  docstring); None (a save) is left to the save's own bounded waits."""
  for watch in _active:
    watch.paused += 1
    if what is not None:
      watch.within.append(what)
  try:
    yield
  finally:
    now = time.monotonic()
    for watch in _active:
      watch.paused -= 1
      if what is not None:
        watch.within.remove(what)
      watch.done = (watch.done[0], now)
