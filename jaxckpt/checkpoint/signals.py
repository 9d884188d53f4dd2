"""Preemption signals, turned into flags the training loop polls at step boundaries.

- SIGTERM, SIGINT, SIGHUP: stop at the next step boundary, after a checkpoint of that step.
  A machine that shuts down sends SIGTERM (often with SIGHUP) and then waits a few seconds.
- A second SIGTERM or SIGINT (after a first SIGTERM or SIGINT): exit at once with 128+n, no
  checkpoint (a person insisting, or the grace period ending). A checkpoint being written is
  left as debris, never as a checkpoint. Hooks given to `on_exit_now` (a status file to mark)
  run first, EXIT_NOW_HOOK_SECS at most in all.
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
import time
from typing import Callable

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
    # Where the loop was when the stop signal arrived: it sets `position` at each step boundary
    # (any number it likes, say the step dispatched last); the handler notes it and the time.
    self.position: int | None = None
    self.stop_position: int | None = None
    self.stop_time: float | None = None  # time.monotonic() at the first stop signal
    self.save_request_time: float | None = None  # time.monotonic() at the newest SIGUSR1
    # Counts, not a flag: a handler can run between any two bytecodes of `take_save_request`,
    # and reading then clearing a flag would lose a SIGUSR1 landing in between.
    self._saves_received = 0
    self._saves_taken = 0
    self._insisted = False  # a SIGTERM or SIGINT has arrived
    self._depth = 0  # open `__enter__`s
    self._previous: dict[int, object] = {}
    self._wakeup: _SecondSignal | None = None

  @property
  def stop_name(self) -> str | None:
    return None if self.stop_signal is None else signal.Signals(self.stop_signal).name

  @property
  def save_requested(self) -> bool:
    """Whether a SIGUSR1 arrived that `take_save_request` has not taken yet (takes nothing)."""
    return self._saves_received != self._saves_taken

  def take_save_request(self) -> bool:
    """True when a SIGUSR1 arrived since the last call (several between two calls: one True)."""
    received = self._saves_received  # one read; a signal after it is seen by the next call
    if received == self._saves_taken:
      return False
    self._saves_taken = received
    return True

  def _handle(self, signum, frame) -> None:
    if signum == SAVE_SIGNAL:
      self.save_request_time = time.monotonic()
      self._saves_received += 1
      return
    if signum in _IMMEDIATE:
      if self._insisted:
        _exit_now(signum)
      self._insisted = True
    if self.stop_signal is None:
      self.stop_time, self.stop_position = time.monotonic(), self.position
      self.stop_signal = signum

  def seconds_since_stop(self) -> float | None:
    """Seconds since the first stop signal arrived (None: none arrived in this process)."""
    return None if self.stop_time is None else time.monotonic() - self.stop_time

  def __enter__(self) -> 'PreemptionWatcher':
    self._depth += 1
    # Only the main thread can install handlers.
    if self._depth == 1 and threading.current_thread() is threading.main_thread():
      for signum in (*STOP_SIGNALS, SAVE_SIGNAL):
        self._previous[signum] = signal.signal(signum, self._handle)
      self._wakeup = _SecondSignal()
    return self

  def __exit__(self, *exc) -> None:
    self._depth -= 1
    if self._depth == 0:
      for signum, handler in self._previous.items():
        signal.signal(signum, handler)
      self._previous.clear()
      if self._wakeup is not None:
        self._wakeup.close()
        self._wakeup = None

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


_exiting = threading.Lock()
_hooks: list[Callable[[str], None]] = []
EXIT_NOW_HOOK_SECS = 2.0  # a hook that hangs (a hung disk, a lock the main thread holds) is left


def on_exit_now(hook: Callable[[str], None]) -> Callable[[], None]:
  """`hook(signal_name)` runs when a second stop signal exits the process at once, in a thread of
  its own, EXIT_NOW_HOOK_SECS at most for all hooks together; returns what removes it."""
  _hooks.append(hook)
  return lambda: hook in _hooks and _hooks.remove(hook)


def _run_hooks(name: str) -> None:
  for hook in list(_hooks):
    try:
      hook(name)
    except Exception as e:  # pylint: disable=broad-except  # exiting anyway: say it, go on
      os.write(2, f'jaxckpt: while exiting: {type(e).__name__}: {e}\n'.encode())


def _exit_now(signum: int) -> None:
  if _exiting.acquire(blocking=False):  # the handler and `_SecondSignal` may both get here
    name = signal.Signals(signum).name
    os.write(2, f'jaxckpt: second {name}: exiting now without a checkpoint\n'.encode())
    if _hooks:
      last = threading.Thread(target=_run_hooks, args=(name,), name='jaxckpt-exit', daemon=True)
      last.start()
      last.join(EXIT_NOW_HOOK_SECS)
    os._exit(128 + signum)


class _SecondSignal(threading.Thread):
  """The second SIGTERM or SIGINT, even while the main thread is stuck in C++ (a hung
  collective), where no Python handler runs until it returns: the C-level handler writes each
  signal's number to the wakeup fd at once, and this thread reads it."""

  def __init__(self):
    super().__init__(name='jaxckpt-signals', daemon=True)
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    self.start()

  def run(self) -> None:
    stops = 0
    while data := os.read(self._read, 64):  # b'': closed
      for signum in data:
        stops += signum in _IMMEDIATE
        if stops >= 2:
          _exit_now(signum)
    os.close(self._read)

  def close(self) -> None:
    signal.set_wakeup_fd(self._previous_fd)
    os.close(self._write)


class Interrupted(Exception):
  """The run stopped for a signal after checkpointing; the process should exit 128+signal."""

  def __init__(self, signum: int, step: int, detail: str = ''):
    self.signum, self.step = signum, step
    self.exit_code = 128 + signum
    super().__init__(f'interrupted by {signal.Signals(signum).name} at step {step}' +
                     (f' ({detail})' if detail else ''))
