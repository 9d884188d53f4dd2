"""jaxckpt's own array store for single-process states: one flat file, written at disk speed.

orbax-checkpoint writes a 1.46 GB state at ~0.6 GB/s here (tensorstore chunks, OCDBT, per-leaf
fixed costs) while the disk takes ~2 GB/s with O_DIRECT; `benchmarks/checkpoint.py` measures
both. This store writes the already-staged host buffers straight to `state/arrays.bin`:

- every array starts at a 4 KiB-aligned offset, so each one is a single O_DIRECT `pwrite` from
  the (page-aligned, zero-padded) staging buffer: no page cache to fill and later flush;
- the file's CRC-32 is computed in file order while the writes are in flight, so committing
  needs no second pass over the data;
- `state/index.json` says where each array is (offset, shape, dtype) and its own CRC-32.

Reads mirror it: four threads read into huge-page buffers (one per large array, one per run of
small ones) while the caller checks the CRC and places each finished run (on its devices).
Filesystems without O_DIRECT fall back to buffered I/O + fsync: those that refuse the flag at
`open` (tmpfs) and those that accept it and then fail the first `pwrite`/`preadv` with EINVAL
(some network and FUSE mounts); the path taken is logged once per process.
Multi-process states (arrays not fully addressable) are written by orbax instead.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from . import atomic, manifest
from .checksum import crc32
from .errors import CheckpointError

DATA = 'arrays.bin'
INDEX = 'index.json'
FORMAT = 'jaxckpt.rawstore'
ALIGN = 4096
_CHUNK = 64 << 20  # the CRC runs on one chunk while the next one is being written
_HUGE_PAGE = 2 << 20
# Restore reads: the threads spend most of their time in the kernel (faulting destination pages
# in, waiting on the disk), so a few more than two cores still help.
_READERS = 4


def padded(nbytes: int) -> int:
  return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(shape: tuple[int, ...], dtype, *, populate: bool = True) -> np.ndarray:
  """An array whose buffer is page-aligned and zero-padded to a multiple of ALIGN bytes.

  Anonymous mmap memory is page-aligned and zero-filled. Buffers of 2 MiB and more ask for
  transparent huge pages: a fresh 1.46 GB state then faults in 700 pages instead of 356,000,
  0.15 s instead of 0.5 s on this VM. `populate` faults every page in now (staging buffers, so
  the first save's copy does not pay for it); without it the first write to each page does, which
  for a restore is the reader threads' O_DIRECT reads, in parallel.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  size = max(padded(nbytes), ALIGN)
  huge = size >= _HUGE_PAGE and hasattr(mmap, 'MADV_HUGEPAGE')
  # MAP_POPULATE faults small buffers in with one call, ~2x faster than touching 4 KiB pages;
  # huge pages must be asked for (madvise) before the first fault, so those are touched below.
  flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
  if populate and not huge:
    flags |= getattr(mmap, 'MAP_POPULATE', 0)
  buf = mmap.mmap(-1, size, flags=flags)
  whole = np.frombuffer(buf, np.uint8)
  if huge:
    try:
      buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
      pass  # transparent huge pages are off or unsupported: 4 KiB pages, same result
    if populate:
      whole[::ALIGN] = 0
  return whole[:nbytes].view(dtype).reshape(shape)


def _padded_view(x: np.ndarray) -> memoryview:
  """The array's bytes including its zero padding when `aligned_empty` made its buffer."""
  top = x
  while isinstance(top.base, np.ndarray):
    top = top.base
  if (x.flags.c_contiguous and top.dtype == np.uint8 and top.ndim == 1
      and top.ctypes.data == x.ctypes.data and len(top) >= padded(x.nbytes)):
    return memoryview(top)[:padded(x.nbytes)]
  return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


_log = logging.getLogger(__name__)
_said: set[str] = set()
_said_lock = threading.Lock()


def _say_once(path_taken: str, where: Path) -> None:
  with _said_lock:
    if path_taken in _said:
      return
    _said.add(path_taken)
  _log.info('raw store: %s (first seen at %s)', path_taken, where)


def _open_direct(path: Path, flags: int) -> tuple[int, bool]:
  direct = getattr(os, 'O_DIRECT', 0)
  if direct:
    try:
      fd = os.open(path, flags | direct, 0o644)
      _say_once('O_DIRECT I/O', path)
      return fd, True
    except OSError:
      pass  # the filesystem does not support it
  _say_once('buffered I/O + fsync (the filesystem refuses O_DIRECT)', path)
  return os.open(path, flags, 0o644), False


def _drop_direct(fd: int) -> None:
  """Turn O_DIRECT off on `fd`: the filesystem failed an aligned direct transfer with EINVAL.
  Idempotent: another thread's transfer may have failed the same way first."""
  direct = getattr(os, 'O_DIRECT', 0)
  flags = fcntl.fcntl(fd, fcntl.F_GETFL)
  if direct and flags & direct:
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~direct)
    _say_once(
        'buffered I/O + fsync (the filesystem accepts O_DIRECT but fails its transfers)',
        Path(os.readlink(f'/proc/self/fd/{fd}'))
        if os.path.exists('/proc/self/fd') else Path(f'fd {fd}'))


def _transfer(fn, fd: int, view: memoryview, offset: int) -> int:
  """`fn(fd, view, offset)` (pwrite or preadv); an EINVAL is retried once without O_DIRECT."""
  try:
    return fn(fd, view, offset)
  except OSError as e:
    if e.errno != errno.EINVAL or not getattr(os, 'O_DIRECT', 0):
      raise
  _drop_direct(fd)
  return fn(fd, view, offset)  # the same bytes through the page cache; the final fsync covers them


def write(directory: Path, arrays: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
  """Write `arrays` under `directory` durably; returns their file table entries (size, crc32)."""
  directory.mkdir(parents=True, exist_ok=True)
  index, offset = {}, 0
  for name, x in arrays.items():
    index[name] = {
        'offset': offset, 'nbytes': int(x.nbytes), 'shape': list(x.shape), 'dtype': str(x.dtype)
    }
    offset += padded(x.nbytes)
  fd, direct = _open_direct(directory / DATA, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  crc = 0
  try:
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix='jaxckpt-raw') as pool:
      pending = []
      for name, x in arrays.items():
        view = _padded_view(x)
        aligned = len(view) % ALIGN == 0 and _address(view) % ALIGN == 0
        if direct and not aligned:
          view = _copy_aligned(view)
        start = index[name]['offset']
        index[name]['crc32'] = f'{crc32(view[:x.nbytes]):08x}'  # for reads of a subset
        for lo in range(0, len(view), _CHUNK):
          chunk = view[lo:lo + _CHUNK]
          pending.append(pool.submit(_pwrite_all, fd, chunk, start + lo))
          crc = crc32(chunk, crc)  # overlaps the write just submitted
        if len(view) < padded(x.nbytes):  # a buffer that was not padded: pad the file
          pad = bytes(padded(x.nbytes) - len(view))
          pending.append(pool.submit(_pwrite_all, fd, pad, start + len(view)))
          crc = crc32(pad, crc)
      for f in pending:
        f.result()
    os.fsync(fd)
  finally:
    os.close(fd)
  atomic.write_json_durably(directory / INDEX, {'format': FORMAT, 'arrays': index})
  return {DATA: {'size': offset, 'crc32': f'{crc:08x}'}}


def _address(view: memoryview) -> int:
  return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def _copy_aligned(view: memoryview) -> memoryview:
  out = aligned_empty((padded(len(view)),), np.uint8)
  out[:len(view)] = np.frombuffer(view, np.uint8)
  return _padded_view(out)


def _pwrite_all(fd: int, data, offset: int) -> None:
  view = memoryview(data)
  while view:
    n = _transfer(os.pwrite, fd, view, offset)
    view, offset = view[n:], offset + n


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
  fd, direct = _open_direct(directory / DATA, os.O_RDONLY) if direct else \
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
        view = _padded_view(buf)
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
  while view:
    n = _transfer(lambda fd, v, o: os.preadv(fd, [v], o), fd, view, offset)
    if n == 0:
      raise CheckpointError('E-CKPT-003', 'arrays.bin is shorter than its index says',
                            'resume from an earlier checkpoint')
    view, offset = view[n:], offset + n
