"""One safetensors file, local or at an `s3://` or `gs://` URL, read a tensor at a time.

    with tensorfile.File('s3://bucket/gpt2/model.safetensors') as f:
      f.tensors['wte.weight']                  # Tensor(dtype, shape, begin, end)
      arrays = f.read(['wte.weight'])          # one ranged read per run of adjacent tensors

The header is read first (8-byte length, JSON) and nothing in it is trusted: its length is
bounded, every entry has a known dtype, a shape and offsets whose byte length the dtype and
shape give, and the file ends where the last tensor does (as the safetensors library insists).
Every ranged read of an object must report the generation the first one did, so an object
replaced while it is read is refused rather than read half old, half new.

`File.pin()` is what identifies the bytes read: size and sha256 of a local file, size and ETag
on S3, size and generation on GCS (size and sha256 where a store reports no version).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any, Iterable

import ml_dtypes
import numpy as np

from jaxckpt.checkpoint.remote.store import Store, StoreError
from jaxckpt.export.safetensors_io import recorded_dtypes
from jaxckpt.records.provenance import sha256_file

MAX_HEADER = 100 << 20  # the safetensors library's own limit on a header
MAX_JSON = 64 << 20  # an index or config.json larger than this is not one
MAX_READ = 256 << 20  # adjacent tensors are read together up to this many bytes

_DTYPES = {
    'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16,
    'I64': np.int64, 'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U64': np.uint64,
    'U32': np.uint32, 'U16': np.uint16, 'U8': np.uint8, 'BOOL': np.bool_
}


class Unreadable(Exception):
  """A source that cannot be read as weights; the message says why, naming the file."""


# ------------------------------------------------------------------------------- raw bytes
def is_url(location: str) -> bool:
  return location.startswith(('s3://', 'gs://'))


_stores: dict[str, Store] = {}


def _store_key(location: str) -> tuple[Store, str]:
  parent, key = location.rsplit('/', 1)
  if parent not in _stores:
    _stores[parent] = Store(parent)
  return _stores[parent], key


def read_small(location: str) -> bytes | None:
  """A whole small file (an index, a config.json), or None when there is none."""
  try:
    if is_url(location):
      store, key = _store_key(location)
      data = store.read(key)
    else:
      with open(location, 'rb') as f:
        data = f.read(MAX_JSON + 1)
  except FileNotFoundError:
    return None
  except (OSError, StoreError) as e:
    raise Unreadable(f'{location}: {getattr(e, "what", None) or e}') from e
  if data is not None and len(data) > MAX_JSON:
    raise Unreadable(f'{location} is over {MAX_JSON} bytes')
  return data


def exists(location: str) -> bool:
  if not is_url(location):
    return os.path.isfile(location)
  store, key = _store_key(location)
  try:
    store.read_range_version(key, 0, 8)
    return True
  except StoreError as e:
    if e.code in ('E-STORE-011', 'E-STORE-012'):
      return False
    raise Unreadable(f'{location}: {e.what}') from e


# ---------------------------------------------------------------------------- one file
@dataclasses.dataclass(frozen=True)
class Tensor:
  dtype: np.dtype
  shape: tuple[int, ...]
  begin: int  # absolute offsets in the file
  end: int


class File:
  """One safetensors file whose header has been read and checked; `read` reads tensors."""

  def __init__(self, location: str, *, hash_local: bool = True):
    self.location = location
    self._generation = None
    if is_url(location):
      self._store, self._key = _store_key(location)
      self._fd = None
    else:
      try:
        self._fd = os.open(location, os.O_RDONLY)
      except OSError as e:
        raise Unreadable(f'{location}: {e.strerror or e}') from e
    try:
      self._open(hash_local)
    except BaseException:
      self.close()
      raise

  def _open(self, hash_local: bool) -> None:
    local_size = os.fstat(self._fd).st_size if self._fd is not None else None
    head = self._range(0, 8)
    if len(head) < 8:
      raise Unreadable(f'{self.location} is not safetensors: {len(head)} bytes')
    length = int.from_bytes(head, 'little')
    if length > MAX_HEADER:
      raise Unreadable(f'{self.location} is not safetensors: a header of {length} bytes')
    raw = self._range(8, 8 + length)
    if len(raw) < length:
      raise Unreadable(f'{self.location} is not safetensors: its header is cut short')
    self.tensors, self.metadata, data = _parse_header(raw, 8 + length, self.location)
    try:  # the narrow floats jaxckpt stored widened: never a cast to anything else
      self.recorded = recorded_dtypes(self.metadata, {n: t.dtype for n, t in self.tensors.items()})
    except ValueError as e:
      raise Unreadable(f'{self.location} is not safetensors as jaxckpt writes it: {e}') from None
    self.size = 8 + length + data  # what the header says; the file must end there
    if local_size is not None:
      if local_size != self.size:
        raise Unreadable(f'{self.location}: {local_size} bytes, its header says {self.size}')
      self.version = {'sha256': sha256_file(self.location)} if hash_local else {}
      return
    # The last byte must be there and nothing after it: one ranged read says both.
    last = self._range(self.size - 1, None) if self.size > 8 + length else b'\0'
    if len(last) != 1:
      raise Unreadable(f'{self.location}: {self.size - 1 + len(last)} bytes, its header says '
                       f'{self.size}')
    label = self._store.version_label(self._generation)
    if label is not None:
      self.version = {'etag' if self._store.scheme == 's3' else 'generation': label}
      return
    # A store that reports no versions (the GCS emulator): the bytes themselves are the version.
    data = self._store.read(self._key) or b''
    if len(data) != self.size:
      raise Unreadable(f'{self.location} changed while it was read')
    self.version = {'sha256': hashlib.sha256(data).hexdigest()}

  def _range(self, start: int, stop: int | None) -> bytes:
    if self._fd is not None:
      return os.pread(self._fd, (stop if stop is not None else start + 1) - start, start)
    try:
      data, generation = self._store.read_range_version(self._key, start, stop)
    except StoreError as e:
      if e.kind == 'out_of_range':
        raise Unreadable(f'{self.location} is shorter than its header says') from e
      raise Unreadable(f'{self.location}: {e.what}') from e
    if self._generation is not None and generation != self._generation:
      raise Unreadable(f'{self.location} changed while it was read')
    self._generation = generation
    return data

  def pin(self) -> dict[str, Any]:
    return {'path': self.location, 'size': self.size, **self.version}

  def read(self, names: Iterable[str]) -> dict[str, np.ndarray]:
    """{name: array} of the named tensors, adjacent ones in one read; dtypes as recorded."""
    wanted = sorted(set(names), key=lambda n: self.tensors[n].begin)
    out, run = {}, []
    for name in wanted + [None]:
      t = self.tensors.get(name) if name else None
      if run and (t is None or t.begin != self.tensors[run[-1]].end
                  or t.end - self.tensors[run[0]].begin > MAX_READ):
        start, stop = self.tensors[run[0]].begin, self.tensors[run[-1]].end
        data = self._range(start, stop)
        if len(data) != stop - start:
          raise Unreadable(f'{self.location} is shorter than its header says')
        for n in run:
          x = self.tensors[n]
          out[n] = np.frombuffer(data, x.dtype, math.prod(x.shape),
                                 x.begin - start).reshape(x.shape)
        run = []
      if t is not None:
        run.append(name)
    if self._fd is not None and os.fstat(self._fd).st_size != self.size:
      raise Unreadable(f'{self.location} changed while it was read')
    recorded = self.recorded
    return {n: out[n].astype(recorded[n]) if n in recorded else out[n] for n in wanted}

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _parse_header(raw: bytes, data_start: int,
                  where: str) -> tuple[dict[str, Tensor], dict[str, str], int]:
  """(tensors, metadata, data length) of a safetensors header, nothing in it trusted."""

  def unique(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
      raise ValueError(f'a name given twice: {sorted(k for k in keys if keys.count(k) > 1)[0]}')
    return dict(pairs)

  bad = lambda why: Unreadable(f'{where} is not safetensors: {why}')
  try:
    header = json.loads(raw.decode('utf-8'), object_pairs_hook=unique)
  except (UnicodeDecodeError, ValueError) as e:
    raise bad(f'its header is not JSON ({e})') from e
  if not isinstance(header, dict):
    raise bad('its header is not a JSON object')
  meta = header.pop('__metadata__', None) or {}
  if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
    raise bad('__metadata__ is not an object of strings')
  tensors, end = {}, 0
  for name, entry in header.items():
    if not isinstance(entry, dict):
      raise bad(f'{name}: not an object')
    dtype, shape, offsets = entry.get('dtype'), entry.get('shape'), entry.get('data_offsets')
    ints = lambda v, n=None: (
        isinstance(v, list) and (n is None or len(v) == n) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v))
    if dtype not in _DTYPES or not ints(shape) or not ints(offsets, 2):
      raise bad(f'{name}: dtype {dtype!r}, shape {shape!r}, data_offsets {offsets!r}')
    begin, stop = offsets
    itemsize = np.dtype(_DTYPES[dtype]).itemsize
    if stop < begin or stop - begin != math.prod(shape) * itemsize:
      raise bad(f'{name}: {dtype}{shape} is {math.prod(shape) * itemsize} bytes, its offsets '
                f'say {stop - begin}')
    tensors[name] = Tensor(
        np.dtype(_DTYPES[dtype]), tuple(shape), data_start + begin, data_start + stop)
    end = max(end, stop)
  return tensors, meta, end
