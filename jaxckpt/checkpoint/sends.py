"""Files sent from one process to another over the job's interconnect, point to point.

A restore from the peer tier (`peers`) has parts to move: (file, from, to). They go in rounds; in
each round a process sends at most one file and receives at most one, and all of the round's
pairs move at once, window by window, in one XLA collective permute (`jax.lax.ppermute` in a
`shard_map` over one device of each process: NCCL or ICI on accelerators, gloo on CPU). Each
window's read from disk overlaps the collective before it, and its write (with the CRC-32) the
one after it. A received file is checked against its manifest entry, fsynced and renamed in.

A receiver that needs a few tensors of a part (the replicated leaves of a model split over the
processes) gets those alone: a state file of their own (`subset_header`, then each tensor's
bytes, read from the sender's copy), written beside where the part would be
(`<part>.safetensors.subset`) and checked against the CRC-32 the shard table gives each tensor,
combined with the header's. A restore reads a part's tensors from it where the part is absent.
What several processes need alike goes to them all at once (`spreads`), with the same reading
(`segments_of`, `fill_window`) and landing (`Landing`) as here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from . import layout, statefile
from .checksum import crc32, crc32_combine
from .directio import aligned_empty, pread_into
from .errors import CheckpointError

# Bytes per process per collective. On CPU (gloo over loopback, 2 cores), `carry` of 700 MiB
# each way between 2 processes, disk to disk, took 3.8 s with 8 MiB windows and 4.5 s with
# 32 MiB ones (medians of 5 runs; 5.3 s with 32 MiB and a fresh buffer each window, as before).
# The likely reason: below glibc's largest mmap threshold (32 MiB) the runtime's buffers come
# back from the heap instead of each being a fresh mapping whose every page faults in.
WINDOW = 8 << 20
SMALL = 64 << 10  # the window of small files (a manifest, the run state)
MISMATCH = 'what was received does not match'  # a receiver's check, failed: its sender's doing?
# A window's read (or write) not done after this is stuck (a hung disk or mount): its process
# touches that disk no more, sends zeros to the end of the windows and names the file, so the
# job stops with one line, not every process waiting in a collective. The stuck thread is left
# behind (the trainer's process exits without it: `cli.parser.exit_within`).
DISK_WAIT_SECS = 120.0
READER, WRITER = 'jaxckpt-send', 'jaxckpt-receive'  # `Disk`'s threads
Pair = tuple[str, int, int]  # (file, the process that sends it, the process that receives it)
Tensors = list  # a subset: [[tensor, safetensors dtype code, shape, crc32], ...]


def rounds(pairs: list[Pair]) -> list[list[Pair]]:
  """`pairs` in rounds in which no process sends or receives twice (every process computes the
  same from the same list): each pair in the first round where its sender sends nothing yet
  and its receiver receives nothing yet, taken in the order of how far along the ring of
  processes it goes (then as listed). When every process sends to every other (a data-parallel
  job of fresh machines), that is N - 1 rounds, each a shift of the ring, the fewest there can
  be; the work is about linear in the pairs. At 1000 such hosts (a million pairs): 999 rounds
  in 2.2 s, where passes over the pairs left, each taking what it could in the order listed,
  took 1,023 rounds and 27.6 s."""
  count = 1 + max((max(src, dst) for _, src, dst in pairs), default=0)
  pairs = sorted(pairs, key=lambda p: (p[2] - p[1]) % count)  # stable: then as listed
  sending: dict[int, set[int]] = collections.defaultdict(set)  # process: rounds it sends in
  receiving: dict[int, set[int]] = collections.defaultdict(set)
  # process: the first round it does not send (receive) in; below it, every round is taken
  low_send: dict[int, int] = collections.defaultdict(int)
  low_receive: dict[int, int] = collections.defaultdict(int)
  out: list[list[Pair]] = []
  for pair in pairs:
    _, src, dst = pair
    r = max(low_send[src], low_receive[dst])
    while r in sending[src] or r in receiving[dst]:
      r += 1
    sending[src].add(r)
    receiving[dst].add(r)
    while low_send[src] in sending[src]:
      low_send[src] += 1
    while low_receive[dst] in receiving[dst]:
      low_receive[dst] += 1
    out.extend([] for _ in range(r + 1 - len(out)))
    out[r].append(pair)
  return out


def carry(pairs: list[Pair],
          files: Mapping[str, Mapping[str, Any]],
          me: int,
          path_of: Callable[[str], Path],
          subsets: Mapping[tuple[str, int], Tensors] | None = None,
          disk: Disk | None = None) -> tuple[int, str | None]:
  """Every process, with the same `pairs`: sends the files it is the sender of (read at
  `path_of(file)`), receives the ones it is the receiver of (written there). `subsets`: {(file,
  receiver): tensors}: that receiver gets those tensors of the file alone, written at
  `path_of(file)` + `SUBSET`. Returns (the bytes this process received intact, its first
  problem or None). A process whose read or write fails goes on taking part in every window of
  every round (sending zeros), so that no other process is left waiting in a collective; the
  caller says the problem to all. `disk`: the restore's (`Disk`), else one of its own."""
  if disk is None:
    with Disk() as disk:
      return carry(pairs, files, me, path_of, subsets, disk)
  subsets = subsets or {}
  specs = {(rel, dst): subset_spec(subsets[rel, dst]) if (rel, dst) in subsets else files[rel]
           for rel, _, dst in pairs}
  received, problem = 0, None
  # Two read buffers for the whole carry, faulted in once: the reader fills one while the other
  # is in the collective (`_move` returns once the runtime is done with it).
  bufs = [aligned_empty((WINDOW,), np.uint8) for _ in range(2)] if any(
      src == me for _, src, _ in pairs) else []
  for round_ in rounds(pairs):
    out = [(rel, dst) for rel, src, dst in round_ if src == me]
    into = [rel for rel, _, dst in round_ if dst == me]
    size = max(specs[rel, dst]['size'] for rel, _, dst in round_)
    perm = tuple(sorted((src, dst) for _, src, dst in round_))
    source = target = None
    if out and not disk.stuck:  # a hung disk: nothing more opened, zeros sent
      source = (path_of(out[0][0]), subsets.get(out[0]), specs[out[0]]['size'])
    if into and not disk.stuck:
      path = path_of(into[0])
      target = (layout.subset_of(path) if (into[0], me) in subsets else path, specs[into[0], me])
    failed = _round(perm, size, source, target, bufs, disk)
    if target and not failed and target[0] != path:  # a subset
      failed = subset_in(path)
    problem = problem or failed or disk.stuck
    received += target[1]['size'] if target and not failed else 0
  return received, problem


def tensor_bytes(code: str, shape) -> int:
  """The bytes of a tensor of safetensors dtype `code` and `shape`."""
  return math.prod(shape) * statefile.DTYPES[code].itemsize


def subset_header(tensors: Tensors) -> bytes:
  """The header of a state file holding `tensors` alone, back to back in that order."""
  entries, at = {}, 0
  for name, code, shape, _ in tensors:
    n = tensor_bytes(code, shape)
    entries[name] = {'dtype': code, 'shape': list(shape), 'data_offsets': [at, at + n]}
    at += n
  body = json.dumps({'__metadata__': {'format': 'jaxckpt.subset'}, **entries},
                    separators=(',', ':')).encode()
  body += b' ' * (-len(body) % 8)
  return len(body).to_bytes(8, 'little') + body


def subset_spec(tensors: Tensors) -> dict[str, Any]:
  """{'size', 'crc32'} of the file of `tensors` (`subset_header`): its CRC-32 from the
  header's and each tensor's (the shard table's), without its bytes."""
  header = subset_header(tensors)
  size, crc = len(header), crc32(header)
  for _, code, shape, tensor_crc in tensors:
    n = tensor_bytes(code, shape)
    size, crc = size + n, crc32_combine(crc, int(tensor_crc, 16), n)
  return {'size': size, 'crc32': f'{crc:08x}'}


def segments_of(path: Path, fd: int, tensors: Tensors | None, size: int) -> list:
  """What the sender sends of `path`, as segments: bytes, or (offset, length) in the file: the
  whole file, or `tensors`' header and then each tensor's bytes (as its copy's header places
  them, checked against the shard table's dtype and shape)."""
  if tensors is None:
    return [(0, size)]
  header_len, entries, _ = statefile.read_header(path, fd)
  segments: list = [subset_header(tensors)]
  for name, code, shape, _ in tensors:
    entry = entries.get(name)
    if entry is None or (entry['dtype'], entry['shape']) != (code, list(shape)):
      raise CheckpointError('E-CKPT-012', f'{path}: {name} is not {code}{list(shape)} as the '
                            'shard table says', statefile.DAMAGED)
    b, e = entry['data_offsets']
    segments.append((header_len + b, e - b))
  return segments


def fill_window(fd: int, path: Path, segments: list, view: memoryview, lo: int) -> None:
  """`view` from the bytes `segments` make, from offset `lo` of them on."""
  at = 0  # where the segment starts in the stream
  for seg in segments:
    n = len(seg) if isinstance(seg, bytes) else seg[1]
    a, b = max(lo, at), min(lo + len(view), at + n)
    if a < b:
      part = view[a - lo:b - lo]
      if isinstance(seg, bytes):
        part[:] = seg[a - at:b - at]
      elif pread_into(fd, part, seg[0] + a - at) != b - a:
        raise CheckpointError('E-CKPT-012', f'{path} ends early', 'restart the job')
    at += n


@functools.lru_cache(maxsize=None)
def _mesh():
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  first = {}
  for d in sorted(jax.devices(), key=lambda d: d.id):
    first.setdefault(d.process_index, d)
  mesh = Mesh(np.array([first[k] for k in sorted(first)]), ('peers',))
  return mesh, NamedSharding(mesh, PartitionSpec('peers')), first[jax.process_index()]


@functools.lru_cache(maxsize=64)
def _permute(perm: tuple[tuple[int, int], ...]):
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec  # pylint: disable=import-outside-toplevel
  mesh = _mesh()[0]
  spec = PartitionSpec('peers')
  return jax.jit(
      jax.shard_map(
          lambda x: jax.lax.ppermute(x, 'peers', perm), mesh=mesh, in_specs=spec, out_specs=spec))


def _move(perm, buf: np.ndarray) -> np.ndarray:
  """One window: this process's `buf` to the process `perm` sends it to; what it receives. It
  returns once what it received is on the host (`np.asarray` waits for the collective), so the
  runtime is done with `buf`, which `device_put` may alias on CPU: `_round` refills it then."""
  import jax  # pylint: disable=import-outside-toplevel
  mesh, sharding, mine = _mesh()
  local = jax.device_put(buf, mine)
  x = jax.make_array_from_single_device_arrays((mesh.size * len(buf),), sharding, [local])
  return np.asarray(_permute(perm)(x).addressable_shards[0].data)


def _round(perm, size: int, source: tuple[Path, Tensors | None, int] | None,
           into: tuple[Path, Mapping[str, Any]] | None, bufs: list[np.ndarray],
           disk: Disk) -> str | None:
  """One round's windows: this process sends `source` (path, the tensors of a subset or None
  for the whole file, the bytes sent), receives `into` (path, its {size, crc32}), either, both
  or neither; `size` is the round's largest; `bufs`: the carry's two read buffers. Returns
  this process's problem (None: what it received is in place, checked); it never leaves
  early."""
  count = -(-size // WINDOW)
  zeros = np.zeros(WINDOW, np.uint8)
  problems: list[str] = [disk.stuck] if disk.stuck else []
  fin = None
  segments: list = []

  def read(i: int) -> np.ndarray:
    buf, want = bufs[i % 2], max(0, min(WINDOW, source[2] - i * WINDOW))
    if not want:  # past what this sends, the round's larger file still moving
      return zeros
    fill_window(fin, source[0], segments, memoryview(buf)[:want], i * WINDOW)
    buf[want:] = 0  # the last window's tail: zeros, not the window before's bytes
    return buf

  def said(task: Task) -> Any:  # a task's result, or None with its error kept
    try:
      return disk.result(task)
    except Stuck as e:
      problems.extend([] if str(e) in problems else [str(e)])
    except Exception as e:  # noqa: BLE001 - returned to the caller, said to every process
      problems.append(str(e) if isinstance(e, OSError) else f'{type(e).__name__}: {e}')
    return None

  try:
    fin = os.open(source[0], os.O_RDONLY) if source is not None else None
    segments = segments_of(source[0], fin, source[1], source[2]) if source is not None else []
  except OSError as e:
    problems.append(f'{e.filename}: {e.strerror or e}')
  except CheckpointError as e:
    problems.append(e.line())
  landing = Landing(into[0] if into else None, into[1]['size'] if into else 0, problems)
  reading, writing = f'reading {source[0] if source else ""}', f'writing {landing.tmp}'
  sending = fin is not None and not problems
  ahead = disk.submit(READER, reading, read, 0) if sending else None
  writes = collections.deque()  # at most two windows waiting for the disk
  for i in range(count):
    buf = (said(ahead) if ahead is not None else None)
    buf = zeros if buf is None or problems else buf
    more = sending and not problems and i + 1 < count
    ahead = disk.submit(READER, reading, read, i + 1) if more else None
    got = _move(perm, buf)  # every window, whatever failed here: the others wait for it
    taking = landing.open and not problems
    write = disk.submit(WRITER, writing, landing.write, i * WINDOW, got) if taking else None
    writes.extend([write] if write is not None else [])
    while len(writes) > 2:
      said(writes.popleft())
  for w in writes:
    said(w)
  landing.left = disk.stuck is not None
  try:
    if fin is not None and not disk.stuck:  # a hung disk's file is left open
      os.close(fin)
  except OSError as e:
    problems.append(f'{e.filename}: {e.strerror or e}')
  return landing.finish(into[1]['crc32'] if into else '', 'its manifest')


class Stuck(OSError):
  """A disk task not done after DISK_WAIT_SECS (`Disk`): its message names what and the thread."""


class Task(NamedTuple):
  future: concurrent.futures.Future
  thread: str
  what: str


class Disk:
  """One process's disk work beside the collectives of a restore from the peers (the windows
  read ahead of each collective, and written behind it), a thread for each kind, as a context.
  `result` waits for a task at most DISK_WAIT_SECS: one not done then is stuck, a hung disk or
  mount, and so is this process's disk from then on (`stuck` names what hung): no task runs on
  it, its callers do no more disk work on their own thread either (it would hang there, every
  other process waiting in the next collective) and send zeros to the last window, and leaving
  does not wait for the threads."""

  def __init__(self):
    self.stuck: str | None = None
    self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

  def __enter__(self) -> Disk:
    return self

  def __exit__(self, failed, *_) -> None:
    for pool in self._pools.values():
      pool.shutdown(wait=self.stuck is None and failed is None, cancel_futures=True)

  def submit(self, thread: str, what: str, fn: Callable, *args) -> Task | None:
    """`fn(*args)` on the thread named `thread`, `what` naming it should it hang; None once the
    disk is stuck."""
    if self.stuck is not None:
      return None
    if thread not in self._pools:
      self._pools[thread] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread)
    return Task(self._pools[thread].submit(fn, *args), thread, what)

  def result(self, task: Task) -> Any:
    """`task`'s result (or its exception), once done; Stuck if it is not within DISK_WAIT_SECS
    (none at all, once the disk is stuck)."""
    done, _ = concurrent.futures.wait([task.future],
                                      timeout=0 if self.stuck is not None else DISK_WAIT_SECS)
    if not done:
      task.future.cancel()
      self.stuck = self.stuck or (f'{task.what}: not done after a wait of {DISK_WAIT_SECS:g} s '
                                  f'(thread {task.thread}); a hung disk?')
      raise Stuck(self.stuck)
    return task.future.result()


class Landing:
  """A file received window by window (`write(offset, bytes)`, the writes in order): under a
  temporary name beside `path` (None: this process receives nothing), its CRC-32 computed as it
  comes; `finish` fsyncs it and renames it in only when it is `size` bytes of the CRC-32 it
  should have and no problem was met, else removes it. Problems go to `problems`, shared with
  the caller: a receiver that fails goes on taking part in every window."""

  def __init__(self, path: Path | None, size: int, problems: list[str]):
    self.path, self.size, self.problems = path, size, problems
    self.tmp = None if path is None else path.with_name(path.name + layout.PEER_TMP)
    self.crc = self.wrote = 0
    self.fd = None
    # The disk hung (`Disk`): the file is left as it is, open, its temporary name removed at
    # the next restart (`holdings.tidy`): a stuck write may hold it, and a syscall would hang.
    self.left = False
    try:
      self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT
                        | os.O_TRUNC, 0o644) if self.tmp else None
    except OSError as e:
      problems.append(f'{e.filename}: {e.strerror or e}')

  @property
  def open(self) -> bool:
    return self.fd is not None

  def write(self, offset: int, data: np.ndarray) -> None:
    view = memoryview(data)[:max(0, min(len(data), self.size - offset))]
    done = 0
    while done < len(view):  # a write cut short (a disk nearly full) goes on, or raises
      n = os.pwrite(self.fd, view[done:], offset + done)
      if n <= 0:
        raise OSError(errno.ENOSPC, f'{self.tmp}: a write at {offset + done} wrote nothing')
      done += n
    self.crc, self.wrote = crc32(view, self.crc), self.wrote + done

  def finish(self, crc: str, against: str) -> str | None:
    """After the collectives: the problem (the first one met), or None with the file in. It
    never raises: a process that did would leave the others in the next collective."""
    if self.left:
      return self.problems[0] if self.problems else f'{self.tmp}: left on a hung disk'
    try:
      try:
        if self.fd is not None and not self.problems:
          os.fsync(self.fd)
      finally:
        if self.fd is not None:
          os.close(self.fd)
      if self.path is None or self.problems:
        self._drop()
        return self.problems[0] if self.problems else None
      if f'{self.crc:08x}' != crc or self.wrote != self.size:
        self._drop()
        return (f'{self.path}: {MISMATCH} {against} ({self.wrote} bytes, crc32 {self.crc:08x}; '
                f'{against} says {self.size}, {crc})')
      os.replace(self.tmp, self.path)
      return None
    except OSError as e:
      self._drop()  # a failed fsync or rename leaves nothing half in
      return self.problems[0] if self.problems else f'{e.filename or self.tmp}: {e.strerror or e}'

  def _drop(self) -> None:
    if self.tmp is not None:
      with contextlib.suppress(OSError):  # a disk gone read-only: the next restart removes it
        self.tmp.unlink(missing_ok=True)


def subset_in(path: Path) -> str | None:
  """A subset of the part at `path` is in: a copy of the part beside it is not intact (else it
  would have been read), and goes. The problem, when it cannot."""
  try:
    path.unlink(missing_ok=True)
    return None
  except OSError as e:
    return f'{path}: not intact, and cannot be removed: {e.strerror or e}'


__all__ = [
    'DISK_WAIT_SECS', 'MISMATCH', 'READER', 'SMALL', 'WINDOW', 'WRITER', 'Disk', 'Landing', 'Stuck',
    'carry', 'fill_window', 'rounds', 'segments_of', 'subset_header', 'subset_in', 'subset_spec',
    'tensor_bytes'
]
