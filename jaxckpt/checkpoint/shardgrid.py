"""The shard table as a grid (`shards.json` version 2): a restore looks up its cells, it never
scans the table.

Any `jax.sharding` splits an array evenly along each dimension: part k of n along a dimension of
size m is [k*c, min((k+1)*c, m)) with c = ceil(m/n). So the shards of an array are the cells of a
grid that `parts` (n per dimension) describes whole, and a cell's place, shape and tensor name
follow from its number. What a cell needs beyond its number is the process whose file holds it
and its CRC-32: eight bytes.

    {"format": "jaxckpt.shards", "version": 2,
     "grid": [[array, [parts per dimension]], ...],    the cells, numbered array after array,
                                                       row-major within one
     "files": [state file of process 0, of process 1, ...],
     "cells": "<base64 of (process, crc32) per cell, little-endian uint32 each>"}

At 70B parameters on 1024 processes that is 3 million cells: 32 MB, read, CRC-checked and decoded
in a fraction of a second, where a table of JSON rows was 500 MB that every process parsed and
checked row by row before its restore (37 s). A process then finds the cells its devices need by
arithmetic, in time proportional to what it reads.

Each process posts its cells (number, CRC-32) in binary to process 0, with their count and a
CRC-32 of the grid it numbered them on; process 0 files them into one array, and commits nothing
unless every process numbered on its grid and every cell is there exactly once. A reader takes
the table only at the size and CRC-32 the sealed manifest gives it, and checks what it reads:
every array is one of the manifest's with that many dimensions, every split is even, every file
is a state file of the checkpoint, every process number names one of them, and there are exactly
as many cells as the grid has.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import math
from collections import abc
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from .checksum import crc32
from .errors import CheckpointError

VERSION = 2
Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in the global shape
# numpy is imported where cells are handled, not here: `latest` and `inspect` import this module
# (through the manifest) and stay free of numpy's import.
_CELL = [('process', '<u4'), ('crc32', '<u4')]  # the table's, per cell
_POST = [('cell', '<u4'), ('crc32', '<u4')]  # a process's post, per shard it wrote
_ITEM = 8  # bytes of either
_MAX_CELLS = 2**32 - 1


def tensor_name(array: str, box: Box, shape) -> str:
  """`array` when the shard is the whole array, else `array[a:b,c:d]`."""
  if all(a == 0 and b == n for (a, b), n in zip(box, shape)):
    return array
  return f'{array}[{",".join(f"{a}:{b}" for a, b in box)}]'


def even(m: int, n: int) -> bool:
  """Whether `n` even parts of a dimension of size `m` are all non-empty (one empty part when
  m is 0)."""
  return n == 1 if m == 0 else 1 <= n <= m and (n - 1) * -(-m // n) < m


def _spans(m: int, n: int) -> list[tuple[int, int]]:
  c = -(-m // n)
  return [(k * c, min((k + 1) * c, m)) for k in range(n)]


def parts_of(boxes: Iterable[Box], shape: Sequence[int]) -> list[int] | None:
  """The parts per dimension when `boxes` are exactly the cells of an even split of `shape`;
  None when they are not (the table of JSON rows then holds them)."""
  boxes = set(boxes)
  parts = []
  for d, m in enumerate(shape):
    spans = sorted({b[d] for b in boxes})
    if not even(m, len(spans)) or spans != _spans(m, len(spans)):
      return None
    parts.append(len(spans))
  return parts if len(boxes) == math.prod(parts) else None


def _row_major(ks: Sequence[int], parts: Sequence[int]) -> int:
  """The number of the cell at grid index `ks` among `parts` per dimension, row-major."""
  index = 0
  for k, n in zip(ks, parts):
    index = index * n + k
  return index


class Grid:
  """Every array's cells: the arrays in order, each split evenly into `parts` per dimension,
  the cells numbered array after array, row-major within one."""

  def __init__(self, arrays: Iterable[tuple[str, Sequence[int], Sequence[int]]]):
    self.arrays = [(name, tuple(shape), tuple(parts)) for name, shape, parts in arrays]
    self._at, base = {}, 0
    for name, shape, parts in self.arrays:
      chunks = tuple(-(-m // n) for m, n in zip(shape, parts))
      self._at[name] = (base, shape, parts, chunks)
      base += math.prod(parts)
    self.total = base

  def __contains__(self, name: object) -> bool:
    return name in self._at

  def names(self) -> list[str]:
    return [name for name, _, _ in self.arrays]

  def cell(self, name: str, start: Sequence[int]) -> int:
    """The number of the cell of `name` that starts at `start`."""
    base, _, parts, chunks = self._at[name]
    return base + _row_major([a // c if c else 0 for a, c in zip(start, chunks)], parts)

  def cells(self, name: str, box: Box) -> Iterator[tuple[int, Box]]:
    """(number, box) of each cell of `name` that overlaps `box` (none for an empty box, or one
    of another rank: a target of another shape finds only what the array has)."""
    base, shape, parts, chunks = self._at[name]
    if len(box) != len(shape):
      return
    box = tuple((a, min(b, m)) for (a, b), m in zip(box, shape))
    if any(a >= b for a, b in box):
      return
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(box, chunks)]
    for ks in itertools.product(*ranges):
      yield base + _row_major(ks, parts), tuple(
          (k * c, min((k + 1) * c, m)) for k, c, m in zip(ks, chunks, shape))

  def to_json(self) -> list:
    return [[name, list(parts)] for name, _, parts in self.arrays]

  def fingerprint(self) -> str:
    """A CRC-32 of the grid: processes that number their cells alike post the same."""
    return f'{crc32(json.dumps(self.to_json(), separators=(",", ":")).encode()):08x}'


def post(grid: Grid, places: Mapping[str, Mapping[str, Any]], crcs: Mapping[str, str]) -> str:
  """A process's shards as it posts them: base64 of (cell number, CRC-32) per shard."""
  if grid.total > _MAX_CELLS:  # every process finds the same, before any waits for another
    raise CheckpointError(
        'E-DIST-002', f'the state has {grid.total} shards, more than a shard table numbers '
        f'({_MAX_CELLS})', 'nothing was written; save fewer or larger shards')
  import numpy as np  # pylint: disable=import-outside-toplevel
  rows = np.empty(len(places), _POST)
  rows['cell'] = [grid.cell(p['array'], p['start']) for p in places.values()]
  rows['crc32'] = [int(crcs[t], 16) for t in places]
  return base64.b64encode(rows.tobytes()).decode('ascii')


def _refused(what: str) -> CheckpointError:
  return CheckpointError('E-DIST-002', f'the part records {what}',
                         'nothing was committed; the next save tries again')


def merge(grid: Grid, posts: Sequence[str]) -> Any:
  """Process 0: the table's (process, CRC-32) per cell from every process's `post`, in process
  order; E-DIST-002 unless they hold every cell of `grid` exactly once."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  table = np.zeros(grid.total, _CELL)
  numbers = []
  for k, text in enumerate(posts):
    try:
      raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
      raise _refused(f'of process {k}: not base64 ({e})') from e
    if len(raw) % _ITEM:
      raise _refused(f'of process {k}: {len(raw)} bytes, not whole cells')
    rows = np.frombuffer(raw, _POST)
    if rows.size and int(rows['cell'].max()) >= grid.total:
      raise _refused(f'of process {k}: a cell beyond the {grid.total} of the grid')
    table['process'][rows['cell']] = k
    table['crc32'][rows['cell']] = rows['crc32']
    numbers.append(rows['cell'])
  held = np.bincount(np.concatenate(numbers or [np.zeros(0, '<u4')]), minlength=grid.total)
  if (held != 1).any():
    raise _refused(f'hold {int((held == 0).sum())} of the {grid.total} cells no times and '
                   f'{int((held > 1).sum())} more than once')
  return table


def table_bytes(grid: Grid, files: Sequence[str], cells: Any) -> bytes:
  """The bytes of a version-2 `shards.json` (the same on every process that writes it)."""
  head = json.dumps(
      {
          'format': 'jaxckpt.shards', 'version': VERSION, 'grid': grid.to_json(),
          'files': list(files)
      },
      separators=(',', ':'))
  return (head[:-1] + ',"cells":"').encode() + base64.b64encode(cells.astype(_CELL).tobytes()) + \
      b'"}\n'


class Table(abc.Mapping):
  """A version-2 shard table, checked: {array: its rows} (built on demand), and
  `overlapping(array, box)`, the rows of just the cells a box touches."""

  def __init__(self, table: Mapping[str, Any], shapes: Mapping[str, list],
               file_ok: Callable[[Any], bool], damaged: Callable[[str], CheckpointError]):
    arrays, names = table.get('grid'), set()
    if not isinstance(arrays, list):
      raise damaged('no grid')
    for row in arrays:
      name, parts = row if isinstance(row, list) and len(row) == 2 else (None, None)
      shape = shapes.get(name) if isinstance(name, str) else None
      if shape is None or name in names or not isinstance(parts, list) or len(parts) != len(
          shape) or not all(type(n) is int and even(m, n) for m, n in zip(shape, parts)):  # pylint: disable=unidiomatic-typecheck
        raise damaged(f'a malformed grid row {json.dumps(row, default=str)[:160]}')
      names.add(name)
    self.grid = Grid((name, shapes[name], parts) for name, parts in arrays)
    files = table.get('files')
    if not isinstance(files, list) or not all(file_ok(f) for f in files):
      raise damaged(f'a malformed files list {json.dumps(files, default=str)[:160]}')
    try:
      raw = base64.b64decode(table.get('cells'), validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
      raise damaged(f'cells that are not base64 ({e})') from e
    if len(raw) != self.grid.total * _ITEM:
      raise damaged(f'{len(raw)} bytes of cells; its grid has {self.grid.total} cells of '
                    f'{_ITEM} bytes')
    import numpy as np  # pylint: disable=import-outside-toplevel
    self.cells = np.frombuffer(raw, _CELL)
    if self.cells.size and int(self.cells['process'].max()) >= len(files):
      raise damaged(f'a cell of a process beyond the {len(files)} files')
    self.files, self.shapes = files, shapes
    self._looked, self._rows = 0, None  # cells looked up so far; each cell's (process, crc32)

  def overlapping(self, array: str, box: Box) -> list[dict]:
    """The rows of the cells of `array` that overlap `box`."""
    if array not in self.grid:
      return []
    shape = self.shapes[array]
    cells = list(self.grid.cells(array, box))
    at = [number for number, _ in cells]
    # A numpy record per cell is slow: a restore's few cells are read at once, and a table
    # looked up at large (process 0's plan of a restore from the peers) is read whole once.
    self._looked += len(at)
    if self._rows is None and self._looked > len(self.cells) // 16:
      self._rows = (self.cells['process'].tolist(), self.cells['crc32'].tolist())
    if self._rows is not None:
      processes, crcs = [self._rows[0][n] for n in at], [self._rows[1][n] for n in at]
    else:
      processes, crcs = self.cells['process'][at].tolist(), self.cells['crc32'][at].tolist()
    out = []
    for (_, cell), process, crc in zip(cells, processes, crcs):
      out.append({
          'file': self.files[process], 'tensor': tensor_name(array, cell, shape),
          'start': [a for a, _ in cell], 'shape': [b - a for a, b in cell], 'crc32': f'{crc:08x}'
      })
    return out

  def __contains__(self, array: object) -> bool:  # not Mapping's: that builds every row
    return array in self.grid

  def tensors_in(self) -> dict[str, int]:
    """{state file: how many tensors (shards) it holds}, from the cells alone."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    counts = np.bincount(self.cells['process'], minlength=len(self.files))
    return {f: int(n) for f, n in zip(self.files, counts)}

  def __getitem__(self, array: str) -> list[dict]:
    if array not in self.grid:
      raise KeyError(array)
    return self.overlapping(array, tuple((0, m) for m in self.shapes[array]))

  def __iter__(self) -> Iterator[str]:
    return iter(self.grid.names())

  def __len__(self) -> int:
    return len(self.grid.arrays)
