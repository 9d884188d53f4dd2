"""What every jaxckpt entry point shares: one-line errors, exit codes, quiet library logs."""

from __future__ import annotations

import logging as py_logging
import sys
from typing import Callable

from absl import flags, logging

from jaxckpt.errors import JaxckptError


def parse_flags_or_exit(argv: list[str]) -> list[str]:
  """absl flag parsing, but a bad flag is one line on stderr and exit 2 (not 1 and a page)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    print(f'jaxckpt: E-USAGE-001: {e}; see --help', file=sys.stderr)
    sys.exit(2)


def run_reporting_errors(fn: Callable[[], int | None]) -> int:
  """Run `fn`; a `JaxckptError` becomes one line `jaxckpt: <code>: ...` and its exit code."""
  try:
    return fn() or 0
  except JaxckptError as e:
    print(f'jaxckpt: {e.line()}', file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


class _DropLibraryInfo(py_logging.Filter):
  """orbax and jax log INFO lines of their own (per save, per backend); keep only warnings."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    path = record.pathname.replace('\\', '/')
    return record.levelno >= py_logging.WARNING or not ('/orbax/' in path or '/jax/' in path)


def configure_logging() -> None:
  logging.get_absl_handler().addFilter(_DropLibraryInfo())
