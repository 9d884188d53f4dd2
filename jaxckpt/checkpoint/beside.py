"""Work on a thread of its own while the caller does something else (`meanwhile`).

A restart reads its checkpoint, or a fresh machine downloads it, while the caller's thread
compiles the first step: the wait is the longer of the two, not their sum. The compile stays on
the caller's thread, where a process that exits mid-compile does not abort.

The wait for the work is bounded by `stuck`, asked about once a second: the error it returns
ends the wait, named after what was waited for. When `meanwhile` fails, its error is raised once
the work has ended (or is stuck), so no work is left running behind it; the work's own error is
then logged, not lost.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

_log = logging.getLogger(__name__)


def beside(work: Callable[[], Any],
           meanwhile: Callable[[], Any],
           stuck: Callable[[], BaseException | None],
           *,
           name: str,
           poll_secs: float = 1.0) -> Any:
  """`work()` on thread `name` while `meanwhile()` runs here; returns what `work` returned, or
  raises its error (the caller's thread sees it as if it had run here). `stuck()` returns the
  error to raise when the work is taking too long, else None."""
  out: dict[str, Any] = {}

  def run():
    try:
      out['value'] = work()
    except BaseException as e:  # pylint: disable=broad-except  # raised in the caller's thread
      out['error'] = e

  thread = threading.Thread(target=run, name=name, daemon=True)
  thread.start()
  failed = None
  try:
    meanwhile()
  except BaseException as e:  # pylint: disable=broad-except  # raised once the work has ended
    failed = e
  while thread.is_alive():
    thread.join(poll_secs)
    if thread.is_alive() and (error := stuck()) is not None:
      raise failed or error
  if failed is not None:
    if 'error' in out:
      _log.error('%s failed too: %s: %s', name, type(out['error']).__name__, out['error'])
    raise failed
  if 'error' in out:
    raise out['error']
  return out['value']
