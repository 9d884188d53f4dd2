"""Sending a checkpoint's files to a store: parts in flight, bounded, each CRC-checked.

A file's bytes come from the host memory its save staged them in while that memory still holds
them (`staging.InMemory`: the next save stages over it, and then it answers None), else from
the local file: an O_DIRECT write leaves the file out of the page cache, so reading it back is
a disk read of the whole state per upload. Either way every byte is checked against the
manifest's CRC-32 before the commit, which never comes for a file that does not match.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import layout
from ..checksum import crc32, crc32_combine
from ..errors import CheckpointError
from .store import Store


class DamagedLocal(CheckpointError):
  """A local file does not match its manifest (size or CRC-32) while it is uploaded: it is never
  committed remotely. Retrying cannot help; the remote copy, if any, is the one to trust."""


def run_bounded(tasks: list[Callable[[], Any]], finish: Callable[[Any], None], parallel: int):
  """Starts `tasks` (each returns a future), at most `parallel` in flight; `finish` each result
  in order. Raises the first error, after the futures already started have settled."""
  pending: deque = deque()
  error = None
  for task in tasks:
    if error is None:
      try:
        pending.append(task())
      except BaseException as e:  # noqa: BLE001 - re-raised below
        error = e
    while pending and (len(pending) >= parallel or error is not None):
      error = _settle(pending.popleft(), finish, error)
  while pending:
    error = _settle(pending.popleft(), finish, error)
  if error is not None:
    raise error


def _settle(item, finish, error):
  try:
    finish(item)
  except BaseException as e:  # noqa: BLE001 - the first one wins
    return error or e
  return error


def send_files(store: Store,
               data: str,
               step_dir: Path,
               sending: Mapping[str, Mapping[str, Any]],
               part_bytes: int,
               parallel: int,
               may_write: Callable[[str], None],
               memory: Mapping[str, Any] | None = None) -> int:
  """Sends each file of `sending` under `data`, CRC-checking its bytes as they are read: a file
  whose CRC-32 is not its manifest's raises `DamagedLocal` (one up to `part_bytes` long before
  it is sent; a longer one before the commit, which never comes). `memory`: {file: an
  `InMemory` of it}, read while it answers, the file on disk after."""
  # Every handle is closed whatever fails, the opening of a later file too (local retention
  # removed it): the uploader retries, and each retry would otherwise keep the earlier ones.
  with contextlib.ExitStack() as opened:
    handles = {
        rel: opened.enter_context(open(layout.safe_member(step_dir, rel), 'rb')) for rel in sending
    }
    crcs: dict[str, dict[int, tuple[int, int]]] = {rel: {} for rel in sending}
    tasks = []
    for rel, want in sending.items():
      keys = part_keys(rel, want['size'], part_bytes)
      held = (memory or {}).get(rel)
      held = held if held is not None and held.size == want['size'] else None
      for key, start, stop in keys:
        check = want['crc32'] if len(keys) == 1 else None
        tasks.append(
            put_part(store, data + key, handles[rel], start, stop, crcs[rel], check, may_write,
                     held))
    run_bounded(tasks, lambda item: store.finish('write', *item), parallel)
  for rel, want in sending.items():
    check_crc(str(step_dir / rel), crcs[rel], want['crc32'])
  return sum(w['size'] for w in sending.values())


def part_keys(rel: str, size: int, part_bytes: int) -> list[tuple[str, int, int]]:
  """[(key, start, stop)] of the objects that hold file `rel` (relative to its step prefix)."""
  if size <= part_bytes:
    return [(rel, 0, size)]
  return [(f'{rel}.part-{i:05d}', start, min(start + part_bytes, size))
          for i, start in enumerate(range(0, size, part_bytes))]


def check_crc(name: str, crcs: Mapping[int, tuple[int, int]], want: str) -> None:
  crc = 0
  for start in sorted(crcs):
    crc = crc32_combine(crc, *crcs[start])  # from crc32(b'') == 0
  if f'{crc:08x}' != want:
    raise DamagedLocal('E-STORE-013',
                       f'{name}: checksum mismatch (crc32 {crc:08x}, manifest says {want})',
                       'the local checkpoint is damaged; it is not uploaded')


def put_part(store: Store,
             key: str,
             f,
             start: int,
             stop: int,
             crcs: dict,
             check: str | None,
             may_write: Callable[[str], None],
             held: Any = None):
  """A task that reads bytes [start, stop) of open file `f` (from `held`, its `InMemory`, while
  that answers) and starts writing them to `key`."""

  def task():
    data = held.read(start, stop) if held is not None else None
    if data is None:
      data = os.pread(f.fileno(), stop - start, start)
    if len(data) != stop - start:
      raise DamagedLocal('E-STORE-013', f'{f.name} is shorter than its manifest says',
                         'the local checkpoint is damaged; it is not uploaded')
    crcs[start] = (crc32(data), stop - start)
    if check is not None:  # the whole file: checked before a byte of it leaves
      check_crc(f.name, crcs, check)
    may_write(store.join(key))
    return key, store.start_write(key, data)

  return task


__all__ = ['DamagedLocal', 'check_crc', 'part_keys', 'put_part', 'run_bounded', 'send_files']
