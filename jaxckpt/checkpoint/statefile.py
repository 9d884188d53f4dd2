"""The checkpoint's state file: a standard safetensors file, written at disk speed.

    state/process_0.safetensors
      [8-byte little-endian header length N][N bytes of JSON header, space-padded][data]

Any safetensors reader loads it (`safetensors.torch.load_file`, `safetensors.numpy.load_file`):
tensor names are the state's leaf names (`params/h/0/attn/c_attn/kernel`,
`opt_state/1/0/mu/...`), dtypes and shapes as saved, and the tensors lie back to back with no
hole, as the reference parser demands. What makes it fast:

- the header is padded with spaces so that the data starts at a 4 KiB-aligned file offset;
- tensors whose size is a multiple of 64 bytes come first, then the rest by item size, largest
  first: every tensor starts at a multiple of its own item size, and nearly all (every large one
  of a GPT) at a multiple of 64 bytes, so a view of the read buffer is a properly aligned array;
- the data region is staged contiguously in one page-aligned host buffer (`staging`) and written
  with O_DIRECT in 64 MiB chunks; the last chunk is zero-padded to 4 KiB and the file is cut to
  its exact length at the end;
- each tensor's CRC-32 is computed while the chunks are in flight, and the file's from them
  (`crc32_combine`): one pass over the data. The header, written last, carries the per-tensor
  CRCs as strings in `__metadata__` (`crc32/<name>`), so the file describes itself; the manifest
  has them too.

Reads mirror it: reader threads fill page-aligned buffers with O_DIRECT, a window of at most
256 MiB of tensors at a time (a larger tensor is one of its own) and the next one in flight,
while this thread checks CRCs and hands finished tensors, as views, to `place`: a restore onto
an accelerator holds two windows of host memory, not the state (beside a compile too: the
reader's thread places them). A header that lies (about
offsets, shapes, dtypes or its own length), a truncated or padded file, or a hole between
tensors is a one-line `E-CKPT-012` naming the file; nothing is read out of bounds.
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

import ml_dtypes
import numpy as np

from .checksum import crc32, crc32_combine
from .directio import ALIGN, aligned_empty, open_direct, padded, pread_into, pwrite_all
from .errors import ArgumentError, CheckpointError

FORMAT = 'jaxckpt.safetensors'
SUFFIX = '.safetensors'
MAX_HEADER = 100_000_000  # the reference implementation's limit
_CHUNK = 64 << 20
_WINDOW = 256 << 20  # a run is read this much at a time: a restore's host buffers stay bounded
_READERS = 4  # mostly in the kernel (faulting pages in, waiting on the disk): a few beyond 2 cores
_UNSET = '00000000'
_ALIGN_TO = 64
DAMAGED = _DAMAGED = 'the state file is damaged; resume from an earlier checkpoint'

CODES = {
    'float64': 'F64', 'float32': 'F32', 'float16': 'F16', 'bfloat16': 'BF16', 'int64': 'I64',
    'int32': 'I32', 'int16': 'I16', 'int8': 'I8', 'uint64': 'U64', 'uint32': 'U32', 'uint16': 'U16',
    'uint8': 'U8', 'bool': 'BOOL', 'float8_e4m3fn': 'F8_E4M3', 'float8_e5m2': 'F8_E5M2'
}
DTYPES = {code: np.dtype(getattr(ml_dtypes, name, None) or name) for name, code in CODES.items()}


def file_name(process: int = 0) -> str:
  return f'process_{process}{SUFFIX}'


def find(directory: Path) -> Path:
  """The one state file of a single-process checkpoint's `state/` directory."""
  found = sorted(Path(directory).glob(f'*{SUFFIX}'))
  if len(found) != 1:
    raise CheckpointError('E-CKPT-012', f'{directory}: expected one {SUFFIX} state file, found '
                          f'{len(found)}', _DAMAGED)
  return found[0]


@functools.lru_cache(maxsize=16)
def _plan(key: tuple[tuple[str, tuple[int, ...], np.dtype], ...]) -> 'Plan':
  # Tensors whose size is a multiple of 64 bytes first (all of a GPT's large ones): each then
  # starts 64-byte aligned, as zero-copy placement on a device wants. The rest by item size,
  # largest first: every tensor starts at a multiple of its own item size, with no hole.
  nbytes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in key]
  order = sorted(range(len(key)), key=lambda i: (nbytes[i] % _ALIGN_TO != 0, -key[i][2].itemsize))
  offsets, at = {}, 0
  for i in order:
    offsets[key[i][0]] = (at, at + nbytes[i])
    at += nbytes[i]
  names = tuple(key[i][0] for i in order)
  tensors = {  # a dtype without a code (staging for orbax) is never written: its name stands in
      name: {
          'dtype': CODES.get(dtype.name, dtype.name), 'shape': list(shape),
          'data_offsets': list(offsets[name])
      } for name, shape, dtype in (key[i] for i in order)
  }
  probe = _header_json(tensors, {n: _UNSET for n in names}, _UNSET)
  header_len = -(-(8 + len(probe)) // ALIGN) * ALIGN  # data starts 4 KiB-aligned
  return Plan(names, offsets, {n: d for n, _, d in key}, {n: s for n, s, _ in key}, at, header_len,
              tensors)


class Plan:
  """Where each tensor goes in the file: names in file order, data offsets, header length."""

  def __init__(self, names, offsets, dtypes, shapes, data_len, header_len, tensors, extra=None):
    self.names, self.offsets, self.dtypes, self.shapes = names, offsets, dtypes, shapes
    self.data_len, self.header_len, self.tensors = data_len, header_len, tensors
    self.extra = extra or {}  # more `__metadata__` strings (a shard's place in its array)

  def with_metadata(self, extra: Mapping[str, str]) -> 'Plan':
    """The same data layout, its header carrying `extra` too (and as long as that needs)."""
    probe = _header_json(self.tensors, {n: _UNSET for n in self.names}, _UNSET, extra)
    return Plan(self.names, self.offsets, self.dtypes, self.shapes, self.data_len,
                -(-(8 + len(probe)) // ALIGN) * ALIGN, self.tensors, extra)

  def header(self, crcs: Mapping[str, str], data_crc: str) -> bytes:
    """The first `header_len` bytes of the file: length, JSON, spaces."""
    text = _header_json(self.tensors, crcs, data_crc, self.extra)
    out = bytearray(b' ' * self.header_len)
    out[:8] = (self.header_len - 8).to_bytes(8, 'little')
    out[8:8 + len(text)] = text
    return bytes(out)


def plan(arrays: Mapping[str, Any], *, any_dtype: bool = False) -> Plan:
  """The file layout of `arrays` (anything with `shape` and `dtype`); cached per layout.

  A dtype safetensors has no code for (complex, int4) is E-CKPT-013, unless `any_dtype`: the
  layout of a staging buffer that orbax writes from (`staging.HostStager`), never of a file
  (`write` plans again, and refuses it).
  """
  key = []
  for name, x in arrays.items():
    dtype = np.dtype(x.dtype)
    if dtype.name not in CODES and not any_dtype:
      raise _uncoded(name, dtype)
    key.append((name, tuple(int(d) for d in np.shape(x)), dtype))
  return _plan(tuple(key))


def check_dtypes(arrays: Mapping[str, Any]) -> None:
  """E-CKPT-013 naming a leaf of `arrays` whose dtype safetensors has no code for, `plan`'s
  refusal without its cost: each distinct dtype is looked at once (a GPT's 449 leaves: 0.04 ms,
  where a plan takes 1.4 ms)."""
  for dtype in {x.dtype for x in arrays.values()}:
    if np.dtype(dtype).name not in CODES:
      raise _uncoded(next(n for n, x in arrays.items() if x.dtype == dtype), np.dtype(dtype))


def _uncoded(name: str, dtype: np.dtype) -> ArgumentError:
  return ArgumentError('E-CKPT-013', f'{name}: dtype {dtype} has no safetensors code',
                       "save it as another dtype, or use storage='orbax'")


def _header_json(tensors: Mapping[str, Any],
                 crcs: Mapping[str, str],
                 data_crc: str,
                 extra: Mapping[str, str] | None = None) -> bytes:
  meta = {'format': FORMAT, 'data_crc32': data_crc, **{f'crc32/{n}': c for n, c in crcs.items()}}
  meta.update(extra or {})
  return json.dumps({'__metadata__': meta, **tensors}, separators=(',', ':')).encode()


def write(
    directory: Path,
    arrays: Mapping[str, np.ndarray],
    *,
    region: np.ndarray | None = None,
    name: str = file_name(0),
    metadata: Mapping[str, str] | None = None,
    on_header: Callable[[bytes], Any] = lambda header: None
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
  """Write `arrays` as one safetensors file under `directory`, durably.

  `region` is the staging buffer `arrays` are views of, laid out by `plan(arrays)` (see
  `staging.HostStager`): it is written as it is. Without it the tensors are gathered into
  aligned bounce buffers as they are written. `metadata` adds strings to the header's
  `__metadata__`. Returns ({file name: {size, crc32}}, {tensor name: crc32}); `on_header` is
  handed the header's bytes once the file is durable (the file is them and the data).
  """
  p = plan(arrays)
  if metadata:
    p = p.with_metadata(metadata)
  directory.mkdir(parents=True, exist_ok=True)
  fd, _ = open_direct(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  crcs: dict[str, str] = {}
  data_crc = 0
  try:
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix='jaxckpt-write') as pool:
      pending = []
      if region is not None:
        view = memoryview(region)[:padded(p.data_len)]
        pending = [
            pool.submit(pwrite_all, fd, view[lo:lo + _CHUNK], p.header_len + lo)
            for lo in range(0, len(view), _CHUNK)
        ]
        for n in p.names:  # overlaps the writes just submitted
          b, e = p.offsets[n]
          data_crc = _add(crcs, n, view[b:e], data_crc)
      else:
        data_crc = _write_gathered(pool, fd, p, arrays, crcs)
      for f in pending:
        f.result()
    header = aligned_empty((p.header_len,), np.uint8)
    header[:] = np.frombuffer(p.header(crcs, f'{data_crc:08x}'), np.uint8)
    pwrite_all(fd, memoryview(header), 0)  # last: the data it describes is written
    os.ftruncate(fd, p.header_len + p.data_len)  # the padding of the last chunk goes
    os.fsync(fd)
  finally:
    os.close(fd)
  file_crc = crc32_combine(crc32(header), data_crc, p.data_len)
  on_header(header.tobytes())
  return {name: {'size': p.header_len + p.data_len, 'crc32': f'{file_crc:08x}'}}, crcs


def _add(crcs: dict[str, str], name: str, data, data_crc: int) -> int:
  crc = crc32(data)
  crcs[name] = f'{crc:08x}'
  return crc32_combine(data_crc, crc, len(data))


def _write_gathered(pool, fd: int, p: Plan, arrays: Mapping[str, Any], crcs) -> int:
  """Copy the tensors, in file order, into two alternating aligned chunk buffers and write each
  when it is full: O_DIRECT from arrays that are neither aligned nor contiguous in memory."""
  buffers = [aligned_empty((_CHUNK,), np.uint8) for _ in range(2)]
  busy: list[concurrent.futures.Future | None] = [None, None]
  which, fill, written, data_crc = 0, 0, 0, 0

  def flush(size: int) -> None:
    nonlocal which, fill, written
    busy[which] = pool.submit(pwrite_all, fd,
                              memoryview(buffers[which])[:padded(size)], p.header_len + written)
    written += size
    which, fill = 1 - which, 0
    if busy[which] is not None:
      busy[which].result()  # the other buffer's write is done before it is refilled
    buffers[which][:] = 0

  for n in p.names:
    src = memoryview(np.ascontiguousarray(arrays[n]).reshape(-1).view(np.uint8))
    data_crc = _add(crcs, n, src, data_crc)
    while src:
      take = min(len(src), _CHUNK - fill)
      buffers[which][fill:fill + take] = np.frombuffer(src[:take], np.uint8)
      fill, src = fill + take, src[take:]
      if fill == _CHUNK:
        flush(_CHUNK)
  if fill:
    flush(fill)
  for f in busy:
    if f is not None:
      f.result()
  return data_crc


# ------------------------------------------------------------------------------------ reading
def read_header(path: Path, fd: int | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
  """(header length including its 8-byte size, {name: entry} in file order, metadata) of a
  safetensors file, checked as the reference parser checks it."""
  own = fd is None
  fd = os.open(path, os.O_RDONLY) if own else fd
  try:
    size = os.fstat(fd).st_size
    first = os.pread(fd, 8, 0)
    if len(first) < 8:
      _damaged(path, f'{size} bytes: shorter than a safetensors header')
    n = int.from_bytes(first, 'little')
    if n > MAX_HEADER or 8 + n > size:
      _damaged(
          path, f'header length {n:,} is beyond the file ({size:,} bytes) or the '
          f'{MAX_HEADER:,}-byte limit')
    raw = os.pread(fd, n, 8)
  finally:
    if own:
      os.close(fd)
  try:
    header = json.loads(raw.decode('utf-8'), object_pairs_hook=_no_duplicates)
    if not raw.startswith(b'{') or not isinstance(header, dict):
      raise ValueError('not a JSON object')
  except (UnicodeDecodeError, ValueError, RecursionError) as e:  # deep JSON: RecursionError
    _damaged(path, f'header is not valid JSON ({e})')
  meta = header.pop('__metadata__', None) or {}
  if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
    _damaged(path, '__metadata__ is not a map of strings')
  entries = sorted(((k, v) for k, v in header.items()), key=lambda kv: _offsets(path, *kv)[0])
  end = 0
  for name, entry in entries:
    b, e = _offsets(path, name, entry)
    shape = entry.get('shape')
    if entry.get('dtype') not in DTYPES or not isinstance(shape, list) or not all(
        isinstance(d, int) and d >= 0 for d in shape):
      _damaged(path, f'{name}: dtype {entry.get("dtype")!r} or shape {shape!r} is not valid')
    if e - b != math.prod(shape) * DTYPES[entry['dtype']].itemsize:
      _damaged(path, f'{name}: data_offsets [{b}, {e}] do not hold {entry["dtype"]}{shape}')
    if b != end:
      _damaged(
          path, f'{name}: starts at {b}, not where the tensor before it ends ({end}): a '
          'hole or an overlap')
    end = e
  if 8 + n + end != size:
    _damaged(path, f'{size:,} bytes, but its header describes {8 + n + end:,}: truncated or '
             'padded')
  return 8 + n, dict(entries), meta


def _no_duplicates(pairs):
  keys = [k for k, _ in pairs]
  if len(keys) != len(set(keys)):
    raise ValueError(f'duplicate names {sorted({k for k in keys if keys.count(k) > 1})[:3]}')
  return dict(pairs)


def _offsets(path: Path, name: str, entry: Any) -> tuple[int, int]:
  offsets = entry.get('data_offsets') if isinstance(entry, dict) else None
  if not (isinstance(offsets, list) and len(offsets) == 2
          and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
    _damaged(path, f'{name}: data_offsets {offsets!r} are not [begin, end]')
  return offsets[0], offsets[1]


def _damaged(path: Path, what: str):
  raise CheckpointError('E-CKPT-012', f'{path}: {what}', _DAMAGED)


def read(
    directory: Path,
    names=None,
    *,
    expect_crc32: str | None = None,
    tensor_crc32: Mapping[str, str] | None = None,
    checksums: bool = True,
    direct: bool = True,
    place: Callable[[dict[str, np.ndarray]], Mapping[str, Any]] | None = None) -> dict[str, Any]:
  """The tensors (all, or `names`) of the state file in `directory`, as host arrays (views of
  page-aligned read buffers) or as whatever `place` makes of each finished batch of them.

  All tensors: the whole file's CRC is checked against `expect_crc32` (the manifest's) as the
  chunks land. A subset: each tensor against its CRC in `tensor_crc32` (the manifest's), else in
  the header. `checksums=False` checks none; `direct=False` reads through the page cache.
  """
  path = find(directory)
  fd = os.open(path, os.O_RDONLY)
  try:
    header_len, entries, meta = read_header(path, fd)
  finally:
    os.close(fd)
  asked = set(entries) if names is None else set(names)
  wanted = [n for n in entries if n in asked]  # file order
  missing = asked - set(entries)
  if missing:
    _damaged(path, f'tensors listed in the manifest are not in the file: {sorted(missing)[:3]}')
  whole = checksums and len(wanted) == len(entries) and expect_crc32 is not None
  expect = {
      n: ((tensor_crc32 or {}).get(n) or meta.get(f'crc32/{n}')) if checksums else None
      for n in wanted
  }
  fd, direct = open_direct(path, os.O_RDONLY) if direct else (os.open(path, os.O_RDONLY), False)
  out: dict[str, Any] = {}
  try:
    crc = crc32(_read_exact(fd, header_len, 0)) if whole else 0
    with concurrent.futures.ThreadPoolExecutor(_READERS, thread_name_prefix='jaxckpt-read') as pool:
      # A window is taken while the next one is read: two windows' buffers at most are held
      # here, whatever the state's size (on the CPU they become the arrays).
      windows = collections.deque(_windows(entries, wanted))
      ahead = collections.deque(
          [_submit(pool, fd, header_len, entries, windows.popleft())] if windows else [])
      while ahead:
        submitted = ahead.popleft()
        if windows:
          ahead.append(_submit(pool, fd, header_len, entries, windows.popleft()))
        crc = _take(path, header_len, entries, submitted, crc, whole, expect, place, out)
  finally:
    os.close(fd)
  if whole and f'{crc:08x}' != expect_crc32:
    _mismatch(path, f'crc32 {crc:08x}, manifest says {expect_crc32}')
  return out


def _read_exact(fd: int, n: int, offset: int) -> bytes:
  buf = aligned_empty((padded(n),), np.uint8, populate=False)
  pread_into(fd, memoryview(buf), offset)
  return bytes(buf[:n])


def _windows(entries: Mapping[str, Any], wanted: list[str]) -> list[list[str]]:
  """`wanted` (in file order) cut into windows: tensors back to back in the file, at most
  `_WINDOW` bytes of them (a larger tensor is a window of its own)."""
  windows: list[list[str]] = []
  end = size = -1
  for name in wanted:
    b, e = entries[name]['data_offsets']
    if b != end or size + e - b > _WINDOW:
      windows.append([])
      size = 0
    windows[-1].append(name)
    size, end = size + e - b, e
  return windows


def _submit(pool, fd, header_len, entries, window):
  """Start reading `window` into a page-aligned buffer of its own, a chunk per reader."""
  start = header_len + entries[window[0]]['data_offsets'][0]
  lo = start // ALIGN * ALIGN  # O_DIRECT reads whole aligned blocks
  stop = header_len + entries[window[-1]]['data_offsets'][1]
  buf = aligned_empty((padded(stop - lo),), np.uint8, populate=False)
  view = memoryview(buf)
  ats = range(0, len(view) or 1, _CHUNK)  # a window of empty tensors: one read, of nothing
  jobs = [(at, pool.submit(pread_into, fd, view[at:at + _CHUNK], lo + at)) for at in ats]
  return window, start, stop, lo, buf, jobs


def _take(path, header_len, entries, submitted, crc, whole, expect, place, out) -> int:
  """Check and place one window's tensors, each as soon as the chunks it lies in have landed."""
  window, start, stop, lo, buf, jobs = submitted
  view = memoryview(buf)
  pending, done = collections.deque(window), 0  # a list's pop(0) is quadratic in tensors
  for at, job in jobs:
    got = job.result()
    done = at + got
    if whole:
      crc = crc32(view[max(at, start - lo):min(done, stop - lo)], crc)
    ready = []
    while pending and header_len + entries[pending[0]]['data_offsets'][1] - lo <= done:
      ready.append(pending.popleft())
    if ready:
      arrays = {}
      for name in ready:
        entry = entries[name]
        b, e = (header_len + o - lo for o in entry['data_offsets'])
        arrays[name] = buf[b:e].view(DTYPES[entry['dtype']]).reshape(entry['shape'])
        if not whole and expect[name] is not None:
          got_crc = f'{crc32(view[b:e]):08x}'
          if got_crc != expect[name]:
            _mismatch(path, f'{name}: crc32 {got_crc}, manifest says {expect[name]}')
      out.update(arrays if place is None else place(arrays))
  if pending:
    _damaged(path, f'ends before {pending[0]}')
  return crc


def _mismatch(path: Path, what: str):
  raise CheckpointError('E-CKPT-003', f'{path}: checksum mismatch ({what})',
                        'resume from an earlier checkpoint')
