"""One remote commit from many processes (`jax.distributed`): each uploads its own part.

Each process uploads the state file it wrote (`state/process_<k>.safetensors`), from its own disk
or the shared one, and says so in the job's key-value store; process 0 uploads everything else
(the run state, the records) and writes the manifest, the remote commit, only once every other
process has said its part of that step is there. A process whose upload fails says why, and
tries again; process 0 goes on waiting, unless a newer checkpoint is due first (`Superseded`).
When process 0 loses the lease, its word stops every process's uploads (`stop`).
"""

from __future__ import annotations

import re
import time
from typing import Callable, Iterable

from .. import layout

# `statefile.file_name(k)` (statefile itself imports numpy, which `jaxckpt inspect` never needs)
_PART = re.compile(rf'^{layout.STATE_DIR}/process_(\d+)\.safetensors$')
OK = 'ok'


class Superseded(Exception):
  """Process 0 stopped waiting for the parts of a step: a newer one is due, or it is closing."""


class Parts:
  """This process's share of each remote commit, among `count` processes."""

  def __init__(self, index: int, count: int, *, client=None, prefix: str = 'jaxckpt/remote'):
    self.index, self.count, self.leader = index, count, index == 0
    if client is None:
      from ..multihost import client as job_client  # pylint: disable=import-outside-toplevel
      client = job_client()  # imports jax: only a job of many processes needs it
    self._client = client
    self._prefix = prefix

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

  def wait(self,
           step: int,
           give_up: Callable[[], bool],
           on_problem: Callable[[str], None] = lambda line: None,
           every: float = 0.2) -> None:
    """Process 0: returns once every other process said its part of `step` is there. Raises
    `Superseded` as soon as `give_up()`; `on_problem(line)` hears each new failure one reports."""
    heard: set[tuple[int, str]] = set()
    while True:
      words = self._words(step)
      if all(words.get(k) == OK for k in range(1, self.count)):
        self.forget(step)
        return
      for k, word in sorted(words.items()):
        if word != OK and (k, word) not in heard:
          heard.add((k, word))
          on_problem(f'process {k}: {word}')
      if give_up():
        self.forget(step)
        raise Superseded(f'step {step}: no word yet from process(es) '
                         f'{[k for k in range(1, self.count) if words.get(k) != OK]}')
      time.sleep(every)

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
