"""The run's exports, mirrored under URL/exports/ after each remote commit.

    URL/exports/<name>               a file up to `part_bytes` long, as one object...
    URL/exports/<name>.part-<i>      ...a longer one in parts (S3 takes at most 5 GiB in one PUT),
    URL/exports/<name>.parts.json    then its size, part size and CRC-32, that a reader goes by

A file is read once as it is sent (`put_file`); `download_file` reassembles it and checks its
CRC-32. The mirror deletes only what this run uploaded and its own export retention removed
since: exports written by earlier runs (a machine that is gone) stay where they are.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Callable, Collection

from .. import atomic
from ..atomic import TMP_MARK
from ..checksum import crc32_combine
from ..errors import CheckpointError
from .bounds import MAX_PART_BYTES, MIN_PART_BYTES
from .checks import read_small
from .objects import PARALLEL, PART_BYTES, _never, fetch_file
from .transfer import part_keys, put_part, run_bounded
from .store import Store

PARTS_INDEX = '.parts.json'
MAX_INDEX_BYTES = 64 << 10  # a file's parts index: its size, CRC-32 and part size, some 100 bytes
_MAX_PARTS = 1 << 17  # a size and part size from a bucket are bounded by this before use


def put_file(store: Store,
             key: str,
             path: Path,
             *,
             part_bytes: int = PART_BYTES,
             parallel: int = PARALLEL,
             may_write: Callable[[str], None] = _never) -> list[str]:
  """Uploads file `path` to `key`, reading it once: one object up to `part_bytes` long, else
  `key.part-<i>` objects and, after them, `key.parts.json` ({size, part_bytes, crc32}) that
  `download_file` reassembles them by. Returns the keys written."""
  with open(path, 'rb') as f:
    size = os.fstat(f.fileno()).st_size
    keys = part_keys(key, size, part_bytes)
    if len(keys) == 1:
      data = f.read()
      may_write(store.join(key))
      store.write(key, data)
      return [key]
    crcs: dict[int, tuple[int, int]] = {}
    tasks = [put_part(store, k, f, a, b, crcs, None, may_write) for k, a, b in keys]
    run_bounded(tasks, lambda item: store.finish('write', *item), parallel)
  crc = 0
  for start in sorted(crcs):
    crc = crc32_combine(crc, *crcs[start])
  index = {'size': size, 'part_bytes': part_bytes, 'crc32': f'{crc:08x}'}
  may_write(store.join(key + PARTS_INDEX))
  store.write(key + PARTS_INDEX, json.dumps(index).encode())
  return [k for k, _, _ in keys] + [key + PARTS_INDEX]


def file_keys(key: str, listed: Collection[str]) -> list[str]:
  """The keys, of those `listed`, that hold the file `put_file` wrote to `key` (index first)."""
  parts = re.compile(re.escape(key) + r'\.part-\d{5}$')
  return sorted((k for k in listed if k in (key, key + PARTS_INDEX) or parts.match(k)),
                key=lambda k: not k.endswith(PARTS_INDEX))


def download_file(store: Store, key: str, path: Path, *, parallel: int = PARALLEL) -> bool:
  """Writes the file `put_file` wrote to `key` into `path` (durably, by a temporary name); False
  when there is none. A file in parts is CRC-checked against its index (E-STORE-012)."""
  raw, _, large = read_small(store, key + PARTS_INDEX, MAX_INDEX_BYTES)  # from a bucket: bounded
  if large:
    raise CheckpointError(
        'E-STORE-012', f'{store.join(key + PARTS_INDEX)} is over '
        f'{MAX_INDEX_BYTES} bytes: not an index jaxckpt writes', 'upload the file again')
  tmp = path.with_name(path.name + atomic.TMP_MARK + uuid.uuid4().hex[:8])
  try:
    if raw is None:
      data = store.read(key)
      if data is None:
        return False
      atomic.write_file_durably(tmp, data)
    else:
      try:
        index = json.loads(raw)
        want = {'size': int(index['size']), 'crc32': str(index['crc32'])}
        part_bytes = int(index['part_bytes'])
        if (not MIN_PART_BYTES <= part_bytes <= MAX_PART_BYTES or want['size'] < 0
            or want['size'] > part_bytes * _MAX_PARTS):
          raise ValueError(index)  # sizes from a bucket: bounded before anything is allocated
      except (ValueError, KeyError, TypeError, RecursionError):
        raise CheckpointError('E-STORE-012', f'{store.join(key + PARTS_INDEX)} is malformed',
                              'upload the file again') from None
      prefix, rel = key.rpartition('/')[0] + '/', key.rpartition('/')[2]
      fetch_file(store, prefix if '/' in key else '', rel, want, part_bytes, tmp, parallel,
                 lambda n: None, store.join(key), 'upload it again')
    os.replace(tmp, path)
    atomic.fsync_dir(path.parent)
  finally:
    tmp.unlink(missing_ok=True)
  return True


class Mirror:
  """Keeps `prefix` in `store` up to date with the files under `local` that this run wrote or
  changed. `may_write(what)` and `may_delete(what)` are called before each write and delete and
  raise to refuse (the lease)."""

  def __init__(self,
               store: Store,
               local: Path,
               prefix: str,
               *,
               part_bytes: int = PART_BYTES,
               may_write: Callable[[str], None] = _never,
               may_delete: Callable[[str], None] = _never):
    self.store, self.local, self.prefix = store, Path(local), prefix
    self._part_bytes, self._may_write, self._may_delete = part_bytes, may_write, may_delete
    self._sent: dict[str, tuple[tuple[int, int], list[str]]] = {}  # rel: ((size, mtime), keys)

  def sync(self) -> None:
    """Uploads the files that are new or changed since last time and deletes those this run
    sent that are gone locally (its export retention); names with a temporary mark (a write
    in progress) are left for next time."""
    local = self.local
    files = {
        str(p.relative_to(local)): p
        for p in (sorted(local.rglob('*')) if local.is_dir() else [])
        if p.is_file() and TMP_MARK not in str(p.relative_to(local))
    }
    listed = None
    for rel, path in files.items():
      stat = path.stat()
      signature = (stat.st_size, stat.st_mtime_ns)
      if self._sent.get(rel, (None, []))[0] == signature:
        continue
      if listed is None:  # once, before anything is written: what an earlier version left
        listed = self.store.list(self.prefix)
      key = self.prefix + rel
      keys = put_file(self.store, key, path, part_bytes=self._part_bytes, may_write=self._may_write)
      self._delete([k for k in file_keys(key, listed) if k not in keys])
      self._sent[rel] = (signature, keys)
    for rel in [rel for rel in self._sent if rel not in files]:
      self._delete(self._sent[rel][1])
      del self._sent[rel]

  def _delete(self, keys: list[str]) -> None:
    if keys:  # the index first: a reader never follows one to parts that are going
      self.store.delete_many(
          sorted(keys, key=lambda k: not k.endswith(PARTS_INDEX)),
          fence=lambda: self._may_delete(self.store.join(self.prefix)))
