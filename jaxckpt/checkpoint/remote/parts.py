"""One remote commit from many processes (`jax.distributed`): each uploads its own part.

Each process uploads the state file it wrote (`state/process_<k>.safetensors`), from its own disk
or the shared one, and says so in the job's key-value store; process 0 uploads everything else
(the run state, the records) and writes the manifest, the remote commit, only once every other
process has said its part of that step is there. Every process writes under the one attempt name
process 0 chose (`name_attempt`, `attempt`): the parts of a job that lost the prefix land where
no commit of the job that holds it points. A process whose upload fails says why, and
tries again; process 0 goes on waiting, unless a newer checkpoint is due first (`Superseded`).
A process that has not begun its part of the step, nor said anything of it, PART_SILENCE_SECS
after process 0 began waiting is named (E-DIST-002: the uploader's error in `status.json`, an
`upload_failed` event), and process 0 goes on waiting. One that uploads says so as it goes
(`moving`, at most once every MOVING_SECS; a large part takes minutes, each request is bounded,
and a failure is a word). A process that moved on no upload at all for PART_STALL_SECS (a
stuck uploader thread, a dead process the job has not noticed) ends the wait: E-DIST-002 names
it, the step is not committed remotely, and the next checkpoint's upload waits for it again.
When process 0 loses the lease, its word stops every process's uploads (`stop`).
"""

from __future__ import annotations

import re
import time
from typing import Callable, Iterable

from .. import layout
from ..errors import CheckpointError
from .pacing import share

# `statefile.file_name(k)` (statefile itself imports numpy, which `jaxckpt inspect` never needs)
_PART = re.compile(rf'^{layout.STATE_DIR}/process_(\d+)\.safetensors$')
OK = 'ok'
ATTEMPT_WAIT_SECS = 30.0  # a process other than 0 waits this long for the attempt's name, a try
PART_SILENCE_SECS = 300.0  # process 0 names a process that has not begun its part in this long
PART_STALL_SECS = 900.0  # and gives up the step when one moved no upload at all in this long
MOVING_SECS = 10.0  # how often a process at most says its upload moves


class Superseded(Exception):
  """Process 0 stopped waiting for the parts of a step: a newer one is due, or it is closing."""


class Parts:
  """This process's share of each remote commit, among `count` processes."""

  def __init__(self, index: int, count: int, *, client=None, prefix: str = 'jaxckpt/remote'):
    self.index, self.count, self.leader = index, count, index == 0
    share(processes=count)  # this process's share of the job's requests to the store
    if client is None:
      from ..multihost import client as job_client  # pylint: disable=import-outside-toplevel
      client = job_client()  # imports jax: only a job of many processes needs it
    self._client = client
    self._prefix = prefix
    self._moved, self._moves = -float('inf'), 0

  def mine(self, files: Iterable[str]) -> list[str]:
    """The files of a checkpoint this process uploads: its own state file; process 0 also every
    file that is no running process's part (a checkpoint written by more processes included)."""
    out = []
    for rel in files:
      part = _PART.match(rel)
      owner = int(part.group(1)) if part else 0
      if owner == self.index or (self.leader and owner >= self.count):
        out.append(rel)
    return out

  def name_attempt(self, attempt: str) -> None:
    """Process 0: the attempt name every process of this job uploads under."""
    self._client.key_value_set(f'{self._prefix}/attempt', attempt, allow_overwrite=True)

  def attempt(self, timeout: float = ATTEMPT_WAIT_SECS) -> str:
    """Process 0's attempt name; E-DIST-002 when it gave none within `timeout` (retried)."""
    try:
      return self._client.blocking_key_value_get(f'{self._prefix}/attempt', int(timeout * 1000))
    except Exception as e:  # pylint: disable=broad-except  # the runtime's own error types
      raise CheckpointError(
          'E-DIST-002', f'no upload attempt name from process 0 within {timeout:g} s '
          f'({" ".join(str(e).split())[:160]})', 'process 0 is not uploading; nothing of this '
          'process is written until it is') from None

  def said(self, step: int, word: str) -> None:
    """This process's word on its part of `step`: `OK` (it is there), or why not (yet)."""
    self._client.key_value_set(f'{self._prefix}/{step}/{self.index}', word, allow_overwrite=True)

  def stop(self, why: str) -> None:
    """Process 0 lost the lease: no process writes under the prefix any more."""
    self._client.key_value_set(f'{self._prefix}/stop/why', why, allow_overwrite=True)

  def stopped(self) -> str | None:
    """Process 0's word that writing stopped (why), or None."""
    try:
      found = self._client.key_value_dir_get(f'{self._prefix}/stop/')
    except Exception:  # pylint: disable=broad-except  # the runtime's own error types
      return None
    return found[0][1] if found else None

  def started(self, step: int) -> None:
    """A process other than 0 begins its part of `step` (and will never send an older one); a
    failure it said of an earlier try is taken back, so process 0 watches this one."""
    try:
      self._client.key_value_delete(f'{self._prefix}/{step}/{self.index}')
    except Exception:  # pylint: disable=broad-except  # none said: nothing to take back
      pass
    self._moved = -float('inf')
    self.moving(step)

  def moving(self, step: int) -> None:
    """A process other than 0 is sending its part of `step` (said at most every MOVING_SECS)."""
    now = time.monotonic()
    if now - self._moved >= MOVING_SECS:
      self._moved, self._moves = now, self._moves + 1
      self._client.key_value_set(
          f'{self._prefix}/busy/{self.index}', f'{step} {self._moves}', allow_overwrite=True)

  def wait(self,
           step: int,
           closing: Callable[[], bool],
           newer: Callable[[], bool],
           on_problem: Callable[[str], None] = lambda line: None,
           every: float = 0.2,
           silence: float = PART_SILENCE_SECS,
           stall: float = PART_STALL_SECS) -> None:
    """Process 0: returns once every other process said its part of `step` is there. Raises
    `Superseded` when `closing()`, when `newer()` (a newer checkpoint is due) and a process
    that has not sent its part has moved on to a newer step (it never will), or when one has
    neither said a word nor moved an upload for `stall` seconds. `on_problem(line)` hears each
    new failure one reports, names the processes that have neither begun their part nor said
    anything of it for `silence` seconds (once each, until they do), and names a stalled one."""
    heard: set[tuple[int, str]] = set()
    # k: ((its word, its busy step and moves), since when it has said that, named yet)
    last: dict[int, tuple[tuple[str | None, tuple[int, str]], float, bool]] = {}
    busy: dict[int, tuple[int, str]] = {}
    looked = -float('inf')
    while True:
      words = self._words(step)
      missing = [k for k in range(1, self.count) if words.get(k) != OK]
      if not missing:
        return
      for k, word in sorted(words.items()):
        if word != OK and (k, word) not in heard:
          heard.add((k, word))
          on_problem(f'process {k}: {word}')
      now = time.monotonic()
      if now - looked >= 1.0:
        busy, looked = self._busy(), now
      quiet, stalled = [], []
      for k in missing:
        said = (words.get(k), busy.get(k, (-1, '')))
        if k not in last or last[k][0] != said:
          last[k] = (said, now, False)
          continue
        if said[0] is not None:  # a failure it reported: it tries again, and says so
          continue
        if now - last[k][1] >= stall:
          stalled.append(k)
        elif now - last[k][1] >= silence and said[1][0] < step and not last[k][2]:
          quiet.append(k)
          last[k] = (said, last[k][1], True)  # named once, until it says something new
      if quiet:
        on_problem(f'E-DIST-002: process(es) {", ".join(map(str, quiet))} began no upload of '
                   f'their part of step {step} in {silence:.0f} s ({self._doing(quiet, busy)}); '
                   'process 0 goes on waiting for it')
      if stalled:
        self.forget(step)
        line = (f'E-DIST-002: process(es) {", ".join(map(str, stalled))} moved no upload in '
                f'{stall:.0f} s ({self._doing(stalled, busy)}): step {step} is not committed '
                'remotely; the next checkpoint is uploaded and waited for again')
        on_problem(line)
        raise Superseded(line)
      if closing() or (newer() and self._moved_on(step, missing)):
        self.forget(step)
        raise Superseded(f'no word from process(es) {missing} and a newer one is due, or closing')
      time.sleep(every)

  @staticmethod
  def _doing(which: list[int], busy: dict[int, tuple[int, str]]) -> str:
    return ', '.join(f'process {k}: ' +
                     (f'last began step {busy[k][0]}' if k in busy else 'began no upload yet')
                     for k in which)

  def _moved_on(self, step: int, missing: list[int]) -> bool:
    busy = self._busy()
    return any(busy.get(k, (-1, ''))[0] > step for k in missing)

  def _busy(self) -> dict[int, tuple[int, str]]:
    """{process: (the step it last began uploading its part of, how often it said it moved)}.
    A value that is not one a process writes is left out (read as no word)."""
    try:
      found = self._client.key_value_dir_get(f'{self._prefix}/busy/')
    except Exception:  # pylint: disable=broad-except  # the runtime's own error types
      return {}
    out = {}
    for key, value in found:
      step, _, moves = str(value).partition(' ')
      try:
        out[int(key.rsplit('/', 1)[1])] = (int(step), moves)
      except ValueError:
        continue
    return out

  def _words(self, step: int) -> dict[int, str]:
    try:
      found = self._client.key_value_dir_get(f'{self._prefix}/{step}/')
    except Exception:  # pylint: disable=broad-except  # the runtime's own error types
      return {}
    return {int(k.rsplit('/', 1)[1]): v for k, v in found}

  def forget(self, step: int) -> None:
    try:
      self._client.key_value_delete(f'{self._prefix}/{step}/')
    except Exception:  # pylint: disable=broad-except  # only memory in the coordinator
      pass
