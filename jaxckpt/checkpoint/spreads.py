"""Bytes of one process's file sent to every process at once, over the job's interconnect.

A small file (a checkpoint's manifest, its run state, its shard table) goes from the process
that holds it to all (`broadcast`); so do the bytes of a part that several processes need alike
(`spread`): the whole part in a data-parallel job, where every process needs every part, or the
few replicated tensors of a fully sharded one (a subset, `sends.subset_spec`). Each window is
one `multihost_utils.broadcast_one_to_all` (a sum over the processes, compiled once for its
shape), where point-to-point rounds (`sends.carry`) would take a round per receiver, each a
collective compiled for its own pairs. The sender reads the next window while one is in the
collective, and the receivers write each behind it (`diskwork.Landing`: checked, fsynced, renamed
in).
"""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from . import layout, sends
from .diskwork import READER, WRITER, Disk, Task
from .errors import CheckpointError


def broadcast(source: Path | None,
              size: int,
              receive: bool,
              disk: Disk | None = None) -> tuple[bytes | None, str | None]:
  """A small file from the process that reads it from `source` to every process (a JAX
  collective, in windows): (its bytes for a receiver, else None; this process's problem or
  None). A source that cannot read sends zeros to the end (the others' CRC checks fail) and says
  why. Every process calls it with the same `size`. `disk`: the restore's (`diskwork.Disk`),
  else one of its own."""
  if disk is None:
    with Disk() as disk:
      return broadcast(source, size, receive, disk)
  got, problems, closing = [], [], []
  # pylint: disable-next=consider-using-with
  fin = disk.kept(problems, READER, f'opening {source}', open, source,
                  'rb') if source is not None else None

  def fill(view: memoryview, _: int) -> None:
    try:
      n = fin.readinto(view)
    except OSError as e:
      raise OSError(f'{source}: {e.strerror or e}') from e
    if n != len(view):
      raise OSError(f'{source} ends early')

  sent = _broadcast(size, fill if fin is not None else None, source is not None,
                    lambda _, data: got.append(data.tobytes()), disk, f'reading {source}',
                    'keeping it')
  if fin is not None:  # a hung disk's file is left open
    disk.kept(closing, READER, f'closing {source}', fin.close)
  problem = next(iter(problems), None) or sent or next(iter(closing), None) or disk.stuck
  return (b''.join(got) if receive else None), problem


def share(data: bytes | None, size: int) -> tuple[bytes, str | None]:
  """`size` bytes that one process holds in memory (`data`; None on the others) to every process
  at once, as `broadcast` sends a file: (the bytes, for the caller to check; this process's
  problem or None). Every process calls it with the same `size`."""
  got = []

  def fill(view: memoryview, lo: int) -> None:
    view[:] = data[lo:lo + len(view)]

  with Disk() as disk:  # its threads copy the windows here: no disk work
    problem = _broadcast(size, fill if data is not None else None, data is not None,
                         lambda _, out: got.append(out.tobytes()), disk, 'copying', 'keeping')
  return b''.join(got), problem


def spread(source: Path | None,
           tensors: sends.Tensors | None,
           into: Path | None,
           whole: Mapping[str, Any] | None = None,
           disk: Disk | None = None) -> tuple[int, str | None]:
  """The same bytes of a part from its sender to every process at once, window by window, in one
  collective each: where several processes need the same bytes of one part (its few replicated
  tensors in a fully sharded job: every process but its owner; the whole part in a
  data-parallel one). `source`: the sender's copy of the part; `tensors`: those of a subset,
  which a receiver gets as `<part>.subset` checked against `sends.subset_spec(tensors)`, or None
  for the whole part, which it gets at `into` checked against `whole` (its {size, crc32} in the
  manifest); `into`: the part's path on a receiver. Every process calls it with the same
  `tensors` and `whole`. Returns (the bytes this process received intact, its problem or
  None). `disk`: the restore's (`diskwork.Disk`), else one of its own."""
  if disk is None:
    with Disk() as disk:
      return spread(source, tensors, into, whole, disk)
  spec = sends.subset_spec(tensors) if tensors is not None else whole
  fd, segments, problems, is_source = None, [], [disk.stuck
                                                ] if disk.stuck else [], source is not None
  if problems:  # a hung disk: nothing more opened, zeros sent
    source = into = None
  if source is not None:
    fd, segments = disk.kept(problems, READER, f'opening {source}', sends.opened, source, tensors,
                             spec['size']) or (None, [])
  target = into if into is None or tensors is None else layout.subset_of(into)
  landing = sends.landed(disk, target, spec['size'], problems)

  def keep(lo: int, data: np.ndarray) -> None:
    # A write that fails is kept as this process's problem: it goes on taking every window.
    if landing.open and not problems:
      try:
        landing.write(lo, data)
      except OSError as e:
        problems.append(f'{landing.tmp}: {e.strerror or e}')
      except Exception as e:  # noqa: BLE001 - said to every process, never raised here
        problems.append(f'{landing.tmp}: {type(e).__name__}: {e}')

  sent = _broadcast(spec['size'],
                    (lambda view, lo: sends.fill_window(fd, source, segments, view, lo))
                    if fd is not None and not problems else None, is_source, keep, disk,
                    f'reading {source}', f'writing {landing.tmp}')
  problems += [sent] if sent and sent not in problems else []
  if fd is not None:  # after the collectives: said, never raised; a hung disk's left open
    disk.kept(problems, READER, f'closing {source}', os.close, fd)
  problem = sends.finished(disk, landing, spec['crc32'],
                           'the shard table' if tensors else 'the manifest')
  if target is None or problem:
    return 0, problem
  if tensors is None:
    return spec['size'], None
  problem = disk.kept(problems, WRITER, f'removing {into}', sends.subset_in, into)
  return spec['size'], problem or (problems[0] if problems else None)


def _broadcast(size: int,
               fill: Callable[[memoryview, int], None] | None,
               is_source: bool,
               keep: Callable[[int, np.ndarray], None],
               disk: Disk,
               reading: str = 'reading',
               keeping: str = 'keeping') -> str | None:
  """`size` bytes from the process where `is_source` to every process, a window at a time
  (`multihost_utils.broadcast_one_to_all`): the source's `fill(view, offset)` makes each window
  on `disk`'s reader, the next one read while the one before is in the collective; every
  process's `keep(offset, bytes)` takes each on its writer while the next ones move (at most two
  behind). A `fill` that fails (or none, on the source) sends zeros to the end: every process
  takes part in every window; so does one that hangs (`diskwork.Disk`: `reading` and `keeping`
  name what hung), and then no `keep` runs either. The problem of this process's reads or
  keeps, or None."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  window = sends.SMALL if size <= sends.SMALL else sends.WINDOW
  problem = None if fill is not None or not is_source else 'nothing to send'
  zeros = np.zeros(window, np.uint8)
  bufs = [np.zeros(window, np.uint8) for _ in range(2)] if fill is not None else []

  def read(i: int) -> np.ndarray:
    lo, buf = i * window, bufs[i % 2]
    n = min(window, size - lo)
    fill(memoryview(buf)[:n], lo)
    buf[n:] = 0  # the last window's tail: zeros, not the window before's bytes
    return buf

  count = -(-size // window)
  ahead = disk.submit(READER, reading, read, 0) if fill is not None and count else None
  writes = collections.deque()
  for i in range(count):
    buf = zeros
    if ahead is not None:
      try:  # a read that fails sends zeros: the receivers' checks fail, none left waiting
        buf = disk.result(ahead)
      except CheckpointError as e:
        problem = e.line()
      except Exception as e:  # noqa: BLE001 - returned, said to every process
        problem = str(e) if isinstance(e, OSError) else f'{type(e).__name__}: {e}'
      more = problem is None and i + 1 < count
      ahead = disk.submit(READER, reading, read, i + 1) if more else None
    buf = zeros if problem is not None else buf
    # Returns once the collective is done with `buf`, which the reader then refills; one
    # process alone gets `buf` back itself, copied before the reader can refill it.
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=is_source))
    out = out.copy() if np.shares_memory(out, buf) else out
    write = disk.submit(WRITER, keeping, keep, i * window, out[:min(window, size - i * window)])
    writes.extend([write] if write is not None else [])
    while len(writes) > 2:
      problem = _kept(disk, writes.popleft(), problem)
  for w in writes:
    problem = _kept(disk, w, problem)
  return problem


def _kept(disk: Disk, write: Task, problem: str | None) -> str | None:
  """`problem`, or the one `keep` raised (it never leaves the windows early)."""
  try:
    disk.result(write)
  except Exception as e:  # noqa: BLE001 - returned, said to every process
    return problem or (str(e) if isinstance(e, OSError) else f'{type(e).__name__}: {e}')
  return problem


__all__ = ['broadcast', 'share', 'spread']
