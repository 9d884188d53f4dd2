"""Aligned buffers and O_DIRECT file I/O, with the fallbacks filesystems need.

A checkpoint is written and read at disk speed by moving page-aligned buffers to and from
4 KiB-aligned file offsets with O_DIRECT: no page cache to fill and later flush. Filesystems
without O_DIRECT fall back to buffered I/O + fsync: those that refuse the flag at `open` (tmpfs)
and those that accept it and then fail the first `pwrite`/`preadv` with EINVAL (some network and
FUSE mounts); the path taken is logged once per process.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path

import numpy as np

ALIGN = 4096
_HUGE_PAGE = 2 << 20

_log = logging.getLogger(__name__)
_said: set[str] = set()
_said_lock = threading.Lock()


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


def padded_view(x: np.ndarray) -> memoryview:
  """The array's bytes including its zero padding when `aligned_empty` made its buffer."""
  top = x
  while isinstance(top.base, np.ndarray):
    top = top.base
  if (x.flags.c_contiguous and top.dtype == np.uint8 and top.ndim == 1
      and top.ctypes.data == x.ctypes.data and len(top) >= padded(x.nbytes)):
    return memoryview(top)[:padded(x.nbytes)]
  return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def say_once(path_taken: str, where: Path) -> None:
  with _said_lock:
    if path_taken in _said:
      return
    _said.add(path_taken)
  _log.info('checkpoint I/O: %s (first seen at %s)', path_taken, where)


def open_direct(path: Path, flags: int) -> tuple[int, bool]:
  """(fd, whether O_DIRECT is on); without O_DIRECT where the filesystem refuses it."""
  direct = getattr(os, 'O_DIRECT', 0)
  if direct:
    try:
      fd = os.open(path, flags | direct, 0o644)
      say_once('O_DIRECT', path)
      return fd, True
    except OSError:
      pass  # the filesystem does not support it
  say_once('buffered I/O + fsync (the filesystem refuses O_DIRECT)', path)
  return os.open(path, flags, 0o644), False


def _drop_direct(fd: int) -> None:
  """Turn O_DIRECT off on `fd`: the filesystem failed an aligned direct transfer with EINVAL.
  Idempotent: another thread's transfer may have failed the same way first."""
  direct = getattr(os, 'O_DIRECT', 0)
  flags = fcntl.fcntl(fd, fcntl.F_GETFL)
  if direct and flags & direct:
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~direct)
    where = f'/proc/self/fd/{fd}'
    say_once('buffered I/O + fsync (the filesystem accepts O_DIRECT but fails its transfers)',
             Path(os.readlink(where)) if os.path.exists(where) else Path(f'fd {fd}'))


def _transfer(fn, fd: int, view: memoryview, offset: int) -> int:
  """`fn(fd, view, offset)` (pwrite or preadv); an EINVAL is retried once without O_DIRECT."""
  try:
    return fn(fd, view, offset)
  except OSError as e:
    if e.errno != errno.EINVAL or not getattr(os, 'O_DIRECT', 0):
      raise
  _drop_direct(fd)
  return fn(fd, view, offset)  # the same bytes through the page cache; the final fsync covers them


def pwrite_all(fd: int, data, offset: int) -> None:
  view = memoryview(data)
  while view:
    n = _transfer(os.pwrite, fd, view, offset)
    view, offset = view[n:], offset + n


def pread_into(fd: int, view: memoryview, offset: int) -> int:
  """Fill `view` from `offset` until it is full or the file ends; returns the bytes read."""
  done = 0
  while done < len(view):
    n = _transfer(lambda fd, v, o: os.preadv(fd, [v], o), fd, view[done:], offset + done)
    if n == 0:
      break
    done += n
  return done
