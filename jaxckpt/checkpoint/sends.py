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
from .diskwork import READER, WRITER, Disk, Landing
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
    # Each path is found on the disk's thread (a hung disk: nothing more opened, zeros sent).
    found: list[str] = []
    source = target = None
    at = disk.kept(found, READER, f'finding {out[0][0]}', path_of, out[0][0]) if out else None
    if at is not None:
      source = (at, subsets.get(out[0]), specs[out[0]]['size'])
    path = disk.kept(found, WRITER, f'finding {into[0]}', path_of, into[0]) if into else None
    if path is not None:
      target = (layout.subset_of(path) if (into[0], me) in subsets else path, specs[into[0], me])
    failed = _round(perm, size, source, target, bufs, disk)
    if target and not failed and target[0] != path:  # a subset
      failed = disk.kept(found, WRITER, f'removing {path}', subset_in, path)
    problem = problem or (found[0] if found else None) or failed or disk.stuck
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
  fin, segments = None, []

  def read(i: int) -> np.ndarray:
    buf, want = bufs[i % 2], max(0, min(WINDOW, source[2] - i * WINDOW))
    if not want:  # past what this sends, the round's larger file still moving
      return zeros
    fill_window(fin, source[0], segments, memoryview(buf)[:want], i * WINDOW)
    buf[want:] = 0  # the last window's tail: zeros, not the window before's bytes
    return buf

  if source is not None:
    fin, segments = disk.kept(problems, READER, f'opening {source[0]}', opened, *
                              source) or (None, [])
  landing = landed(disk, into[0] if into else None, into[1]['size'] if into else 0, problems)
  reading, writing = f'reading {source[0] if source else ""}', f'writing {landing.tmp}'
  sending = fin is not None and not problems
  ahead = disk.submit(READER, reading, read, 0) if sending else None
  writes = collections.deque()  # at most two windows waiting for the disk
  for i in range(count):
    buf = (disk.taken(problems, ahead) if ahead is not None else None)
    buf = zeros if buf is None or problems else buf
    more = sending and not problems and i + 1 < count
    ahead = disk.submit(READER, reading, read, i + 1) if more else None
    got = _move(perm, buf)  # every window, whatever failed here: the others wait for it
    taking = landing.open and not problems
    write = disk.submit(WRITER, writing, landing.write, i * WINDOW, got) if taking else None
    writes.extend([write] if write is not None else [])
    while len(writes) > 2:
      disk.taken(problems, writes.popleft())
  for w in writes:
    disk.taken(problems, w)
  if fin is not None:  # a hung disk's file is left open
    disk.kept(problems, READER, f'closing {source[0]}', os.close, fin)
  return finished(disk, landing, into[1]['crc32'] if into else '', 'its manifest')


def opened(path: Path, tensors: Tensors | None, size: int) -> tuple[int, list]:
  """(an open descriptor of `path`, the segments of it a sender sends: `segments_of`)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    return fd, segments_of(path, fd, tensors, size)
  except BaseException:
    os.close(fd)
    raise


def landed(disk: Disk, path: Path | None, size: int, problems: list[str]) -> Landing:
  """The `Landing` of a file received at `path`, opened on `disk`'s writer (a hung disk: one that
  receives nothing, its problem said)."""
  if path is None:
    return Landing(None, 0, problems)
  tmp = path.with_name(path.name + layout.PEER_TMP)
  landing = disk.kept(problems, WRITER, f'opening {tmp}', Landing, path, size, problems)
  return landing if landing is not None else Landing(None, 0, problems)


def finished(disk: Disk, landing: Landing, crc: str, against: str) -> str | None:
  """`landing.finish` on `disk`'s writer (its fsync and rename), bounded; with the disk stuck,
  the file is left as it is and the problem said."""
  if disk.stuck is None:  # the fsync flushes what the page cache holds of it: its wait grows
    problem = disk.kept(
        landing.problems,
        WRITER,
        f'syncing {landing.tmp}',
        landing.finish,
        crc,
        against,
        nbytes=landing.wrote)
    if disk.stuck is None:
      return problem or (landing.problems[0] if landing.problems else None)
  landing.left = True
  return landing.finish(crc, against)


def subset_in(path: Path) -> str | None:
  """A subset of the part at `path` is in: a copy of the part beside it is not intact (else it
  would have been read), and goes. The problem, when it cannot."""
  try:
    path.unlink(missing_ok=True)
    return None
  except OSError as e:
    return f'{path}: not intact, and cannot be removed: {e.strerror or e}'


__all__ = [
    'SMALL', 'WINDOW', 'carry', 'finished', 'landed', 'opened', 'fill_window', 'rounds',
    'segments_of', 'subset_header', 'subset_in', 'subset_spec', 'tensor_bytes'
]
