"""A lost process, named: signs of life in the `jax.distributed` key-value store.

Each process posts a sign of life every round (`Watchdog.period`); process 0 alone reads them
all and, when one failed, failed at start or fell silent for `heartbeat_secs`, posts one
verdict that every other process reads (two small keys a round each: process 0's own sign and
the verdict). The coordinator lives in process 0, and a process still connected when it goes is
aborted by JAX: so each other process says it exits just before it does, and process 0 stays
until every one not lost has said so (`EXIT_SECS` at most).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable

_PREFIX = 'jaxckpt/run'
_AT_START = 'at start: '  # 'failed at start: LINE': the last word of a process failed at start
_peer_stopped: list[str] = []  # the E-DIST-009 line of a process that failed at start
_records: list[Any] = []  # the run log a lost process is recorded in

_VERDICT = f'{_PREFIX}/verdict'  # process 0's word: who failed at start, failed or was lost
_EXITING = f'{_PREFIX}/exiting/'  # a process's last word after a verdict, just before its exit
EXIT_SECS = 10.0  # how long process 0 waits for the others' last words before it exits
EXIT_GRACE = 0.25  # and then, for the last one to go from its word to its exit


def _try_get(client, key: str) -> str | None:
  """`key`'s value, None while it is not set; any other error is the coordinator's."""
  try:
    return client.key_value_try_get(key)
  except Exception as e:  # pylint: disable=broad-except  # the runtime's own error types
    if 'NOT_FOUND' in str(e) or 'not found' in str(e).lower():
      return None
    raise


def _verdict(raw: str, count: int) -> dict[str, Any] | None:
  """Process 0's verdict as `_tell` writes it ({'started': line} or {'lost': [k...], 'why':
  line}), or None when it is not one (read from the key-value store: checked)."""
  try:
    told = json.loads(raw)
  except (ValueError, RecursionError):
    return None
  if not isinstance(told, dict):
    return None
  if isinstance(told.get('started'), str):
    return told
  lost, why = told.get('lost'), told.get('why')
  if isinstance(why, str) and isinstance(lost, list) and lost and all(
      type(k) is int and 0 <= k < count for k in lost):  # pylint: disable=unidiomatic-typecheck
    return told
  return None


class Watchdog(threading.Thread):
  """Signs of life in the key-value store; a process silent for `heartbeat_secs` is lost.

  Every process then exits 1 with E-DIST-006 naming it (after `on_lost`, which records it):
  the collective it may be blocked in, or the save barrier it waits at, never returns.
  """

  def __init__(self, cluster, on_lost: Callable[[str], None] | None = None):
    super().__init__(name='jaxckpt-watchdog', daemon=True)
    self.cluster, self.on_lost = cluster, on_lost
    self.period = max(0.2, min(2.0, cluster.heartbeat_secs / 10))
    self.lost = threading.Event()
    self._finished = threading.Event()

  def finish(self, failed: bool, why: str = '') -> None:
    """Stop watching, and leave the word 'done' or 'failed' (and `why`) instead of a sign of
    life. Once: the first word stays."""
    if self._finished.is_set():
      return
    self._finished.set()
    if threading.current_thread() is not self:
      self.join(timeout=10)
    try:
      self.cluster.client().key_value_set(
          f'{_PREFIX}/alive/{self.cluster.index}',
          ('failed' + (f' {why}' if why else '')) if failed else 'done',
          allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  # the coordinator may be gone already
      pass

  def run(self) -> None:
    # Process 0 reads every sign of life and posts its verdict (`_VERDICT`); each other process
    # posts its own sign and reads two keys, process 0's sign and its verdict: O(1) per round.
    client, me = self.cluster.client(), self.cluster.index
    watched = range(self.cluster.count) if me == 0 else [0]
    # Every process joined `jax.distributed.initialize` before this starts: all count from now.
    seen: dict[int, tuple[str | None, float]] = {k: (None, time.monotonic()) for k in watched}
    beat, unreachable_since = 0, None
    while not self._finished.is_set():
      now = time.monotonic()
      try:
        beat += 1
        client.key_value_set(f'{_PREFIX}/alive/{me}', str(beat), allow_overwrite=True)
        if me == 0:
          alive, verdict = dict(client.key_value_dir_get(f'{_PREFIX}/alive/')), None
        else:
          alive = {f'{_PREFIX}/alive/0': _try_get(client, f'{_PREFIX}/alive/0')}
          verdict = _try_get(client, _VERDICT)
        unreachable_since = None
      except Exception:  # pylint: disable=broad-except  # the coordinator (process 0) is gone
        unreachable_since = unreachable_since or now
        if now - unreachable_since > self.cluster.heartbeat_secs:
          self._stop_all([0], 'the coordinator stopped answering')
        self._finished.wait(self.period)
        continue
      if verdict:  # process 0 found a process failed at start, failed or lost
        told = _verdict(verdict, self.cluster.count)
        if told is None:  # never a dead watchdog: process 0 would find this process silent
          self._stop_all([0], f'its verdict is not one: {verdict[:80]!r}', timed=False)
        elif 'started' in told:
          return self._stop_started(told['started'])
        else:
          self._stop_all(told['lost'], told['why'])
      for k in watched:
        value = alive.get(f'{_PREFIX}/alive/{k}')
        if value == 'done':  # ended as it should: never lost
          seen[k] = (value, math.inf)
        elif value is not None and seen[k][0] != value:
          seen[k] = (value, now)
      words = {k: str(alive.get(f'{_PREFIX}/alive/{k}') or '') for k in watched}
      for k in (k for k in watched if k != me and words[k].startswith('failed ' + _AT_START)):
        what = words[k].partition(_AT_START)[2]
        return self._stop_started(f'another process stopped: [process {k}] {what}')
      failed = [k for k in watched if words[k].startswith('failed')]
      silent = [k for k in watched if k != me and now - seen[k][1] > self.cluster.heartbeat_secs]
      if failed or silent:
        self._stop_all(failed or silent, 'it failed' if failed else 'no sign of life')
      self._finished.wait(self.period)

  def _tell(self, verdict: dict) -> float:
    """Process 0: post `verdict` for the others. It returns when this process may exit: the
    coordinator lives in process 0, so it stays until each other had two rounds to read it."""
    if self.cluster.index != 0:
      return 0.0
    try:
      self.cluster.client().key_value_set(_VERDICT, json.dumps(verdict), allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  # the others still find it silent
      return 0.0
    return time.monotonic() + 2 * self.period + 0.5

  def _stop_started(self, what: str) -> None:
    """E-DIST-009: raised by `_wait` on the main thread (which unwinds, releasing what it
    holds), else (it is in a collective that never returns) exit 2 from here."""
    _peer_stopped.append(what)
    stay = self._tell({'started': what})
    # The main thread raised it, and is on its way out:
    if self._finished.wait(max(5.0, stay - time.monotonic())):
      return
    line = f'E-DIST-009: {what}; fix what that line says, then start every process again'
    try:
      for log in _records:
        log.event('failed', error=line)
        log.status(state='failed', error=line)
    finally:
      print(f'jaxckpt: {line}', file=sys.stderr, flush=True)
      os._exit(2)  # pylint: disable=protected-access  # as E-DIST-009 from `together`

  def _stop_all(self, lost: list[int], why: str, timed: bool = True) -> None:
    timed = timed and why != 'it failed'
    how = f'{why} for {self.cluster.heartbeat_secs:g} s' if timed else why
    line = (f'E-DIST-006: process(es) {lost} of {self.cluster.count} lost ({how}); this '
            'process stops too, nothing partial is '
            'committed; start every process again with the same command to resume from the last '
            'checkpoint')
    self.lost.set()
    try:
      self._tell({'lost': lost, 'why': why})
      for log in _records:  # process 0's records say why the run stopped
        log.event('failed', error=line, lost_process=why != 'it failed')  # silent: an interruption
        log.status(state='failed', error=line)
      if self.on_lost is not None:
        self.on_lost(line)
    finally:
      print(f'jaxckpt: {line}', file=sys.stderr, flush=True)
      self._exit(1, set(range(self.cluster.count)) - set(lost))

  def _exit(self, code: int, living: set[int]) -> None:
    """os._exit(code) (the main thread may be stuck for good), once the coordinator may go: a
    process other than 0 says it exits, then exits; process 0 waits (`EXIT_SECS` at most) until
    every other process in `living` has said so, then exits, naming any that did not."""
    me, waiting = self.cluster.index, set(living) - {self.cluster.index}
    try:
      client = self.cluster.client()
      if me != 0 and 0 in living:  # a lost coordinator is not told: the call could hang
        client.key_value_set(f'{_EXITING}{me}', str(code), allow_overwrite=True)
      deadline = time.monotonic() + EXIT_SECS
      for k in sorted(waiting) if me == 0 else []:  # as `joining.leave` waits, one shared deadline
        try:
          client.blocking_key_value_get(f'{_EXITING}{k}',
                                        int(max(1, 1000 * (deadline - time.monotonic()))))
          waiting.discard(k)
        except Exception:  # pylint: disable=broad-except  # silent past the deadline: named below
          pass
      if me == 0 and waiting:
        print(
            f'jaxckpt: process(es) {sorted(waiting)} did not say they were exiting within '
            f'{EXIT_SECS:g} s: process 0 (the coordinator) exits anyway',
            file=sys.stderr,
            flush=True)
      elif me == 0 and len(living) > 1:
        time.sleep(EXIT_GRACE)  # the last word is said just before its process exits
    except Exception:  # pylint: disable=broad-except  # the coordinator is gone: no one to tell
      pass
    finally:
      os._exit(code)  # pylint: disable=protected-access
