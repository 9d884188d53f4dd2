"""What every jaxckpt entry point shares: one-line errors, exit codes, quiet library logs."""

from __future__ import annotations

import argparse
import logging as py_logging
import os
import select
import signal
import sys
from typing import Callable

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
