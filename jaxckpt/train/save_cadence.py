"""The trainer's save rules beyond the manager's own: `--checkpoint_every=auto` and
`--checkpoint_epochs`. The formulas are the library's (`jaxckpt.checkpoint.cadence`); this module
measures what they need in the training loop.

- δ, what one checkpoint costs the loop: the time the loop was held by the save (from the step
  boundary where it starts to `save()` returning, less what the loop would do anyway: flushing
  loss rows, `aside`), plus the slowdown of the steps that ran while the write was in flight
  (their time against the step time measured between writes), smoothed.
  Timing marks wait for the device (`block_until_ready` on the last step's metrics), only at a
  save and at the first step boundary after its commit, and on the first steps of each start.
  The first save of each start is not measured: it pays one-time costs (compilations, the first
  touch of the staging buffer) that later saves do not.
- M, learned from `events.jsonl` (`read_history`): each earlier start of the run that ended
  with no end record (SIGKILL, a lost VM, OOM), `interrupted` by SIGTERM or SIGHUP, or `failed`
  because a process of the job was lost (E-DIST-006, `lost_process`) counts as an interruption,
  over the running time of all starts; `cadence.blend_mtbi` mixes in the prior.
- The interval: `cadence.plan`, in steps from the step time measured on this start, re-planned
  at each commit; each plan is a `cadence` event, `status.json`'s `cadence` and the progress line.
  A checkpoint is never started before `durable()` says the previous one is (by default: it has
  committed; a remote tier passes "and uploaded"). Then δ's window, `durable_s` and the clean
  windows that time the steps all run to durability: an upload in flight is the save's cost.
- A failed save (`poll`, at every step boundary): logged and recorded (`save_failed`) at once,
  counted as ended (durable again), so the next cadence point, whatever the cadence, retries it;
  a failed retry stops the run (E-CKPT-001, naming the last good checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Mapping

from absl import flags, logging

from jaxckpt.checkpoint import ArgumentError, CheckpointError, CommitInfo, cadence
from jaxckpt.checkpoint.options import finite
from jaxckpt.records.runlog import RunLog, read_jsonl
from jaxckpt.records.workdir import EVENTS

# Records that end a start of the trainer (a segment); a SIGKILLed one has none.
ENDS = ('finished', 'interrupted', 'failed')
# A stop by this signal is a person (Ctrl-C), not the machine: not an interruption.
DELIBERATE = ('SIGINT',)
# Records written by another process between two starts: they do not date the earlier's end.
BETWEEN = ('lock_taken_over', 'pivot')
# The step time is measured on each start over this many steps or seconds, whichever first.
CALIBRATION_STEPS, CALIBRATION_S = 20, 1.0


class EveryFlagParser(flags.ArgumentParser):
  """`--checkpoint_every`: a whole number of steps or `auto`; anything else is a flag error."""

  def parse(self, argument):
    try:
      return cadence.parse_every(argument)
    except ArgumentError as e:
      raise ValueError(f'{e.what}; {e.fix}') from None

  def flag_type(self) -> str:
    return 'int or auto'


@dataclasses.dataclass(frozen=True)
class History:
  """What the run's earlier starts say about it."""
  interruptions: int  # starts that ended without a clean stop
  exposure_s: float  # their running time, from `started` to their last record
  delta_s: float | None = None  # the last measured cost of a checkpoint (None: never measured)


def read_history(events: Iterable[Mapping[str, Any]]) -> History:
  """Interruptions, running time and the last measured δ of the starts recorded in `events`.

  A start that ended `finished` or `failed` (an error to fix, not a preemption), or that was
  stopped by SIGINT or before a `pivot`, was not interrupted; one that `failed` because a process
  of the job was lost (`lost_process`: a host gone silent) was. A SIGKILLed start's running time
  ends at its last record (with auto, a `cadence` event at every commit).
  """
  interruptions, exposure, delta = 0, 0.0, None
  for segment in _segments(events):
    end = next((e for e in segment if e.get('event') in ENDS), None)
    last = end or [e for e in segment if e.get('event') not in BETWEEN][-1]
    # Rows are read, not trusted: a time that is no finite number adds no running time.
    began, ended = _number(segment[0].get('time')), _number(last.get('time'))
    if began is not None and ended is not None:
      exposure += max(0.0, ended - began)
    lost = end is not None and end['event'] == 'failed' and bool(end.get('lost_process'))
    if end is None or lost or (end['event'] == 'interrupted' and end.get('signal') not in DELIBERATE
                               and not any(e.get('event') == 'pivot' for e in segment)):
      interruptions += 1
    delta = next((_number(e.get('delta_s'))
                  for e in reversed(segment)
                  if e.get('event') == 'cadence' and e.get('delta_measured')
                  and e.get('tier', 'local') == 'local' and _number(e.get('delta_s')) is not None),
                 delta)  # not an upload's (`--replicas`); a cost that is no number: passed over
  return History(interruptions, exposure, delta)


def _segments(events: Iterable[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
  """The rows of each start, from its (first) `started` row on. A row is its start's by its
  `segment` field: the next start's rows from before its `started` (a download, the lease) are
  not the earlier one's, and a start that says `started` twice (it passed over a damaged
  checkpoint) is one start. Rows without one (older records), and those another process writes
  between two starts (`BETWEEN`), go with the start before them."""
  segments: dict[Any, list[Mapping[str, Any]]] = {}
  latest = None
  for e in events:
    seg = e.get('segment')
    own = type(seg) is int  # pylint: disable=unidiomatic-typecheck
    if e.get('event') == 'started':
      latest = seg if own else ('at', len(segments))
      segments.setdefault(latest, []).append(e)
    elif own and e.get('event') not in BETWEEN:
      segments.setdefault(seg, []).append(e)
    elif latest is not None:
      segments[latest].append(e)
  out = []
  for rows in segments.values():  # from the first `started`: a start that never said it ran no step
    first = next((k for k, e in enumerate(rows) if e.get('event') == 'started'), None)
    if first is not None:
      out.append(rows[first:])
  return out


def _number(value: Any) -> float | None:
  """`value` as a finite number of 0 or more (a time, a cost); None when it is not one."""
  number = finite(value)
  return number if number is not None and number >= 0 else None


def tree_nbytes(tree) -> int:
  import jax  # only when auto needs a prior for δ
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


@dataclasses.dataclass
class _Write:
  """A save whose write is in flight: where the loop was when `save()` returned."""
  time: float
  step: int
  blocked_s: float
  saves: int  # the save count it completes
  measured: bool = True  # False for the first save of a start: it pays one-time costs
  started: float = 0.0  # the step boundary where the save started


class SaveCadence:
  """When the loop saves beyond `CheckpointManager.should_save`: auto and per-epoch.

  The loop calls `start` once, `poll` and `after_step` after each step, `due` to decide,
  `saving`/`saved` around each save (whatever asked for it: every save restarts the interval),
  and `committed` from the manager's `on_commit`.
  """

  def __init__(self,
               config,
               runlog: RunLog,
               options: cadence.CadenceOptions,
               *,
               epoch: Callable[[int], float],
               state: Callable[[], Any],
               durable: Callable[[], bool] | None = None,
               clock: Callable[[], float] = time.perf_counter):
    self.auto = cadence.parse_every(config.checkpoint.every) == cadence.AUTO
    self.every_epochs = int(config.checkpoint.get('epochs', 0))
    self.options, self.runlog, self.clock = options, runlog, clock
    self.epoch, self._state = epoch, state
    self._durable = durable or self._ended
    self.beyond_commit = durable is not None  # durable means more than committed (uploaded)
    self.history = History(0, 0.0)
    if self.auto:
      self.history = read_history(read_jsonl(runlog.workdir / EVENTS))
    self.delta_s, self.delta_measured = self.history.delta_s, self.history.delta_s is not None
    self.step_s: float | None = None
    self.plan: cadence.Plan | None = None
    self.saves = self.commits = self.failed = 0  # a save ends committed or failed
    self._in_a_row = 0  # failed saves since the last commit
    self._inline: BaseException | None = None  # a save written inline (sync) that failed
    self._last_saved: int | None = None  # the step of the save in flight, or of the last one
    self.durable_s = 0.0  # how long the last save took to be durable
    self._started_at = clock()
    self._last_save_step = 0
    self._metrics = None
    self._clean: tuple[float, int] | None = None  # (time, step): no write in flight since
    self._write: _Write | None = None
    self._saving_at = 0.0
    self._aside_s = 0.0  # time inside this save that is not its cost
    # (time, step, loop seconds the measured saves cost so far) at the last step boundary: what
    # a second cadence (the remote's) measures its own cost against.
    self.position: tuple[float, int, float] = (clock(), 0, 0.0)
    self._spent_s = 0.0
    # Told each plan, for a second cadence that counts in these checkpoints (the remote's).
    self.on_plan: Callable[[cadence.Plan, int], None] = lambda plan, step: None

  @property
  def durable(self) -> Callable[[], bool]:
    return self._durable

  @durable.setter
  def durable(self, test: Callable[[], bool]) -> None:  # e.g. "and uploaded" (`RemoteRun.chain`)
    self._durable, self.beyond_commit = test, True

  def _ended(self) -> bool:
    return self.commits + self.failed >= self.saves

  # ------------------------------------------------------------------------------ the loop
  def start(self, step: int) -> None:
    self._last_save_step, self._started_at = step, self.clock()

  def after_step(self, step: int, metrics: Any) -> None:
    self._metrics = metrics
    if not self.auto:
      return
    self.position = (self.clock(), step, self._spent_s)
    if self._clean is None and self._write is None:
      if self.durable():  # compiled, and no upload in flight (one from the start, a failed save)
        self._clean = (self._sync(), step)
    elif self._write is not None and self.commits >= self._write.saves and self.durable():
      self._measure_write(step)
    elif self.step_s is None and self._clean is not None:  # calibrating the step time
      t, (t0, s0) = self._sync(), self._clean
      if step - s0 >= CALIBRATION_STEPS or (t - t0 >= CALIBRATION_S and step > s0):
        self.step_s = (t - t0) / (step - s0)
        self._replan(step)

  def due(self, step: int) -> bool:
    if self.every_epochs and cadence.epoch_ended(
        self.epoch(step - 1), self.epoch(step), self.every_epochs):
      return True
    return (self.auto and self.plan is not None
            and step - self._last_save_step >= self.plan.interval_steps and self.durable())

  def saving(self, step: int) -> None:
    """A save of `step` starts (call before anything else the save does)."""
    self._last_save_step = step
    if not self.auto:
      return
    self._saving_at = t = self._sync()
    self._aside_s = 0.0
    if self._clean is not None and step > self._clean[1]:
      sample = (t - self._clean[0]) / (step - self._clean[1])
      self.step_s = cadence.smooth(self.step_s, sample)
    self._clean = None
    self._write = None  # one still unmeasured: this save came first; it goes unmeasured

  def saved(self, step: int) -> None:
    """`save()` returned: the write is in flight (or, in sync mode, done)."""
    self.saves += 1
    self._last_saved = step
    if self.auto:
      t = self.clock()
      blocked = t - self._saving_at - self._aside_s
      self._write = _Write(
          t, step, blocked, self.saves, measured=self.saves > 1, started=self._saving_at)

  @contextlib.contextmanager
  def aside(self):
    """Work done inside a save that is not the save's cost (it would be done anyway)."""
    t = self.clock()
    try:
      yield
    finally:
      self._aside_s += self.clock() - t

  def committed(self, info: CommitInfo) -> None:
    """From `on_commit`, on the manager's thread."""
    self.durable_s = info.seconds_to_commit
    self._in_a_row = 0
    self.commits += 1

  def failed_inline(self, error: BaseException) -> None:
    """A save written inline (sync mode, or auto short of memory) failed in `save()`: heard by
    the next `poll`, as a background one is."""
    self._inline = error

  def poll(self, mgr, step: int, *, wait: bool = False) -> bool:
    """At the step boundary `step`: hears of a background save that failed, at once (`wait`:
    after waiting for the save in flight, before a save or at the end). It is logged, recorded
    (`save_failed`) and counted as ended, so `durable()` holds again and the next cadence point
    retries it; the retry failing too stops the run (E-CKPT-001, naming the last good
    checkpoint). False when a failure was counted."""
    if self._inline is not None:
      error, self._inline = self._inline, None
    elif not wait:
      error = mgr.take_error()
    else:
      try:
        mgr.wait_until_finished()
        error = None
      except Exception as e:  # noqa: BLE001 - the manager's CheckpointError: counted below
        error = e
    if error is None:
      return True
    self.failed += 1
    self._in_a_row += 1
    self._write = self._clean = None  # neither measured: the write never became durable
    line = error.line() if isinstance(error,
                                      CheckpointError) else f'{type(error).__name__}: {error}'
    latest = mgr.latest_step()
    good = 'no checkpoint of this run is committed' if latest is None else \
        f'the last good checkpoint is step {latest} ({mgr.step_dir(latest)})'
    self.runlog.event(
        'save_failed',
        step=self._last_saved,
        heard_at=step,
        error=line,
        last_good=latest,
        retry=self._in_a_row > 1)
    if self._in_a_row > 1:
      what, fix = line, 'fix the cause and run the same command to continue from it' if \
          latest is not None else 'fix the cause and run the same command: it starts again'
      if isinstance(error, CheckpointError):  # its own code unless it is this one, and its fix
        what = error.what if error.code == 'E-CKPT-001' else f'{error.code}: {error.what}'
        fix = fix if error.code == 'E-CKPT-001' or not error.fix else error.fix
      raise CheckpointError(
          'E-CKPT-001', f'checkpoint step {self._last_saved} failed, the retry of a failed one: '
          f'{what}', f'{good}; {fix}') from error
    logging.error(
        'checkpoint step %s failed: %s; the next checkpoint retries it, and the run '
        'stops if that fails too (%s)', self._last_saved, line, good)
    return False

  def note(self) -> str:
    """For the progress line."""
    return f'  ckpt every {self.plan.interval_steps} steps (auto)' if self.plan else ''

  # ----------------------------------------------------------------------------- measuring
  def _sync(self) -> float:
    if self._metrics is not None:
      import jax
      jax.block_until_ready(self._metrics)
    return self.clock()

  def _measure_write(self, step: int) -> None:
    t, write = self._sync(), self._write
    self._write, self._clean = None, (t, step)
    if self.beyond_commit:  # durable once uploaded too: seen at this step boundary
      self.durable_s = max(self.durable_s, t - write.started)
    if not write.measured:
      self._spent_s += write.blocked_s  # not a sample of δ, but the loop's time all the same
      if self.plan is None:  # it came before the step time was measured (SIGUSR1, an epoch)
        self._replan(step)
      return
    slowdown = cadence.write_slowdown(t - write.time, step -
                                      write.step, self.step_s) if self.step_s else 0.0
    sample = write.blocked_s + slowdown
    self._spent_s += sample
    self.delta_s = cadence.smooth(self.delta_s if self.delta_measured else None, sample)
    self.delta_measured = True
    self._replan(step, blocked_s=round(write.blocked_s, 6), slowdown_s=round(slowdown, 6))

  def _replan(self, step: int, **measured: float) -> None:
    if self.step_s is None:
      return
    delta = self.delta_s if self.delta_measured else cadence.prior_delta(tree_nbytes(self._state()))
    exposure = self.history.exposure_s + self.clock() - self._started_at
    mtbi = cadence.blend_mtbi(self.options.mtbi_s, self.history.interruptions, exposure,
                              self.options.prior_weight)
    self.plan = cadence.plan(delta, mtbi, self.step_s, self.options, durable_s=self.durable_s)
    fields = {
        **self.plan.as_dict(), 'delta_measured': self.delta_measured,
        'interruptions': self.history.interruptions, 'exposure_s': round(exposure, 3),
        'prior_mtbi_s': self.options.mtbi_s, 'durable_s': round(self.durable_s, 6), **measured
    }
    self.runlog.event('cadence', step=step, tier='local', **fields)
    p = self.plan
    self.runlog.status(
        cadence={
            'interval_steps': p.interval_steps, 'interval_s': round(p.interval_s, 3),
            'delta_s': round(p.delta_s, 6), 'mtbi_s': round(p.mtbi_s, 1), 'overhead_pct': round(
                p.overhead_pct, 4), 'lost_s': round(p.lost_s, 3)
        })
    logging.info(
        'cadence: a checkpoint every %d steps (%s, %s): δ %.3g s%s, M %s (%d interruption(s) '
        'in %s), overhead %.2g%%, %s lost per interruption', p.interval_steps,
        cadence.human(p.interval_s), p.bound, p.delta_s,
        '' if self.delta_measured else ' (a guess)', cadence.human(p.mtbi_s),
        self.history.interruptions, cadence.human(exposure), p.overhead_pct,
        cadence.human(p.lost_s))
    self.on_plan(p, step)
