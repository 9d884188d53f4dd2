"""Boxes of arrays filled from the shards of a checkpoint written by several processes.

`fill` reads, for each buffer of a box (the extent of an array one device holds), the part of
every shard that overlaps it, from the state files the shard table names: each part straight
into its place when it is the whole shard and one run of the buffer (a restore on the mesh that
saved, a split of leading rows); otherwise its rows in windows of at most `WINDOW` bytes (each
window's first-to-last byte range read into one buffer, then placed; a row longer than that a
dimension down), so a part of any size needs a window of host memory besides its place, not a
copy of the shard. A whole shard's CRC-32 is checked as it is read, window after window.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from . import layout, shardtable, statefile
from .checksum import crc32
from .directio import pread_into
from .errors import CheckpointError

Box = tuple[tuple[int, int], ...]  # [start, stop) per dimension, in the global shape
_READERS = 4
WINDOW = 64 << 20  # bytes a part not read straight into its place is read in, at most at once


def box_of(index, shape) -> Box:
  """The box a device's index (a tuple of slices into the global shape) covers."""
  return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape))


class _Files:
  """Open state files and their headers, each read once."""

  def __init__(self, step_dir: Path):
    self.step_dir, self.open = step_dir, {}

  def entry(self, rel: str, tensor: str) -> tuple[int, int, dict]:
    if rel not in self.open:
      path = layout.safe_member(self.step_dir, rel)
      subset = layout.subset_of(path)  # what a restore's peers sent
      if not path.exists() and subset.is_file():
        path = subset
      fd = os.open(path, os.O_RDONLY)
      header_len, entries, _ = statefile.read_header(path, fd)
      self.open[rel] = (fd, header_len, entries, path == subset)
    fd, header_len, entries, in_subset = self.open[rel]
    if tensor not in entries and in_subset:
      raise CheckpointError(
          'E-CKPT-012', f'{self.step_dir / rel}{layout.SUBSET}: {tensor} is not among the tensors '
          f'a restore from the peers sent this host, and {rel} is not here',
          f'bring {rel} of this checkpoint here (from the host that holds it), or restore on '
          'the mesh that restore was for')
    if tensor not in entries:
      raise CheckpointError('E-CKPT-012', f'{self.step_dir / rel}: {tensor} is not in the file',
                            statefile.DAMAGED)
    return fd, header_len, entries[tensor]

  def close(self) -> None:
    for fd, *_ in self.open.values():
      os.close(fd)


def fill(step_dir: Path,
         shards: shardtable.Table,
         boxes: Mapping[str, dict[Box, Any]],
         dtypes: Mapping[str, Any],
         *,
         checksums: bool,
         files: '_Files | None' = None) -> None:
  """Fill each buffer `boxes[array][box]` (a host array of the box's extent) from the shards
  that overlap it, reading only the byte range of each shard that covers the overlap. `files`:
  `open_files(step_dir)`, kept open by a caller that fills several times (closed by it)."""
  own, files = files is None, files or _Files(step_dir)
  jobs = []
  try:
    with concurrent.futures.ThreadPoolExecutor(
        _READERS, thread_name_prefix='jaxckpt-shard') as pool:
      for array, wanted in boxes.items():
        dtype = np.dtype(dtypes[array])
        for box, buf in wanted.items():
          parts = []  # what each shard gives, in the box's own coordinates
          for s in shards.overlapping(array, box):
            local = [(max(a, b0) - b0, min(b, b0 + n) - b0)
                     for (a, b), b0, n in zip(box, s['start'], s['shape'])]
            if any(lo >= hi for lo, hi in local):
              continue
            parts.append(([b0 + lo - a for (lo, _), b0, (a, _) in zip(local, s['start'], box)],
                          [hi - lo for lo, hi in local]))
            fd, header_len, entry = files.entry(s['file'], s['tensor'])
            if entry['shape'] != list(s['shape']) or statefile.DTYPES[entry['dtype']] != dtype:
              raise CheckpointError(
                  'E-CKPT-012', f'{step_dir / s["file"]}: {s["tensor"]} is '
                  f'{entry["dtype"]}{entry["shape"]}, the manifest says {dtype}{s["shape"]}',
                  statefile.DAMAGED)
            jobs.append(
                pool.submit(_read_into, fd, header_len + entry['data_offsets'][0], s, local, box,
                            buf, dtype, checksums and s.get('crc32')))
          # Every element of the box from exactly one shard: a part left out would be a buffer
          # never written (np.empty's), two that overlap would leave out another part as much.
          if not shardtable.tiles(parts, [b - a for a, b in box]):
            raise CheckpointError(
                'E-CKPT-012', f'{step_dir}: the shards of {array} do not cover '
                f'{list(box)} exactly once', statefile.DAMAGED)
      for job in jobs:
        job.result()
  finally:
    if own:
      files.close()


def open_files(step_dir: Path) -> _Files:
  """The state files of `step_dir`, opened as `fill` needs them, each header read once, for
  several `fill`s; `close()` them after."""
  return _Files(step_dir)


def _read_into(fd, offset, shard, local, box, buf, dtype, expect) -> None:
  """Read the part `local` of `shard` into where it lies in `buf` (whose extent is `box`):
  straight there when the part is the whole shard and one run of `buf`, else by windows
  (`_windows`), each window's row-major byte range (at most `WINDOW` bytes, or one element row
  of the last dimension's when that is longer) read into one buffer and placed."""
  shape = list(shard['shape'])
  at = tuple(
      slice(b0 + lo - a, b0 + hi - a) for (lo, hi), b0, (a, _) in zip(local, shard['start'], box))
  dest = buf[at + (Ellipsis,)]  # a view, of a 0-d buffer too
  whole = all(lo == 0 and hi == n for (lo, hi), n in zip(local, shape))
  if whole and dest.flags.c_contiguous:
    _read_exact(fd, dest.reshape(-1).view(np.uint8), offset, shard)
    _check(shard, expect, crc32(dest.reshape(-1).view(np.uint8)))
    return
  crc = _windows(fd, offset, shape, local, dest, dtype, shard, whole, 0)
  if whole:
    _check(shard, expect, crc)


def _windows(fd, offset, shape, local, dest, dtype, shard, whole, crc) -> int:
  """Part `local` of the row-major block `shape` at `offset` into `dest` (its extent): rows of
  the leading dimension a window at a time, or, where one row's range is over `WINDOW`, each row
  a dimension down. Returns `crc` continued over the bytes read when the part is `whole` (then
  every read is of whole rows, one after another: the block's bytes in order)."""
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  (lo0, hi0), rest = local[0], local[1:]
  step = strides[0] * dtype.itemsize  # the bytes of one leading row
  # A row's byte range, from the first to the last element of the part in it.
  row = (sum((hi - 1 - lo) * st for (lo, hi), st in zip(rest, strides[1:])) + 1) * dtype.itemsize
  if row > WINDOW and rest:
    for r in range(lo0, hi0):
      crc = _windows(fd, offset + r * step, shape[1:], rest, dest[r - lo0], dtype, shard, whole,
                     crc)
    return crc
  rows = max(1, min(hi0 - lo0, WINDOW // step))
  window = np.empty(((rows - 1) * step + row,), np.uint8)
  for r in range(lo0, hi0, rows):
    part = [(r, min(hi0, r + rows))] + rest
    first = sum(lo * st for (lo, _), st in zip(part, strides))
    last = sum((hi - 1) * st for (_, hi), st in zip(part, strides))
    raw = window[:(last - first + 1) * dtype.itemsize]
    _read_exact(fd, raw, offset + first * dtype.itemsize, shard)
    if whole:
      crc = crc32(raw, crc)
    dest[r - lo0:part[0][1] - lo0] = np.lib.stride_tricks.as_strided(
        raw.view(dtype), [hi - lo for lo, hi in part], [st * dtype.itemsize for st in strides])
  return crc


def _read_exact(fd, raw: np.ndarray, offset: int, shard) -> None:
  if pread_into(fd, memoryview(raw), offset) < len(raw):
    raise CheckpointError('E-CKPT-012', f'{shard["file"]}: {shard["tensor"]} ends early',
                          statefile.DAMAGED)


def _check(shard, expect, crc: int) -> None:
  if expect and f'{crc:08x}' != expect:
    raise CheckpointError(
        'E-CKPT-003', f'{shard["file"]}: {shard["tensor"]}: checksum '
        f'mismatch (manifest says {expect})', 'resume from an earlier checkpoint')
