"""Preemption signals, turned into flags the training loop polls at step boundaries.

- SIGTERM, SIGINT, SIGHUP: stop at the next step boundary, after a checkpoint of that step.
  A machine that shuts down sends SIGTERM (often with SIGHUP) and then waits a few seconds.
- A second SIGTERM or SIGINT (after a first SIGTERM or SIGINT): exit at once with 128+n, no
  checkpoint (a person insisting, or the grace period ending). A checkpoint being written is
  left as debris, never as a checkpoint.
  SIGHUP never does this: it arrives together with SIGTERM when a terminal or machine goes away.
- SIGUSR1: write a checkpoint at the next step boundary and keep training.

The handlers only set flags; everything else happens in the loop, in the main thread. An entry
point installs them with `install_until_exit()` before its slow imports, so that no signal finds
the process without them, from start-up to exit.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SAVE_SIGNAL = signal.SIGUSR1
_IMMEDIATE = (signal.SIGTERM, signal.SIGINT)


class PreemptionWatcher:
  """Installs the handlers on `__enter__`, restores the previous ones on the matching `__exit__`.

  Entering a watcher that is already installed (say, by `install_until_exit`) leaves the
  handlers alone, so the trainer can take a watcher its caller installed.
  """

  def __init__(self):
    self.stop_signal: int | None = None
    # Counts, not a flag: a handler can run between any two bytecodes of `take_save_request`,
    # and reading then clearing a flag would lose a SIGUSR1 landing in between.
    self._saves_received = 0
    self._saves_taken = 0
    self._insisted = False  # a SIGTERM or SIGINT has arrived
    self._depth = 0  # open `__enter__`s
    self._previous: dict[int, object] = {}

  @property
  def stop_name(self) -> str | None:
    return None if self.stop_signal is None else signal.Signals(self.stop_signal).name

  def take_save_request(self) -> bool:
    """True when a SIGUSR1 arrived since the last call (several between two calls: one True)."""
    received = self._saves_received  # one read; a signal after it is seen by the next call
    if received == self._saves_taken:
      return False
    self._saves_taken = received
    return True

  def _handle(self, signum, frame) -> None:
    if signum == SAVE_SIGNAL:
      self._saves_received += 1
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
    self._depth += 1
    # Only the main thread can install handlers.
    if self._depth == 1 and threading.current_thread() is threading.main_thread():
      for signum in (*STOP_SIGNALS, SAVE_SIGNAL):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    self._depth -= 1
    if self._depth == 0:
      for signum, handler in self._previous.items():
        signal.signal(signum, handler)
      self._previous.clear()

  def install_until_exit(self) -> 'PreemptionWatcher':
    """Install the handlers for the rest of the process (an entry point calls this first).

    A signal while the process winds down (after the last step, or after the run stopped) then
    changes nothing: the exit code stays the run's. Python restores the default actions (which
    kill) after its atexit callbacks; ours, registered before any library's, runs last and
    ignores these signals instead, for the few moments left.
    """
    self.__enter__()  # never exited
    atexit.register(self._ignore_from_now)
    return self

  def _ignore_from_now(self) -> None:
    if threading.current_thread() is threading.main_thread():
      for signum in (*STOP_SIGNALS, SAVE_SIGNAL):
        signal.signal(signum, signal.SIG_IGN)


class Interrupted(Exception):
  """The run stopped for a signal after checkpointing; the process should exit 128+signal."""

  def __init__(self, signum: int, step: int):
    self.signum, self.step = signum, step
    self.exit_code = 128 + signum
    super().__init__(f'interrupted by {signal.Signals(signum).name} at step {step}')
