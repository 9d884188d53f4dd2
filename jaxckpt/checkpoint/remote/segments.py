"""Records that only grow, sent by segment: an upload sends what was appended, not the record.

    URL/records/<name>/<start>-<end>-<hash>   bytes [start, end) of record <name>; <hash> is
                                              the first 128 bits of their SHA-256, in hex

A record that only grows (a run's loss history, its events) is handed to `objects.upload` as
`Appended(path, size)`: the first `size` bytes of a local file, read when they are needed. Its
entry in the commit (`remote.json`) lists the segments that hold those bytes back to back, each
`[start, end, hash, crc]`, where crc is the CRC-32 of the record's bytes [0, end); the record's
own size and CRC-32 are the last segment's.

- A writer keeps the segments of its last commit (`Segments`). The next upload of the record adds
  a segment of the bytes after them (several of at most `SEGMENT_BYTES` when more came).
- Segments merge as a binary counter's digits do: while a segment is less than twice as long as
  the one after it, the two become one, written anew from the local file, unless that one would
  be longer than `SEGMENT_BYTES` (8 MiB): a segment that long is never written again. So an
  upload sends what was appended since the last one plus at most 8 MiB that merges rewrite,
  however long the run; each byte is sent about log2(8 MiB / appended per upload) times over
  the run; a record is held by one segment per 4 to 8 MiB of it plus about log2(8 MiB /
  appended per upload) shorter ones. A million-step run (100 MB of loss history) sends a few
  times what it appended since the last upload, not 100 MB.
- A key names its bytes' hash: a replay that wrote other bytes at the same offsets writes other
  keys, never over a segment that an older commit names.
- The first upload of a writer (a restart) takes the segments of the remote's newest commit that
  its own file still holds, each hash computed from the local bytes (`Segments.seed`): only what
  was appended since is sent, however long the run. (A remote whose commits hold the records
  whole, from before segments, has none to take: that first upload sends the record once.)
- The last segment a writer sent is hashed again from the file before it builds on it: a record
  cut short or rewritten in place (the same inode) is checked whole again, never spliced.
- Nothing in the bucket is trusted (`problems`): a segment list must start at 0, run back to back
  to the record's size, and name at most MAX_SEGMENTS keys. `read` takes each segment by a ranged
  read of its size, checks its hash, then the whole record's CRC-32.
- A segment that no remaining commit names is removed by the writer after its retention
  (`unnamed`), never while a commit it could not read might name it, and only once two sweeps at
  least a lease's time apart found it unnamed (a writer that lost the lease and still commits
  is not left naming segments already gone).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple

from ..checksum import crc32
from .bounds import short as read_was_short
from .store import Store, StoreError
from .transfer import run_bounded

SEGMENTS = 'records'
SEGMENT_BYTES = 8 << 20  # the longest segment a merge writes
PARALLEL = 8  # segments read at once
MAX_SEGMENTS = 8192  # what a commit may name for one record: 32 GiB in segments of 4 MiB
_HASH = re.compile(r'^[0-9a-f]{32}$')
_CRC = re.compile(r'^[0-9a-f]{8}$')


class Segment(NamedTuple):
  start: int
  end: int
  hash: str  # SHA-256 of the bytes [start, end), its first 128 bits in hex
  crc: int  # CRC-32 of the record's bytes [0, end)

  @property
  def size(self) -> int:
    return self.end - self.start


@dataclass(frozen=True)
class Appended:
  """The first `size` bytes of the local file `path`, a record that only grows; `inode` tells
  the file from another put in its place (a download), whose bytes are checked again."""
  path: Path
  size: int
  inode: tuple[int, int] | None = None

  @classmethod
  def of(cls, path: Path) -> 'Appended':
    """The file as it is now (FileNotFoundError when there is none)."""
    st = os.stat(path)
    return cls(Path(path), st.st_size, (st.st_dev, st.st_ino))

  def read(self, start: int = 0, stop: int | None = None) -> bytes:
    stop = self.size if stop is None else stop
    with open(self.path, 'rb') as f:
      data = os.pread(f.fileno(), stop - start, start)
    if len(data) != stop - start:
      raise OSError(f'{self.path} holds {start + len(data)} bytes, not the {stop} captured')
    return data


def key(name: str, segment: Segment) -> str:
  return f'{SEGMENTS}/{name}/{segment.start:015d}-{segment.end:015d}-{segment.hash}'


def digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()[:32]


def entry(segments: list[Segment], size: int) -> dict[str, Any]:
  """The record's entry in the commit."""
  return {
      'size': size, 'crc32': f'{segments[-1].crc if segments else 0:08x}',
      'segments': [[s.start, s.end, s.hash, f'{s.crc:08x}'] for s in segments]
  }


def parse(want: Mapping[str, Any]) -> list[Segment] | str:
  """The segments a record's commit entry names, or the problem with them."""
  rows, size = want.get('segments'), want.get('size')
  if not isinstance(rows, list) or len(rows) > MAX_SEGMENTS:
    return f'a segment list that is not a list of at most {MAX_SEGMENTS}'
  out, at = [], 0
  for row in rows:
    ok = isinstance(row, list) and len(row) == 4 and all(type(v) is int for v in row[:2])  # pylint: disable=unidiomatic-typecheck
    if not ok or row[0] != at or row[1] <= at or not isinstance(row[2], str) or \
        not _HASH.fullmatch(row[2]) or not isinstance(row[3], str) or not _CRC.fullmatch(row[3]):
      return f'segment {len(out)} is malformed or not right after byte {at}'
    out.append(Segment(row[0], row[1], row[2], int(row[3], 16)))
    at = row[1]
  if at != size or f'{out[-1].crc if out else 0:08x}' != want.get('crc32'):
    return f'segments that end at byte {at}, not at its size {size!r:.20} and CRC-32'
  return out


def problems(name: str, want: Mapping[str, Any], present: Iterable[str]) -> list[str]:
  """What stops record `name` (its commit entry `want`) from being read from the segments
  `present` (the keys listed under its folder)."""
  segments = parse(want)
  if isinstance(segments, str):
    return [f'remote.json: record {name}: {segments}']
  there = set(present)
  return [f'{key(name, s)}: missing' for s in segments if key(name, s) not in there]


def listed(store: Store, name: str) -> list[str]:
  return store.list(f'{SEGMENTS}/{name}/')


def read(store: Store, name: str, want: Mapping[str, Any]) -> bytes | None:
  """Record `name` rebuilt from the segments its commit entry `want` names; None when one is
  missing, the wrong size or hash, or the whole does not match its entry."""
  segments = parse(want)
  if isinstance(segments, str):
    return None
  data = []

  def finish(item: tuple[Segment, Any]) -> None:
    s, request = item
    try:
      got = store.finish('read', key(name, s), request)
    except StoreError as e:  # shorter than said: not this commit's segment
      if not read_was_short(e):
        raise
      got = None
    if got is None or got.state != 'value' or len(got.value) != s.size or \
        digest(got.value) != s.hash:
      raise _NotIntact
    data.append(got.value)

  tasks = [(lambda s=s: (s, store.start_read(key(name, s), slice(0, s.size)))) for s in segments]
  try:
    run_bounded(tasks, finish, PARALLEL)
  except _NotIntact:
    return None
  whole = b''.join(data)
  return whole if f'{crc32(whole):08x}' == want['crc32'] else None


class _NotIntact(Exception):
  pass


class Segments:
  """One writer's segments of its records: those of its last commit, or of the remote's newest
  commit that its own files still hold (`seed`)."""

  def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
    self.segment_bytes = segment_bytes
    self.known: dict[str, tuple[tuple[int, int] | None, list[Segment]]] = {}  # (inode, segments)
    self.last: dict[str, Any] = {}  # the records table of the last commit (`committed`)

  def seed(self, name: str, record: Appended, want: Mapping[str, Any]) -> None:
    """Takes the leading segments of commit entry `want` whose bytes `record` holds as they are
    (a restart, or a writer that took over). Reads the local file, never the store."""
    segments = parse(want)
    if not isinstance(segments, str) and name not in self.known:
      self.known[name] = (record.inode, _held(record, segments))

  def plan(self, name: str, record: Appended) -> tuple[list[Segment], dict[str, bytes]]:
    """(the segments that hold `record` once the writes are done, {key: bytes} to write)."""
    inode, base = self.known.get(name, (None, []))
    if inode != record.inode or record.inode is None:  # another file: check what it holds
      base = _held(record, base)
    elif base and (base[-1].end > record.size or not _same(record, base[-1])):
      base = _held(record, base)  # cut short or rewritten in place: checked whole again
    spans = [(s.start, s.end) for s in base]
    at = spans[-1][1] if spans else 0
    while record.size > at:  # what was appended, in segments of at most segment_bytes
      spans.append((at, min(record.size, at + self.segment_bytes)))
      at = spans[-1][1]
    while len(spans) >= 2 and spans[-2][1] - spans[-2][0] < 2 * (spans[-1][1] - spans[-1][0]) \
        and spans[-1][1] - spans[-2][0] <= self.segment_bytes:
      (a, _), (_, b) = spans[-2], spans.pop()
      spans[-1] = (a, b)
    out, writes = [], {}
    for i, (a, b) in enumerate(spans):
      if i < len(base) and (base[i].start, base[i].end) == (a, b):
        out.append(base[i])
        continue
      data = record.read(a, b)
      s = Segment(a, b, digest(data), crc32(data, out[-1].crc if out else 0))
      writes[key(name, s)] = data
      out.append(s)
    return out, writes

  def committed(self, records: Mapping[str, Any],
                planned: Mapping[str, tuple[Appended, list[Segment]]]) -> None:
    self.known.update({n: (r.inode, segments) for n, (r, segments) in planned.items()})
    self.last = dict(records)


def _same(record: Appended, s: Segment) -> bool:
  return digest(record.read(s.start, s.end)) == s.hash


def _held(record: Appended, segments: list[Segment]) -> list[Segment]:
  """The leading `segments` whose bytes the local `record` holds as they are."""
  held, crc = [], 0
  for s in segments:
    if s.end > record.size:
      break
    data = record.read(s.start, s.end)
    crc = crc32(data, crc)
    if digest(data) != s.hash or crc != s.crc:
      break
    held.append(s)
  return held


def named(records: Mapping[str, Any] | None) -> set[str] | None:
  """The segment keys a commit's records table names; None when it cannot be read."""
  if not isinstance(records, Mapping):
    return None
  out = set()
  for name, want in records.items():
    if isinstance(want, Mapping) and 'segments' in want:
      segments = parse(want)
      if isinstance(segments, str):
        return None
      out.update(key(name, s) for s in segments)
  return out


def unnamed(store: Store, tables: Iterable[Mapping[str, Any] | None]) -> list[str]:
  """The segments under the store's records folder that none of the commits' records `tables`
  names ({} for a commit from before segments): [] when one of them is None (a commit that
  cannot be read might name any)."""
  keep: set[str] = set()
  for table in tables:
    keys = named(table)
    if keys is None:
      return []
    keep |= keys
  return [k for k in store.list(f'{SEGMENTS}/') if k not in keep]


__all__ = ['Appended', 'Segment', 'Segments', 'SEGMENTS', 'read', 'unnamed']
