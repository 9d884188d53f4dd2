"""Where each shard of a checkpoint written by several processes is: `shards.json`.

A checkpoint of N processes has up to N shards of every array (a fully sharded job: 1024
processes and andrea_120m's 449 leaves make 194,000 shards; a 70B-parameter tree, 3 million).
Listed in `manifest.json` itself, they made every reader of the manifest parse all of them
(`latest`, `inspect`, a retention pass). So they are a file of their own beside the state files:

    step_00000100/manifest.json     the commit: files (shards.json's size and CRC-32 included),
                                    tensors (name, shape, dtype, spec), "shard_table": "shards.json"
    step_00000100/shards.json       the shards: a grid (version 2, `shardgrid`), or JSON rows

Each process posts a part record of two lines: its file (name, size, CRC-32), which process 0
parses, then its shards. Since any `jax.sharding` splits an array evenly, the shards are the
cells of a grid, and a process posts only its cells' numbers and CRC-32s (`shardgrid`: 8 bytes a
shard); process 0 files them into one table, which every process that commits a part (each
host's own disk) writes as the same bytes. A reader takes `shards.json` only at the size and
CRC-32 the sealed manifest gives it, checks it, and finds the cells a box needs by arithmetic.

The first version of the file (still read; written when shardings are not even splits, which jax does
not make) holds JSON rows {array, file, tensor, start, shape, crc32}, each process's copied as
posted; every row is checked before it is used: its file is a state file of the checkpoint, its
box lies inside its array, and an array's rows tile it, every element in exactly one row (`tiles`:
rows that overlap, their sizes adding up all the same, would leave the rest of the array unread).
Manifests from before the file (format 1) list the shards in their tensor rows, and are read as
they are, their rows checked alike; a jaxckpt from before a format refuses it (E-CKPT-006:
upgrade jaxckpt).
"""

from __future__ import annotations

import collections
import heapq
import json
import math
from pathlib import Path
from collections import abc
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

from . import atomic, layout, shardgrid
from .checksum import crc32
from .errors import CheckpointError

SHARDS = 'shards.json'
KEY = 'shard_table'  # the manifest's key naming the file
FORMAT = 'jaxckpt.shards'
_DAMAGED = 'the checkpoint is damaged; resume from an earlier checkpoint'


def part_record(rel: str,
                written: Mapping[str, Any],
                crcs: Mapping[str, str],
                places: Mapping[str, Mapping[str, Any]],
                shapes: Mapping[str, Any],
                grid: shardgrid.Grid | None = None) -> str:
  """What a process posts about its file: a line with its size and CRC, then its shards: the
  cells of `grid` it wrote (`shardgrid.post`), or without one their JSON rows."""
  head = {'file': rel, 'size': written['size'], 'crc32': written['crc32']}
  if grid is not None:
    head['cells'], head['grid'] = len(places), grid.fingerprint()
    return json.dumps(head, separators=(',', ':')) + '\n' + shardgrid.post(grid, places, crcs)
  shards = [{
      'array': p['array'], 'file': rel, 'tensor': t, 'start': p['start'], 'shape': list(shapes[t]),
      'crc32': crcs[t]
  } for t, p in places.items()]
  return json.dumps(head, separators=(',', ':')) + '\n' + json.dumps(shards, separators=(',', ':'))


class GridParts(NamedTuple):
  """What `merge_records` gives for a grid: the state file of each process, each cell's."""
  grid: shardgrid.Grid
  files: list[str]
  cells: Any  # numpy (process, crc32) per cell


def merge_records(records: list[str],
                  *,
                  expect: int,
                  grid: shardgrid.Grid | None = None) -> tuple[dict[str, dict], Any]:
  """({file: {size, crc32}}, the shards) from every process's `part_record`, in process order:
  the shards are each record's rows as posted (only the first line of each is parsed), or with
  `grid` its cells filed into one table (`GridParts`). E-DIST-002 unless there are `expect`
  records, each of the kind `grid` says, holding every cell once (a store that answered with
  fewer, or a process that posted another layout, commits nothing)."""
  if len(records) != expect:
    raise CheckpointError('E-DIST-002',
                          f'the key-value store gave {len(records)} of {expect} part records',
                          'nothing was committed; the next save tries again')
  files, names, parts = {}, [], []
  want = None if grid is None else grid.fingerprint()
  for record in records:
    head, _, shards = record.partition('\n')
    try:
      head = _json(head)
    except ValueError:
      head = None
    if not isinstance(head, dict) or not all(k in head for k in ('file', 'size', 'crc32')):
      raise CheckpointError('E-DIST-002', f'a part record that is not one: {record[:80]!r}',
                            'nothing was committed; every process must run the same jaxckpt')
    if head.get('grid') != want or (want and len(shards) != -(-8 * head['cells'] // 3) * 4):
      raise CheckpointError(
          'E-DIST-002', f'the part record of {head["file"]} numbers its shards on another '
          'grid than process 0, or not as many as it says', 'nothing was committed; every '
          'process must run the same jaxckpt on the same state and shardings')
    files[head['file']] = {'size': head['size'], 'crc32': head['crc32']}
    names.append(head['file'])
    parts.append(shards)
  if grid is not None:
    return files, GridParts(grid, names, shardgrid.merge(grid, parts))
  return files, parts


def _pieces(parts: list[str]) -> Iterator[bytes]:
  yield f'{{"format":"{FORMAT}","parts":[\n'.encode()
  for k, part in enumerate(parts):
    yield (',\n' if k else '').encode() + part.encode()
  yield b'\n]}\n'


def table_bytes(parts: list[str] | GridParts) -> bytes:
  """The bytes of `shards.json` for `merge_records`'s shards."""
  if isinstance(parts, GridParts):
    return shardgrid.table_bytes(parts.grid, parts.files, parts.cells)
  return b''.join(_pieces(parts))


def write(path: Path, parts: list[str] | GridParts) -> dict[str, Any]:
  """Writes `shards.json` durably at `path` (JSON rows one process's after another: never the
  whole table in memory, 500 MB for a 70B-parameter state at 1024 processes); returns its row of
  the manifest's files table, {size, crc32}."""
  crc, size = 0, 0
  pieces = [table_bytes(parts)] if isinstance(parts, GridParts) else _pieces(parts)
  with atomic.atomic_file(path) as tmp, open(tmp, 'wb') as f:
    for piece in pieces:
      f.write(piece)
      crc, size = crc32(piece, crc), size + len(piece)
  return {'size': size, 'crc32': f'{crc:08x}'}


def entry(body: bytes) -> dict[str, Any]:
  """`shards.json`'s row in the manifest's files table, from its bytes."""
  return {'size': len(body), 'crc32': f'{crc32(body):08x}'}


class Rows(abc.Mapping):
  """A shard table of JSON rows, checked: {array: [row]}, and `overlapping(array, box)`."""

  def __init__(self, rows: dict[str, list]):
    self.rows = rows

  def overlapping(self, array: str, box: shardgrid.Box) -> list[dict]:
    """The rows of `array` whose shards overlap `box`."""
    return [s for s in self.rows.get(array, ()) if _overlap(box, s)]

  def __getitem__(self, array: str) -> list[dict]:
    return self.rows[array]

  def tensors_in(self) -> dict[str, int]:
    """{state file: how many tensors (shards) it holds}."""
    return dict(collections.Counter(s['file'] for rows in self.rows.values() for s in rows))

  def __iter__(self) -> Iterator[str]:
    return iter(self.rows)

  def __len__(self) -> int:
    return len(self.rows)


def _overlap(box: shardgrid.Box, shard: Mapping[str, Any]) -> bool:
  return all(
      max(a, s0) < min(b, s0 + n) for (a, b), s0, n in zip(box, shard['start'], shard['shape']))


Table = Rows | shardgrid.Table  # what `shard_table` gives


def shard_table(step_dir: Path, meta: Mapping[str, Any], single: str | None) -> Table:
  """The shard table of a checkpoint, checked: from `shards.json` (a grid, or JSON rows), from
  the manifest's tensor rows (format 1), or, for a single-file checkpoint, each tensor as one
  whole shard of `single`."""
  tensors = meta.get('tensors')
  if not isinstance(tensors, list) or not all(
      isinstance(r, dict) and isinstance(r.get('name'), str) and _counts(r.get('shape'))
      for r in tensors):
    raise CheckpointError('E-CKPT-012', f'{step_dir}: a malformed tensor table', _DAMAGED)
  shapes = {r['name']: r['shape'] for r in tensors}
  files = set(meta.get('state_files') or ())
  check = _Rows(step_dir, shapes, files)  # one for the whole table: each file name once
  if meta.get(KEY) is None:
    out = {}
    for row in meta['tensors']:
      name = row['name']
      whole = {
          'file': single, 'tensor': name, 'start': [0] * len(row['shape']), 'shape': row['shape'],
          'crc32': row.get('crc32')
      }
      shards = row.get('shards') or ()
      out[name] = [check(dict(s), name) for s in shards] or [whole]
      if shards:
        _tile_or_raise(step_dir, name, out[name], row['shape'])
    return Rows(out)
  table = _parse(step_dir, _read(step_dir, meta))
  if isinstance(table, dict):
    return shardgrid.Table(
        table, shapes, check.file_ok,
        lambda what: CheckpointError('E-CKPT-012', f'{step_dir / SHARDS}: {what}', _DAMAGED))
  out = {name: [] for name in shapes}
  for part in table:
    for s in part:
      array = s.pop('array', None) if isinstance(s, dict) else None
      row = check(s, array)  # parsed here: checked, never copied; an unknown array raises
      out[array].append(row)
  for name, rows in out.items():  # each shard is written once: the rows partition the array
    if rows:
      _tile_or_raise(step_dir, name, rows, shapes[name])
  return Rows(out)


def _tile_or_raise(step_dir: Path, name: str, rows: list[dict], shape: list[int]) -> None:
  if not tiles(((r['start'], r['shape']) for r in rows), shape):
    raise CheckpointError(
        'E-CKPT-012', f'{step_dir}: the shard rows of {name} do not add up to its shape '
        f'{shape}: they overlap, leave part of it out, or are not a split of it', _DAMAGED)


def tiles(boxes: Iterable[tuple[Sequence[int], Sequence[int]]], shape: Sequence[int]) -> bool:
  """Whether `boxes` ((start, extent) each, inside an array of `shape`) hold every element of it
  exactly once: no two overlap and none is left out (an array of no elements: always).

  A sweep along the first dimension: between two consecutive box edges the boxes that span that
  slab must tile the rest of the shape, checked the same way a dimension down. Each box of a grid
  (any split of each dimension, what a sharding makes) is looked at once per dimension: O(n log n)
  for n boxes, never a comparison of every pair. Boxes laid out as no sharding lays them, whose
  check would look at each box more than a few times a dimension, are not taken either."""
  if not math.prod(shape):
    return True
  todo = [([(list(a), list(n)) for a, n in boxes], list(shape))]
  budget = 4 * (len(todo[0][0]) + 1) * len(shape)  # boxes handed a dimension down, in all
  while todo:
    part, left = todo.pop()
    if not left:  # a point: exactly one box holds it
      if len(part) != 1:
        return False
      continue
    # Boxes empty along this dimension hold no element (nor, so, any overlap): left out.
    part = sorted((b for b in part if b[1][0]), key=lambda b: b[0][0])
    active: list[tuple[int, int]] = []  # (stop, index) of the boxes that span `at`
    at, k = 0, 0
    while at < left[0]:
      while k < len(part) and part[k][0][0] == at:
        heapq.heappush(active, (at + part[k][1][0], k))
        k += 1
      if not active:  # nothing holds `at`: a part left out (or a box before the array)
        return False
      stop = min(active[0][0], part[k][0][0] if k < len(part) else left[0])
      budget -= len(active)
      if budget < 0:
        return False
      todo.append(([(part[i][0][1:], part[i][1][1:]) for _, i in active], left[1:]))
      at = stop
      while active and active[0][0] <= at:
        heapq.heappop(active)
    if active or k < len(part):  # a box past the end of the array
      return False
  return True


def _read(step_dir: Path, meta: Mapping[str, Any]) -> bytes:
  """`shards.json`'s bytes, once they are the size and CRC-32 the manifest says."""
  name, table = meta[KEY], meta.get('files')
  want = table.get(name) if isinstance(name, str) and isinstance(table, Mapping) else None
  if name != SHARDS or not isinstance(want, Mapping):
    raise CheckpointError(
        'E-CKPT-012', f'{step_dir}: the manifest names a shard table {name!r:.80} its files '
        'table does not hold', _DAMAGED)
  path = step_dir / SHARDS
  try:
    body = path.read_bytes()
  except OSError as e:
    raise CheckpointError('E-CKPT-012', f'cannot read {path}: {e.strerror or e}', _DAMAGED) from e
  got = entry(body)
  if got != {'size': want.get('size'), 'crc32': want.get('crc32')}:
    raise CheckpointError(
        'E-CKPT-003', f'{path}: {got["size"]} bytes, crc32 {got["crc32"]}; the manifest says '
        f'{want.get("size")} bytes, crc32 {want.get("crc32")}', 'resume from an earlier checkpoint')
  return body


def _parse(step_dir: Path, body: bytes) -> list | dict:
  """The parts of a `shards.json` of JSON rows whose bytes are `body`, or the table itself when
  it is a grid (`shardgrid`)."""
  path = step_dir / SHARDS
  try:
    table = _json(body)
  except ValueError as e:
    raise CheckpointError('E-CKPT-012', f'{path}: not JSON ({e})', _DAMAGED) from e
  if isinstance(table, dict) and table.get('format') == FORMAT and \
      table.get('version') == shardgrid.VERSION:
    return table
  parts = table.get('parts') if isinstance(table, dict) and table.get('format') == FORMAT else None
  if not isinstance(parts, list) or not all(isinstance(p, list) for p in parts):
    raise CheckpointError('E-CKPT-012', f'{path}: not a jaxckpt shard table', _DAMAGED)
  return parts


def _json(text: str | bytes) -> Any:
  """`text` parsed; ValueError for what is not JSON, and for JSON nested too deep to parse."""
  try:
    return json.loads(text)
  except RecursionError as e:
    raise ValueError('nested too deep') from e


def _counts(value: Any) -> bool:
  """A list of whole numbers (ints, never bools or floats), each >= 0."""
  return isinstance(value, list) and all(type(n) is int and n >= 0 for n in value)  # pylint: disable=unidiomatic-typecheck


class _Rows:
  """Checks shard rows of one checkpoint: a row names a state file of the checkpoint (`files`;
  any file inside it when the manifest lists none) and a box that lies inside its array. Each
  distinct file name is checked once (3 million rows name 1024 files at 70B on 1024 processes:
  the per-row check was most of the table's parse)."""

  def __init__(self, step_dir: Path, shapes: Mapping[str, list], files: set[str]):
    self.step_dir, self.shapes, self.files, self.named = step_dir, shapes, files, {}

  def file_ok(self, name: Any) -> bool:
    if not isinstance(name, str):
      return False
    ok = self.named.get(name)
    if ok is None:
      ok = self.named[name] = layout.member_problem(name) is None and (not self.files
                                                                       or name in self.files)
    return ok

  def __call__(self, s: Any, array: Any) -> dict:
    """Row `s` of `array` (without its `array` key) once it is sound; else E-CKPT-012."""
    shape = self.shapes.get(array) if isinstance(array, str) else None
    if shape is not None and isinstance(s, dict):
      start, extent = s.get('start'), s.get('shape')
      ok = isinstance(s.get('tensor'), str) and self.file_ok(s.get('file')) and \
          isinstance(s.get('crc32'), str) and _counts(start) and _counts(extent) and \
          len(start) == len(extent) == len(shape) and \
          all(a + n <= m for a, n, m in zip(start, extent, shape))
      if ok:
        return s
    raise CheckpointError(
        'E-CKPT-012', f'{self.step_dir}: a malformed shard row '
        f'{json.dumps(s, default=str)[:160]}', _DAMAGED)
