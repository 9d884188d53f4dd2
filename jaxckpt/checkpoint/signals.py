"""Preemption signals, turned into flags the training loop polls at step boundaries.

- SIGTERM, SIGINT, SIGHUP: stop at the next step boundary, after a checkpoint of that step.
  A machine that shuts down sends SIGTERM (often with SIGHUP) and then waits a few seconds.
- A second SIGTERM or SIGINT (after a first SIGTERM or SIGINT): exit at once with 128+n, no checkpoint (a person insisting, or the
  grace period ending). A checkpoint being written is left as debris, never as a checkpoint.
  SIGHUP never does this: it arrives together with SIGTERM when a terminal or machine goes away.
- SIGUSR1: write a checkpoint at the next step boundary and keep training.

The handlers only set flags; everything else happens in the loop, in the main thread.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SAVE_SIGNAL = signal.SIGUSR1
_IMMEDIATE = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatcher:
  """Installs the handlers on `__enter__`, restores the previous ones on `__exit__`."""

  def __init__(self):
    self.stop_signal: int | None = None
    self._save_requested = False
    self._insisted = False  # a SIGTERM or SIGINT has arrived
    self._previous: dict[int, object] = {}

  @property
  def stop_name(self) -> str | None:
    return None if self.stop_signal is None else signal.Signals(self.stop_signal).name

  def take_save_request(self) -> bool:
    """True once for each SIGUSR1 received since the last call."""
    requested, self._save_requested = self._save_requested, False
    return requested

  def _handle(self, signum, frame) -> None:
    if signum == SAVE_SIGNAL:
      self._save_requested = True
      return
    if signum in _IMMEDIATE:
      if self._insisted:
        name = signal.Signals(signum).name
        os.write(2, f'jaxckpt: second {name}: exiting now without a checkpoint\n'.encode())
        os._exit(128 + signum)
      self._insisted = True
    if self.stop_signal is None:
      self.stop_signal = signum

  def __enter__(self) -> 'PreemptionWatcher':
    if threading.current_thread() is threading.main_thread():  # only there can Python install them
      for signum in (*STOP_SIGNALS, SAVE_SIGNAL):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()


class Interrupted(Exception):
  """The run stopped for a signal after checkpointing; the process should exit 128+signal."""

  def __init__(self, signum: int, step: int):
    self.signum, self.step = signum, step
    self.exit_code = 128 + signum
    super().__init__(f'interrupted by {signal.Signals(signum).name} at step {step}')


def report_and_exit(e: Interrupted) -> None:
  print(f'jaxckpt: {e}', file=sys.stderr, flush=True)
  sys.exit(e.exit_code)
