"""Errors a user can act on. Each has a stable code, says what is wrong and how to fix it.

`main` and the `jaxckpt` command print them as one line, `jaxckpt: <code>: <what>; <fix>`, and exit
with `exit_code` (2 for usage and configuration problems). Tracebacks are kept for bugs.
"""

from __future__ import annotations


class JaxckptError(Exception):
  """A problem the user can fix. `code` is stable across versions (E-<AREA>-<NNN>)."""

  exit_code = 1

  def __init__(self, code: str, what: str, fix: str = ''):
    self.code, self.what, self.fix = code, what, fix
    super().__init__(self.line())

  def line(self) -> str:
    return f'{self.code}: {self.what}' + (f'; {self.fix}' if self.fix else '')


class UsageError(JaxckptError):
  """Bad flags, config or command: exit 2."""

  exit_code = 2


class ConfigError(UsageError):
  pass


class ResumeError(UsageError):
  """The run cannot be resumed as asked (or cannot safely start fresh)."""


class CheckpointError(JaxckptError):
  """Saving or loading a checkpoint failed; whatever was committed before is intact."""
