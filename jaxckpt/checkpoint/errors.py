"""Errors of the checkpoint library: a stable code, what is wrong, and how to fix it.

Every error the library raises on purpose is a `CheckpointError`; its text is one line,
`<code>: <what>; <fix>`. `ArgumentError` is the caller asking for something that cannot work (an
option out of range, a path that is not a committed checkpoint, a location that cannot be
listed); the others are trouble with the checkpoints themselves (damage, a failed write), where
whatever was committed before is intact. A program built on the library may subclass them for
its own errors, so that one handler prints them all the same way.
"""

from __future__ import annotations


class CheckpointError(Exception):
  """A problem with checkpoints the user can act on. `code` is stable (E-<AREA>-<NNN>)."""

  def __init__(self, code: str, what: str, fix: str = ''):
    self.code, self.what, self.fix = code, what, fix
    super().__init__(self.line())

  def line(self) -> str:
    return f'{self.code}: {self.what}' + (f'; {self.fix}' if self.fix else '')


class ArgumentError(CheckpointError):
  """What the caller asked for cannot work: fix the call, not the checkpoints."""
