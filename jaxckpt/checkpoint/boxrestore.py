"""A restore's boxes (the extents of an array this process's devices hold): which they are,
read from the state files of a checkpoint written by several processes (`boxread.fill`), and
placed on the devices.

`restore` reads and places a window of arrays at a time (at most `PLACE_WINDOW` bytes of boxes;
a larger array is a window of its own), each window placed before the next is read: onto an
accelerator the host buffers are copied to the devices and dropped, so the host holds a window,
not this process's share of the state (on the CPU the buffers become the arrays). A restore
beside a compile does the same on a thread of its own (`reading.read_arrays`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from . import boxread, shardtable, statefile
from .boxread import Box, box_of, fill

PLACE_WINDOW = 256 << 20  # bytes of boxes a restore reads before it places them, at most


def restore(step_dir: Path,
            shards: shardtable.Table,
            want: Mapping[str, Any],
            *,
            checksums: bool,
            held: Held | None = None) -> dict[str, jax.Array]:
  """The arrays `want` ({name: target with shape, dtype, sharding}), each process reading just
  what its devices hold, a window of arrays at a time (see the module). `held`: `held_boxes(want)`
  when the caller has it already."""
  held, out = held_boxes(want) if held is None else held, {}
  files = boxread.open_files(step_dir)
  try:
    for names in _windows(held):
      part = {n: held[n] for n in names}
      out.update(
          place({n: want[n] for n in names},
                read_boxes(step_dir, shards, part, checksums=checksums, files=files)))
  finally:
    files.close()
  return out


def _windows(held: 'Held') -> list[list[str]]:
  """The names of `held` in windows of at most `PLACE_WINDOW` bytes of boxes."""
  windows: list[list[str]] = []
  size = PLACE_WINDOW
  for name, (boxes, dtype) in held.items():
    nbytes = sum(math.prod(hi - lo for lo, hi in b) for b in boxes) * dtype.itemsize
    if size + nbytes > PLACE_WINDOW:
      windows.append([])
      size = 0
    windows[-1].append(name)
    size += nbytes
  return windows


Held = Mapping[str, tuple[set[Box], np.dtype]]  # {name: (the boxes held here, dtype)}


def held_boxes(want: Mapping[str, Any]) -> Held:
  """{name: (the boxes of it this process's devices hold, each once; its dtype)}."""
  out = {}
  for name, x in want.items():
    shape = tuple(x.shape)
    out[name] = ({
        box_of(i, shape) for i in x.sharding.addressable_devices_indices_map(shape).values()
    }, np.dtype(x.dtype))
  return out


def read_bound(shards: shardtable.Table, held: Held) -> int:
  """At most the bytes `read_boxes` reads from the files for `held`: every shard overlapping a
  box, whole (a window of a shard is read first byte to last, so a box that cuts a shard's
  columns reads most of its rows)."""
  return sum(
      math.prod(s['shape']) * dtype.itemsize
      for name, (boxes, dtype) in held.items()
      for b in boxes
      for s in shards.overlapping(name, b))


def read_boxes(step_dir: Path,
               shards: shardtable.Table,
               held: Held,
               *,
               checksums: bool,
               files=None) -> dict[str, dict[Box, np.ndarray]]:
  """{name: {box: host array}} of the boxes `held_boxes` named, read from the files (`files`:
  `boxread.open_files`, kept open across calls). No jax runs here: `place` puts them on the
  devices."""
  boxes = {
      name: {b: np.empty([hi - lo for lo, hi in b], dtype) for b in got}
      for name, (got, dtype) in held.items()
  }
  fill(
      step_dir,
      shards,
      boxes, {n: dtype for n, (_, dtype) in held.items()},
      checksums=checksums,
      files=files)
  return boxes


def place(want: Mapping[str, Any],
          boxes: Mapping[str, Mapping[Box, np.ndarray]]) -> dict[str, jax.Array]:
  """The arrays of `want` built from `read_boxes`'s answer, on their shardings."""
  return {
      name:
          jax.make_array_from_callback(
              tuple(x.shape),
              x.sharding,
              lambda i, b=boxes[name], s=tuple(x.shape): b[box_of(i, s)])
      for name, x in want.items()
  }


def read_host(step_dir: Path, meta: Mapping[str, Any], names=None) -> dict[str, np.ndarray]:
  """Whole arrays (all, or `names`) of a checkpoint written by several processes, on the host."""
  rows = [r for r in meta['tensors'] if names is None or r['name'] in names]
  boxes = {
      r['name']: {tuple((0, n) for n in r['shape']): np.empty(r['shape'], _dtype(r['dtype']))}
      for r in rows
  }
  fill(
      step_dir,
      shardtable.shard_table(step_dir, meta, None),
      boxes, {r['name']: _dtype(r['dtype']) for r in rows},
      checksums=True)
  return {n: next(iter(b.values())) for n, b in boxes.items()}


def _dtype(name: str) -> np.dtype:
  return statefile.DTYPES[statefile.CODES[name]]


__all__ = [
    'PLACE_WINDOW', 'held_boxes', 'place', 'read_bound', 'read_boxes', 'read_host', 'restore'
]
