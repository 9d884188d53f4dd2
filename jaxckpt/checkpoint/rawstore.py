"""Reading checkpoints in jaxckpt's first state format (read-only; new ones are `statefile`).

    state/arrays.bin    every array at a 4 KiB-aligned offset, zero padding between them
    state/index.json    {'format': 'jaxckpt.rawstore', 'arrays': {name: {offset, nbytes, shape,
                        dtype, crc32}}}, itself covered by the manifest

Checkpoints written before the state file became safetensors still restore, verify, inspect
and export through this module: four threads read into huge-page buffers (one per large array,
one per run of small ones) while the caller checks the CRC and places each finished run.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from . import atomic, manifest
from .checksum import crc32
from .directio import aligned_empty, open_direct, padded, padded_view, pread_into
from .errors import CheckpointError

DATA = 'arrays.bin'
INDEX = 'index.json'
FORMAT = 'jaxckpt.rawstore'
_CHUNK = 64 << 20
_HUGE_PAGE = 2 << 20
_READERS = 4


def read_index(directory: Path) -> dict[str, dict[str, Any]]:
  index = atomic.read_json(directory / INDEX)
  if not isinstance(index, dict) or index.get('format') != FORMAT:
    raise CheckpointError('E-CKPT-004', f'{directory / INDEX} is not a jaxckpt raw index',
                          'the checkpoint is corrupt; verify the checkpoint')
  return index['arrays']


def read(
    directory: Path,
    names=None,
    *,
    expect_crc32: str | None = None,
    direct: bool = True,
    place: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] | None = None) -> dict[str, Any]:
  """The arrays (all, or `names`) as host numpy arrays, or as whatever `place` makes of them.

  Each array of 2 MiB or more gets its own buffer; runs of smaller arrays that lie next to each
  other in the file share one, filled by one read instead of one per array. Reader threads fill
  the buffers in 64 MiB chunks while this thread, as each chunk lands, adds it to the file's CRC
  (with `expect_crc32` and all arrays; a subset is checked against each array's own CRC-32 in the
  index instead) and hands each completed run of arrays to `place` (e.g. `jax.device_put`): the
  caller's own work overlaps the reads. `direct=False` reads through the page cache: right after
  a verification pass has read the file, that is a memory copy instead of a second disk read.
  """
  index = read_index(directory)
  wanted = sorted(index if names is None else names, key=lambda n: index[n]['offset'])
  check_file = expect_crc32 is not None and set(wanted) == set(index)
  check_arrays = expect_crc32 is not None and not check_file
  if check_arrays and any('crc32' not in index[name] for name in wanted):
    _check_file(directory, expect_crc32)  # an index without per-array CRCs: the whole file
    check_arrays = False
  fd, direct = open_direct(directory / DATA, os.O_RDONLY) if direct else \
      (os.open(directory / DATA, os.O_RDONLY), False)
  out, crc = {}, 0
  try:
    with concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix='jaxckpt-raw') as pool:
      runs, jobs = [], []
      for offset, names_in_run in _runs(index, wanted):  # file order: the CRC covers the file
        size = sum(padded(index[name]['nbytes']) for name in names_in_run)
        # Not populated: the reader threads fault the pages in as they read into them.
        buf = aligned_empty((size,), np.uint8, populate=False)
        arrays, at = {}, 0
        for name in names_in_run:
          meta = index[name]
          arrays[name] = buf[at:at + meta['nbytes']].view(meta['dtype']).reshape(meta['shape'])
          at += padded(meta['nbytes'])
        view = padded_view(buf)
        chunks = [view[lo:lo + _CHUNK] for lo in range(0, size, _CHUNK)]
        jobs += [(len(runs), i == len(chunks) - 1, chunk,
                  pool.submit(_pread_all, fd, chunk, offset + i * _CHUNK))
                 for i, chunk in enumerate(chunks)]
        runs.append(arrays)
      for run, last, chunk, job in jobs:
        job.result()
        if check_file:
          crc = crc32(chunk, crc)
        if last:
          if check_arrays:
            _check_arrays(directory, index, runs[run])
          out.update(runs[run] if place is None else place(runs[run]))
          runs[run] = None  # `place` may have copied them (to a GPU): let the host copy go
  finally:
    os.close(fd)
  if check_file:
    _check_crc(directory, f'{crc:08x}', expect_crc32)
  return out


def _check_file(directory: Path, expect_crc32: str) -> None:
  _check_crc(directory, manifest.crc32_file(directory / DATA)[1], expect_crc32)


def _check_crc(directory: Path, got: str, expect_crc32: str) -> None:
  if got != expect_crc32:
    raise CheckpointError(
        'E-CKPT-003', f'{directory / DATA}: checksum mismatch (crc32 {got}, '
        f'manifest says {expect_crc32})', 'resume from an earlier checkpoint')


def _check_arrays(directory: Path, index, arrays: Mapping[str, np.ndarray]) -> None:
  """Each array against its CRC-32 in the index (itself covered by the manifest)."""
  for name, x in arrays.items():
    got = f'{crc32(x.reshape(-1).view(np.uint8)):08x}'
    if got != index[name]['crc32']:
      raise CheckpointError(
          'E-CKPT-003', f'{directory / DATA}: {name}: checksum mismatch '
          f'(crc32 {got}, index says {index[name]["crc32"]})', 'resume from an earlier checkpoint')


def _runs(index: Mapping[str, Mapping[str, Any]], wanted: list[str]) -> list[tuple[int, list[str]]]:
  """(file offset, names): `wanted` (in file order) grouped into the buffers `read` fills."""
  runs: list[tuple[int, list[str]]] = []
  end, joinable = -1, False
  for name in wanted:
    offset, size = index[name]['offset'], padded(index[name]['nbytes'])
    small = size < _HUGE_PAGE
    if small and joinable and offset == end:
      runs[-1][1].append(name)
    else:
      runs.append((offset, [name]))
    end, joinable = offset + size, small
  return runs


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
  if pread_into(fd, view, offset) < len(view):
    raise CheckpointError('E-CKPT-003', 'arrays.bin is shorter than its index says',
                          'resume from an earlier checkpoint')
