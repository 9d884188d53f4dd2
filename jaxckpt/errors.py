"""Errors a user can act on. Each has a stable code, says what is wrong and how to fix it.

The trainer's errors share the checkpoint library's one-line form (`JaxckptError` subclasses
`jaxckpt.checkpoint.CheckpointError`), so one handler reports both: `main` and the `jaxckpt`
command print `jaxckpt: <code>: <what>; <fix>` and exit with `exit_code` (2 for usage and
configuration problems, 1 otherwise). Tracebacks are kept for bugs.
"""

from __future__ import annotations

from jaxckpt.checkpoint.errors import ArgumentError, CheckpointError

__all__ = [
    'ArgumentError', 'CheckpointError', 'ConfigError', 'JaxckptError', 'ResumeError', 'UsageError',
    'exit_code'
]


class JaxckptError(CheckpointError):
  """A problem the user can fix, found by the trainer or a `jaxckpt` tool."""

  exit_code = 1


class UsageError(JaxckptError):
  """Bad flags, config or command: exit 2."""

  exit_code = 2


class ConfigError(UsageError):
  pass


class ResumeError(UsageError):
  """The run cannot be resumed as asked (or cannot safely start fresh)."""


def exit_code(e: CheckpointError) -> int:
  """The exit status for `e`: its own, or 2 for a library `ArgumentError`, else 1."""
  return getattr(e, 'exit_code', 2 if isinstance(e, ArgumentError) else 1)
