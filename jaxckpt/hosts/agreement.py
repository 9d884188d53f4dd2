"""Saves and stops that happen after the same step on every process of a run.

One process asks the watcher, as always: the last step, the cadence, SIGUSR1 and a stop signal
each make a checkpoint of the step just done, and a stop signal ends the run after it.

Across processes, what is the same everywhere (the last step, a cadence counted in steps) is
decided on the spot. Anything else (a signal, a cadence counted in seconds, which clocks disagree
on) opens a *round* in the `jax.distributed` key-value store. A background thread on every
process notices the round and votes at once, independently of its training loop: the step its
loop last finished, and what this process wants (save, stop). All act after step
`max(votes) + 1`: no process has passed it, because each one waits, at the step after the one
it voted with, for the outcome, which takes only the other threads' votes, never another
loop's progress (a loop waiting on another loop is how collectives deadlock). Process 0's thread
reads the votes and posts the outcome as one key, so every other process's work per round is one
write and one read, whatever the number of processes.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Callable

from jaxckpt.checkpoint import signals
from jaxckpt.errors import JaxckptError
from jaxckpt.hosts import distributed

_ROUNDS = 'jaxckpt/run/round'
START_WAIT_SECS = 3600.0  # `stop_at_start`: the first compiles of every process


class Agreement:
  """`save_now(step, ...)` at each step boundary; `stop_signal` once the run must stop."""

  def __init__(self,
               watcher: signals.PreemptionWatcher,
               start_step: int,
               *,
               clocked: bool = False,
               cluster: distributed.Cluster | None = None):
    """`clocked`: the `exact` cadence of `save_now` reads a clock too (seconds between saves)."""
    self.watcher, self.cluster, self._clocked = watcher, cluster or distributed.current(), clocked
    self._agreed_stop: int | None = None
    self._cond = threading.Condition()
    self._position = start_step  # the step boundary this process's loop last passed
    self._want = False  # a save asked for here and not yet voted
    self._stop_asked = False  # this process's stop signal went into a vote
    self._round = 0  # the round this process votes in next
    self._opened = -1  # the last round this process opened
    self._voted_at: int | None = None  # the step of this process's vote still being counted
    self._decided: list[tuple[int, bool, int]] = []  # (step, save, signal) still ahead
    self._error: JaxckptError | None = None
    self._total: int | None = None  # the run's last step, once the loop said it
    self._closed = threading.Event()
    if self.cluster.count > 1:
      self._thread = threading.Thread(target=self._vote_loop, name='jaxckpt-agree', daemon=True)
      self._thread.start()
      distributed.on_exit(self.close)

  @property
  def stop_signal(self) -> int | None:
    return self.watcher.stop_signal if self.cluster.count == 1 else self._agreed_stop

  @property
  def stop_name(self) -> str | None:
    return None if self.stop_signal is None else signal.Signals(self.stop_signal).name

  def stop_at_start(self) -> None:
    """Before the first step: a stop signal any process got while the job started (restoring,
    compiling) stops every process now, with no step trained and no checkpoint, as one process's
    own signal does. One small exchange per start."""
    if self.cluster.count == 1:
      return
    mine = self.watcher.stop_signal
    # The processes get here after their first compiles, which one host's cold cache can make
    # far longer than another's: waited for as long as a first step may take.
    got = distributed.first_problem(
        'stop_at_start',
        str(mine) if mine else None,
        timeout=max(START_WAIT_SECS, self.cluster.timeout_secs),
        cluster=self.cluster)
    if got is not None:
      stop = int(got) if got.isdigit() and int(got) in _SIGNALS else None
      if not stop:  # a value no process writes (read from the key-value store)
        raise _bad(f'a stop at start of {got[:80]!r}')
      self._agreed_stop, self._stop_asked = stop, True

  def save_now(self, step: int, total: int, exact: Callable[[], bool],
               timed: Callable[[], bool]) -> bool:
    """Whether every process saves `step` now. `exact()`: the cadence asks for this step on every
    process alike (counted in steps); `timed()`: this process's clock asks (seconds, auto)."""
    if self.cluster.count == 1:
      return (step == total or exact() or timed() or self.watcher.take_save_request()
              or self.watcher.stop_signal is not None)
    if self._error is not None:
      raise self._error
    save = step == total or (not self._clocked and exact())
    with self._cond:
      self._position, self._total = step, total
      deadline = time.monotonic() + self.cluster.timeout_secs
      while self._voted_at is not None and self._voted_at + 1 <= step:  # its outcome first
        if self._error is not None:
          raise self._error
        if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
          raise JaxckptError(
              'E-DIST-005', f'at step {step}: no outcome of the vote this process cast at step '
              f'{self._voted_at} within {self.cluster.timeout_secs:g} s (process 0 posts it '
              'once every process voted)', 'every process must run the same command; a lost '
              'one is named by the others')
      now = [d for d in self._decided if d[0] == step]
      self._decided = [d for d in self._decided if d[0] != step]
      save = save or any(d[1] for d in now)
      if save:  # what this process asks for is in this checkpoint: no second round for it
        self._want = False
        self.watcher.take_save_request()
      elif step < total:
        self._want |= (self._clocked and exact()) or timed() or self.watcher.take_save_request()
      # A save or stop already agreed for a later step covers what is asked here; a vote still
      # being counted may too: ask in a new round only once that is known.
      want = self._want and not any(d[1] for d in self._decided)
      stop = self.watcher.stop_signal is not None and not self._stop_asked
      if (step < total and (want or stop) and self._opened < self._round
          and self._voted_at is None):
        self._opened = self._round
        self.cluster.client().key_value_set(
            f'{_ROUNDS}/{self._round}/open', '1', allow_overwrite=True)
    stops = [d[2] for d in now if d[2]]
    if stops and step < total:
      self._agreed_stop = stops[0]
    return save

  def _vote_loop(self) -> None:
    try:
      self._votes()
    except Exception as e:  # pylint: disable=broad-except  # never a silent thread: the loop hears
      with self._cond:
        self._error = self._error or JaxckptError(
            'E-DIST-005', f'the save and stop votes stopped: {type(e).__name__}: {e}',
            'start every process again with the same command to resume')
        self._cond.notify_all()

  def _votes(self) -> None:
    client, me = self.cluster.client(), self.cluster.index
    while not self._closed.is_set():
      r = self._round
      try:
        client.blocking_key_value_get(f'{_ROUNDS}/{r}/open', 1000)
      except Exception:  # pylint: disable=broad-except  # not opened yet
        continue
      with self._cond:
        stop = self.watcher.stop_signal or 0
        vote = [self._position, self._want or bool(stop), 0 if self._stop_asked else stop]
        self._want, self._stop_asked = False, self._stop_asked or bool(stop)
        self._voted_at = self._position
      client.key_value_set(f'{_ROUNDS}/{r}/vote/{me}', json.dumps(vote), allow_overwrite=True)
      decided = self._outcome(client, r) if self.cluster.leader else self._read_outcome(client, r)
      if isinstance(decided, JaxckptError):
        with self._cond:
          self._error = decided
          self._cond.notify_all()
        return
      outcome = tuple(decided)
      if self.cluster.leader and r >= 2:  # every process has counted round r - 2
        client.key_value_delete(f'{_ROUNDS}/{r - 2}')
      with self._cond:
        self._decided.append(outcome)
        self._voted_at, self._round = None, r + 1
        self._cond.notify_all()

  def _outcome(self, client, r: int) -> list | JaxckptError:
    """Process 0: every vote of round `r` read, the outcome posted (one small key the others read,
    so their work per round does not grow with the number of processes)."""
    n, votes = self.cluster.count, {}
    deadline = time.monotonic() + self.cluster.timeout_secs
    try:
      for k in range(n):
        left = max(1, int((deadline - time.monotonic()) * 1000))
        votes[k] = client.blocking_key_value_get(f'{_ROUNDS}/{r}/vote/{k}', left)
    except Exception:  # pylint: disable=broad-except  # the runtime's own error types
      missing = [k for k in range(n) if k not in votes]
      client.key_value_set(
          f'{_ROUNDS}/{r}/outcome', json.dumps({'missing': missing}), allow_overwrite=True)
      return _not_voted(missing, self.cluster.timeout_secs)
    for k, raw in sorted(votes.items()):
      votes[k] = _decision(raw, self._total)
      if votes[k] is None:  # read from the key-value store: a value no process writes
        line = f'process {k} voted {str(raw)[:80]!r}, not [step, save, signal]'
        client.key_value_set(
            f'{_ROUNDS}/{r}/outcome', json.dumps({'bad': line}), allow_overwrite=True)
        return _bad(line)
    stops = [v[2] for _, v in sorted(votes.items()) if v[2]]
    outcome = [
        max(v[0] for v in votes.values()) + 1,
        any(v[1] for v in votes.values()), stops[0] if stops else 0
    ]
    client.key_value_set(f'{_ROUNDS}/{r}/outcome', json.dumps(outcome), allow_overwrite=True)
    return outcome

  def _read_outcome(self, client, r: int) -> list | JaxckptError:
    """Another process: round `r`'s outcome as process 0 posted it, within the timeout (process 0
    waits as long for the votes, and posts which were missing when it gives up)."""
    wait_ms = int((2 * self.cluster.timeout_secs + 5) * 1000)
    try:
      raw = client.blocking_key_value_get(f'{_ROUNDS}/{r}/outcome', wait_ms)
    except Exception:  # pylint: disable=broad-except
      return _not_voted([0], 2 * self.cluster.timeout_secs + 5, what='post the outcome of')
    decided = _decision(raw, self._total)
    if decided is not None:
      return decided
    told = _loads(raw)
    if isinstance(told, dict) and isinstance(told.get('bad'), str):
      return _bad(told['bad'][:200])
    missing = told.get('missing') if isinstance(told, dict) else None
    if isinstance(missing, list) and all(type(k) is int for k in missing):  # pylint: disable=unidiomatic-typecheck
      return _not_voted(missing, self.cluster.timeout_secs)
    return _bad(f'process 0 posted the outcome {str(raw)[:80]!r}, not [step, save, signal]')

  def close(self) -> None:
    self._closed.set()
    if self.cluster.count > 1:
      self._thread.join(timeout=5)


def _not_voted(missing: list[int], secs: float, what: str = 'vote on') -> JaxckptError:
  return JaxckptError('E-DIST-005',
                      f'process(es) {missing} did not {what} a save or stop within {secs:g} s',
                      'every process must run the same command; a lost one is named by the others')


_SIGNALS = {0} | {int(s) for s in signals.STOP_SIGNALS}


def _loads(raw) -> object:
  try:
    return json.loads(raw)
  except (TypeError, ValueError, RecursionError):
    return None


def _decision(raw, total: int | None) -> list | None:
  """A vote or an outcome as a process writes it, [step, save, stop signal or 0], or None: a step
  that is not a whole number from 0 to the run's last, a save that is not true or false, a
  signal that is not a stop signal."""
  got = _loads(raw)
  if not isinstance(got, list) or len(got) != 3:
    return None
  step, save, stop = got
  if type(step) is not int or step < 0 or (total is not None and step > total + 1) or \
      type(save) is not bool or type(stop) is not int or stop not in _SIGNALS:  # pylint: disable=unidiomatic-typecheck
    return None
  return got


def _bad(line: str) -> JaxckptError:
  return JaxckptError('E-DIST-005', f'a save or stop vote that is not one: {line}',
                      'start every process again with the same command to resume')
