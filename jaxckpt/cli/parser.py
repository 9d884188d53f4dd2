"""What every jaxckpt entry point shares: one-line errors, exit codes, quiet library logs."""

from __future__ import annotations

import argparse
import logging as py_logging
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
  print(f'jaxckpt: {e.line()}', file=sys.stderr, flush=True)
  sys.exit(exit_code(e))


def run_reporting_errors(fn: Callable[[], int | None]) -> int:
  """Run `fn`; a `CheckpointError` (the trainer's errors included) becomes one line
  `jaxckpt: <code>: ...` and its exit code.

  So does a stop signal: `jaxckpt: interrupted by SIGTERM at step N`, exit 128+n.
  """
  try:
    return fn() or 0
  except CheckpointError as e:
    exit_with(e)
  except Interrupted as e:
    print(f'jaxckpt: {e}', file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


class _DropLibraryInfo(py_logging.Filter):
  """orbax and jax log INFO lines of their own (per save, per backend); keep only warnings."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    path = record.pathname.replace('\\', '/')
    return record.levelno >= py_logging.WARNING or not ('/orbax/' in path or '/jax/' in path)


def configure_logging() -> None:
  logging.get_absl_handler().addFilter(_DropLibraryInfo())
