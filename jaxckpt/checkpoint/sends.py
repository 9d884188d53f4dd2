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
A small file goes from one process to all (`broadcast`) with `broadcast_one_to_all`, and so do
the bytes of a part that several processes need alike (`spread`: the whole part, in a
data-parallel job; a subset, such as the step counter of a fully sharded job, which every
process but its owner needs): one collective per window for all of them, compiled once, where
`carry` would take a round per receiver, each a collective compiled for its own pairs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

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
  low: dict[tuple[str, int], int] = collections.defaultdict(int)  # below it, all taken
  out: list[list[Pair]] = []
  for pair in pairs:
    _, src, dst = pair
    r = max(low['s', src], low['r', dst])
    while r in sending[src] or r in receiving[dst]:
      r += 1
    sending[src].add(r)
    receiving[dst].add(r)
    for key, taken in ((('s', src), sending[src]), (('r', dst), receiving[dst])):
      while low[key] in taken:
        low[key] += 1
    out.extend([] for _ in range(r + 1 - len(out)))
    out[r].append(pair)
  return out


def carry(pairs: list[Pair],
          files: Mapping[str, Mapping[str, Any]],
          me: int,
          path_of: Callable[[str], Path],
          subsets: Mapping[tuple[str, int], Tensors] | None = None) -> tuple[int, str | None]:
  """Every process, with the same `pairs`: sends the files it is the sender of (read at
  `path_of(file)`), receives the ones it is the receiver of (written there). `subsets`: {(file,
  receiver): tensors}: that receiver gets those tensors of the file alone, written at
  `path_of(file)` + `SUBSET`. Returns (the bytes this process received intact, its first
  problem or None). A process whose read or write fails goes on taking part in every window of
  every round (sending zeros), so that no other process is left waiting in a collective; the
  caller says the problem to all."""
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
    source = (path_of(out[0][0]), subsets.get(out[0]), specs[out[0]]['size']) if out else None
    target = None
    if into:
      path = path_of(into[0])
      target = (path.with_name(path.name + layout.SUBSET) if
                (into[0], me) in subsets else path, specs[into[0], me])
    failed = _round(perm, size, source, target, bufs)
    if target and not failed and target[0] != path:  # a subset
      failed = _subset_in(path)
    problem = problem or failed
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


def _segments(path: Path, fd: int, tensors: Tensors | None, size: int) -> list:
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


def _fill(fd: int, path: Path, segments: list, view: memoryview, lo: int) -> None:
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
           into: tuple[Path, Mapping[str, Any]] | None, bufs: list[np.ndarray]) -> str | None:
  """One round's windows: this process sends `source` (path, the tensors of a subset or None
  for the whole file, the bytes sent), receives `into` (path, its {size, crc32}), either, both
  or neither; `size` is the round's largest; `bufs`: the carry's two read buffers. Returns
  this process's problem (None: what it received is in place, checked); it never leaves
  early."""
  count = -(-size // WINDOW)
  zeros = np.zeros(WINDOW, np.uint8)
  tmp = None if into is None else into[0].with_name(into[0].name + layout.PEER_TMP)
  crc, wrote, problems = [0], [0], []
  fin = fout = None
  segments: list = []

  def read(i: int) -> np.ndarray:
    buf, want = bufs[i % 2], max(0, min(WINDOW, source[2] - i * WINDOW))
    if not want:  # past what this sends, the round's larger file still moving
      return zeros
    _fill(fin, source[0], segments, memoryview(buf)[:want], i * WINDOW)
    buf[want:] = 0  # the last window's tail: zeros, not the window before's bytes
    return buf

  def write(i: int, data: np.ndarray) -> None:
    n = max(0, min(WINDOW, into[1]['size'] - i * WINDOW))
    view = memoryview(data)[:n]
    os.pwrite(fout, view, i * WINDOW)
    crc[0], wrote[0] = crc32(view, crc[0]), wrote[0] + n

  def said(f) -> Any:  # a task's result, or None with its error kept
    try:
      return f.result()
    except Exception as e:  # noqa: BLE001 - returned to the caller, said to every process
      problems.append(f'{type(e).__name__}: {e}')
      return None

  try:
    fin = os.open(source[0], os.O_RDONLY) if source is not None else None
    segments = _segments(source[0], fin, source[1], source[2]) if source is not None else []
    fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if tmp else None
  except OSError as e:
    problems.append(f'{e.filename}: {e.strerror or e}')
  except CheckpointError as e:
    problems.append(e.line())
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='jaxckpt-send') as reader, \
      concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='jaxckpt-receive') as writer:
    sending = fin is not None and not problems
    ahead = reader.submit(read, 0) if sending else None
    writes = collections.deque()  # at most two windows waiting for the disk
    for i in range(count):
      buf = (said(ahead) if ahead is not None else None)
      buf = zeros if buf is None or problems else buf
      ahead = reader.submit(read, i + 1) if sending and not problems and i + 1 < count else None
      got = _move(perm, buf)  # every window, whatever failed here: the others wait for it
      if fout is not None and not problems:
        writes.append(writer.submit(write, i, got))
        while len(writes) > 2:
          said(writes.popleft())
    for w in writes:
      said(w)
  try:
    if fout is not None:
      if not problems:
        os.fsync(fout)
      os.close(fout)
    if fin is not None:
      os.close(fin)
  except OSError as e:
    problems.append(f'{e.filename}: {e.strerror or e}')
  if into is None or problems:
    if tmp is not None:
      tmp.unlink(missing_ok=True)
    return problems[0] if problems else None
  path, want = into
  if f'{crc[0]:08x}' != want['crc32'] or wrote[0] != want['size']:
    tmp.unlink(missing_ok=True)
    return (f'{path}: what was received does not match its manifest (crc32 {crc[0]:08x}, '
            f'manifest says {want["crc32"]})')
  os.replace(tmp, path)
  return None


def broadcast(source: Path | None, size: int, receive: bool) -> tuple[bytes | None, str | None]:
  """A small file from the process that reads it from `source` to every process (a JAX
  collective, in windows): (its bytes for a receiver, else None; this process's problem or
  None). A source that cannot read sends zeros to the end (the others' CRC checks fail) and says
  why. Every process calls it with the same `size`."""
  got, problem = [], None
  try:
    fin = open(source, 'rb') if source is not None else None  # pylint: disable=consider-using-with
  except OSError as e:
    fin, problem = None, f'{source}: {e.strerror or e}'

  def fill(view: memoryview, _: int) -> None:
    try:
      n = fin.readinto(view)
    except OSError as e:
      raise OSError(f'{source}: {e.strerror or e}') from e
    if n != len(view):
      raise OSError(f'{source} ends early')

  try:
    sent = _broadcast(size, fill if fin is not None else None, source is not None,
                      lambda _, data: got.append(data.tobytes()))
    problem = problem or sent
  finally:
    if fin is not None:
      fin.close()
  return (b''.join(got) if receive else None), problem


def spread(source: Path | None,
           tensors: Tensors | None,
           into: Path | None,
           whole: Mapping[str, Any] | None = None) -> tuple[int, str | None]:
  """The same bytes of a part from its sender to every process at once, window by window, in one
  collective each (a broadcast): where several processes need the same bytes of one part (its
  few replicated tensors in a fully sharded job: every process but its owner; the whole part in
  a data-parallel one), one collective per window, compiled once, instead of a round of `carry`
  per receiver, each compiled for its own pairs. `source`: the sender's copy of the part;
  `tensors`: those of a subset, which a receiver gets as `<part>.subset` checked against
  `subset_spec(tensors)`, or None for the whole part, which it gets at `into` checked against
  `whole` (its {size, crc32} in the manifest); `into`: the part's path on a receiver. Every
  process calls it with the same `tensors` and `whole`. Returns (the bytes this process
  received intact, its problem or None)."""
  spec = subset_spec(tensors) if tensors is not None else whole
  fd, problems = None, []
  try:
    fd = os.open(source, os.O_RDONLY) if source is not None else None
    segments = _segments(source, fd, tensors, spec['size']) if fd is not None else []
  except OSError as e:
    problems.append(f'{e.filename}: {e.strerror or e}')
  except CheckpointError as e:
    problems.append(e.line())
  target = into if into is None or tensors is None else into.with_name(into.name + layout.SUBSET)
  tmp = None if target is None else target.with_name(target.name + layout.PEER_TMP)
  crc, fout = 0, None
  try:
    fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if tmp else None
  except OSError as e:
    problems.append(f'{e.filename}: {e.strerror or e}')

  def keep(lo: int, data: np.ndarray) -> None:
    # A write that fails is kept as this process's problem: it goes on taking every window.
    nonlocal crc
    if fout is not None and not problems:
      try:
        os.pwrite(fout, data, lo)
        crc = crc32(data, crc)
      except OSError as e:
        problems.append(f'{tmp}: {e.strerror or e}')

  sent = _broadcast(spec['size'], (lambda view, lo: _fill(fd, source, segments, view, lo))
                    if fd is not None and not problems else None, source is not None, keep)
  problems += [sent] if sent and source is not None else []
  try:  # after the collectives: what fails here is said, never raised
    try:
      if fout is not None and not problems:
        os.fsync(fout)
    finally:
      for f in (fd, fout):
        if f is not None:
          os.close(f)
    if target is None or problems:
      if tmp is not None:
        tmp.unlink(missing_ok=True)
      return 0, problems[0] if problems else None
    if f'{crc:08x}' != spec['crc32']:
      tmp.unlink(missing_ok=True)
      return 0, (f'{target}: what was received does not match the '
                 f'{"shard table" if tensors else "manifest"} (crc32 {crc:08x}, expected '
                 f'{spec["crc32"]})')
    os.replace(tmp, target)
  except OSError as e:
    return 0, problems[0] if problems else f'{e.filename or tmp}: {e.strerror or e}'
  return spec['size'], _subset_in(into) if tensors is not None else None


def _subset_in(path: Path) -> str | None:
  """A subset of the part at `path` is in: a copy of the part beside it is not intact (else it
  would have been read), and goes. The problem, when it cannot."""
  try:
    path.unlink(missing_ok=True)
    return None
  except OSError as e:
    return f'{path}: not intact, and cannot be removed: {e.strerror or e}'


def _broadcast(size: int, fill: Callable[[memoryview, int], None] | None, is_source: bool,
               keep: Callable[[int, np.ndarray], None]) -> str | None:
  """`size` bytes from the process where `is_source` to every process, a window at a time
  (`multihost_utils.broadcast_one_to_all`): the source's `fill(view, offset)` makes each window;
  every process's `keep(offset, bytes)` takes it. A `fill` that fails (or none, on the source)
  sends zeros to the end: every process takes part in every window. The source's problem, or
  None."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  window = SMALL if size <= SMALL else WINDOW
  problem = None if fill is not None or not is_source else 'nothing to send'
  buf = np.zeros(window, np.uint8)
  for lo in range(0, size, window):
    n = min(window, size - lo)
    buf[:] = 0
    try:  # a read that fails sends zeros: the receivers' checks fail, none left waiting
      if fill is not None and problem is None:
        fill(memoryview(buf)[:n], lo)
    except (OSError, CheckpointError) as e:
      problem, buf[:] = (e.line() if isinstance(e, CheckpointError) else str(e)), 0
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=is_source))
    keep(lo, out[:n])
  return problem


__all__ = [
    'SMALL', 'WINDOW', 'broadcast', 'carry', 'rounds', 'spread', 'subset_header', 'subset_spec',
    'tensor_bytes'
]
