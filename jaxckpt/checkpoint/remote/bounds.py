"""What a remote checkpoint's `remote.json` and manifest say, checked before anything is used.

Anyone who can write the bucket can write those files: a name in them is a path on this machine
once it is downloaded, a size is an allocation. So every name must stay inside its checkpoint
(`layout.member_problem`; a record's is one plain file name), the part size must be one the
uploader could have used, every size must be a count of bytes the listed objects can hold, and
objects are read with ranged reads of the size said, never whole: an object larger than its
commit says is never read past that size. Each failure is a problem line, as a missing object
is: the checkpoint is not intact (E-STORE-012) and a reader takes an older one.
"""

from __future__ import annotations

from typing import Any, Mapping

from .. import layout
from .store import Store, StoreError

MIN_PART_BYTES = 64 << 10  # the smallest part size a commit may say (the default is 32 MiB)
MAX_PART_BYTES = 5 << 30  # the largest: S3 takes at most 5 GiB in one PUT
MAX_MANIFEST_BYTES = 256 << 20  # a manifest lists files and tensors: far below this
MAX_RECORD_BYTES = 16 << 30  # a record (the loss history of a very long run) is below this


def _size(value: Any, limit: int) -> bool:
  return type(value) is int and 0 <= value <= limit  # pylint: disable=unidiomatic-typecheck


def meta_problems(meta: Mapping[str, Any], m: Mapping[str, Any], listed: int) -> list[str]:
  """Problems of the commit `meta` (`remote.json`) and manifest `m` of a step whose prefix holds
  `listed` objects: [] when every name and size in them can be used as it is."""
  pb = meta.get('part_bytes')
  if not _size(pb, MAX_PART_BYTES) or pb < MIN_PART_BYTES:
    return [
        f'remote.json: part_bytes {pb!r:.40} is not within '
        f'[{MIN_PART_BYTES}, {MAX_PART_BYTES}]'
    ]
  files = m.get('files')
  if not isinstance(files, Mapping):
    return ['manifest.json: malformed files table']
  problems, objects = [], 0
  for rel, want in files.items():
    if (why := layout.member_problem(rel)) is not None:
      problems.append(f'manifest.json names {why}')
    elif not isinstance(want, Mapping) or not _size(want.get('size'), pb * (listed + 1)) or \
        not isinstance(want.get('crc32'), str):
      problems.append(f'manifest.json: {rel}: a size or CRC-32 the objects cannot hold')
    else:
      objects += max(1, -(-want['size'] // pb))
  records = meta.get('records', {})
  if not isinstance(records, Mapping):
    return problems + ['remote.json: malformed records table']
  for name, want in records.items():
    why = layout.member_problem(name) or ('/' in name and f'{name!r:.80}: not a plain file name')
    if why:
      problems.append(f'remote.json names record {why}')
    elif not isinstance(want, Mapping) or not _size(want.get('size'), MAX_RECORD_BYTES) or \
        not isinstance(want.get('crc32'), str):
      problems.append(f'remote.json: record {name}: a malformed size or CRC-32')
    elif 'segments' not in want:  # segments are under URL/records/ (`segments.problems`)
      objects += 1
  said = meta.get('manifest')
  if said is not None and (not isinstance(said, Mapping)
                           or not _size(said.get('size'), MAX_MANIFEST_BYTES)):
    problems.append(f'remote.json: a malformed manifest size {said!r:.60}')
  if not problems and objects > listed:
    problems.append(f'the commit names {objects} objects; {listed} are there')
  return problems


def read_manifest(store: Store, key: str, meta: Mapping[str, Any] | None) -> bytes | None:
  """The manifest at `key`: the size `meta` (its `remote.json`) says, by a ranged read; the
  whole object for a commit that says none (one from before sizes), up to MAX_MANIFEST_BYTES.
  None when missing, or shorter than said."""
  said = (meta or {}).get('manifest')
  size = said.get('size') if isinstance(said, Mapping) else None
  if _size(size, MAX_MANIFEST_BYTES):
    return read_prefix(store, key, size)
  return read_prefix(store, key, MAX_MANIFEST_BYTES, exact=False)


def read_prefix(store: Store, key: str, size: int, *, exact: bool = True) -> bytes | None:
  """The first `size` bytes of object `key`, by one ranged read; None when it is missing or
  (`exact`) shorter. Without `exact`, an object shorter than `size` is read whole."""
  try:
    return store.read_range(key, 0, size)
  except StoreError as e:
    if e.code == 'E-STORE-011':  # missing
      return None
    if not short(e):
      raise
  return None if exact else store.read(key)


def start_read(store: Store, key: str, size: int):
  """A future for the first `size` bytes of `key` (`short` errors when it holds fewer)."""
  return store.start_read(key, slice(0, size))


def short(e: Exception) -> bool:
  """Whether a read failed because the object is shorter than the range asked for."""
  return 'OUT_OF_RANGE' in str(e)
