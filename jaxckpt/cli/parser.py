"""What every jaxckpt entry point shares: one-line errors, exit codes, quiet library logs."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging as py_logging
import os
import re
import select
import signal
import sys
import threading
from typing import Any, Callable

from absl import logging

from jaxckpt.checkpoint.signals import Interrupted
from jaxckpt.errors import CheckpointError, UsageError, exit_code


class ArgumentParser(argparse.ArgumentParser):
  """argparse, but bad usage is one line `jaxckpt: E-USAGE-001: ...` and exit 2."""

  def error(self, message: str):
    raise UsageError('E-USAGE-001', f'{self.prog}: {message}', f'see `{self.prog} --help`')


def exit_with(e: CheckpointError) -> None:
  """Print `e` as one line and exit with its status (see `jaxckpt.errors.exit_code`)."""
  try:
    sys.stdout.flush()  # what was printed before the error goes first
  except BrokenPipeError:
    _drop_stdout()
  print(f'jaxckpt: {e.line()}', file=sys.stderr, flush=True)
  sys.exit(exit_code(e))


# At exit Python joins every thread still running (a ThreadPoolExecutor's workers included): one
# stuck in a read or write a hung disk or store never answers (after E-CKPT-017, say) would hold
# the process forever. The trainer's process waits this long for them, then exits without them.
EXIT_WAIT_SECS = 30.0


def exit_within(run: Callable[[], Any]) -> None:
  """`run()`, which ends by exiting (`absl.app.run`). The interpreter then joins the threads still
  running: past EXIT_WAIT_SECS this names them on stderr and ends the process with the same exit
  status, once the exit's own work (`atexit`: leaving the job) has run, within the same bound.
  For a command's own process only (`__main__`): the watcher it starts outlives `run`."""
  try:
    run()
  except SystemExit as e:
    _bound_exit(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    raise
  except KeyboardInterrupt:
    _bound_exit(128 + signal.SIGINT)
    raise
  except BaseException:
    _bound_exit(1)
    raise
  _bound_exit(0)


def _bound_exit(status: int) -> None:
  joined = threading.Event()
  atexit.register(joined.set)  # atexit runs once every thread has been joined

  def watch() -> None:
    if joined.wait(EXIT_WAIT_SECS):
      return
    # What the exit joins: threads not daemon, and executors' workers (`<prefix>_<n>`), which
    # concurrent.futures joins at exit whatever their daemon flag.
    left = sorted(
        t.name
        for t in threading.enumerate()
        if t not in (threading.main_thread(),
                     threading.current_thread()) and (not t.daemon or re.search(r'_\d+$', t.name)))
    print(
        f'jaxckpt: exiting without waiting any longer for thread(s) {", ".join(left) or "?"}: '
        f'still running {EXIT_WAIT_SECS:g} s after the end (a read or write that a disk or '
        'store does not answer)',
        file=sys.stderr,
        flush=True)
    # The exit's own work still runs (leaving the job, which may end the process itself), within
    # the same bound, from here: the main thread is still joining.
    leaving = threading.Thread(
        target=atexit._run_exitfuncs,  # pylint: disable=protected-access
        name='jaxckpt-atexit',
        daemon=True)
    leaving.start()
    leaving.join(EXIT_WAIT_SECS)
    for stream in (sys.stdout, sys.stderr):
      with contextlib.suppress(Exception):
        stream.flush()
    os._exit(status)

  threading.Thread(target=watch, name='jaxckpt-exit', daemon=True).start()


def run_reporting_errors(fn: Callable[[], int | None]) -> int:
  """Run `fn`; a `CheckpointError` (the trainer's errors included) becomes one line
  `jaxckpt: <code>: ...` and its exit code.

  So does a stop signal: `jaxckpt: interrupted by SIGTERM at step N`, exit 128+n. A reader of
  stdout that went away (`jaxckpt inspect CKPT --json | head -3`) ends it quietly with 141, the
  status a shell reports for `cat` or `seq` killed by SIGPIPE in the same place.
  """
  try:
    code = fn() or 0
    sys.stdout.flush()  # here, not at exit: a closed pipe is then seen below
    return code
  except CheckpointError as e:
    exit_with(e)
  except Interrupted as e:
    print(f'jaxckpt: {e}', file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  except BrokenPipeError:
    if not _stdout_closed():
      raise  # another pipe or socket: a bug or a store's failure, not the reader leaving
    _drop_stdout()
    sys.exit(128 + signal.SIGPIPE)


def _drop_stdout() -> None:
  """Python ignores SIGPIPE, so a write to a pipe without a reader fails instead of ending the
  process: what is still buffered goes nowhere, and the flush at exit must not fail again."""
  os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _stdout_closed() -> bool:
  """Whether stdout is a pipe or socket whose reader has gone (poll reports an error on it)."""
  try:
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
  except (AttributeError, OSError, ValueError):  # no poll, or no stdout descriptor
    return False


class _DropLibraryInfo(py_logging.Filter):
  """orbax and jax log INFO lines of their own (per save, per backend); keep only warnings."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    path = record.pathname.replace('\\', '/')
    return record.levelno >= py_logging.WARNING or not ('/orbax/' in path or '/jax/' in path)


def configure_logging() -> None:
  logging.get_absl_handler().addFilter(_DropLibraryInfo())
