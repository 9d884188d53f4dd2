"""Flat safetensors exports: `model.safetensors` and `optimizer.safetensors`.

    write_model('exports/step_00000300/model.safetensors', flat_params, metadata={'step': '300'})
    params, meta = read_model('exports/step_00000300/model.safetensors')

Tensors keep the dotted names they are given (`h.0.attn.c_attn.kernel`), in the given order.
Floating arrays narrower than f32 (bf16, f16) are stored widened to f32, which is exact, so every
torch or numpy loader reads them; their original dtypes are recorded in the metadata under
`jaxckpt.dtypes` (a JSON object) and `read_model` restores them. The optimizer file holds Adam's
first and second moments as `<name>/m` and `<name>/v`.

The file is written by a small streaming writer of the safetensors format (8-byte header length,
JSON header, raw little-endian data) rather than `safetensors.numpy.save_file`, which builds a
second in-memory copy of every tensor first: an export runs beside the staged checkpoint copy
and must not double it. Reading goes through the `safetensors` library.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Mapping

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxckpt.export import atomic_file

DTYPES_KEY = 'jaxckpt.dtypes'

# numpy dtype -> safetensors dtype tag, for what is stored as is.
_TAGS = {
    np.dtype(np.float32): 'F32',
    np.dtype(np.float64): 'F64',
    np.dtype(np.int64): 'I64',
    np.dtype(np.int32): 'I32',
    np.dtype(np.int16): 'I16',
    np.dtype(np.int8): 'I8',
    np.dtype(np.uint64): 'U64',
    np.dtype(np.uint32): 'U32',
    np.dtype(np.uint16): 'U16',
    np.dtype(np.uint8): 'U8',
    np.dtype(np.bool_): 'BOOL'
}


def _is_narrow_float(dtype: np.dtype) -> bool:
  """bf16, f16 and friends: stored as f32 (exactly) because numpy and some loaders lack them."""
  if dtype.kind == 'f':
    return dtype.itemsize < 4
  if dtype.kind != 'V':
    return False
  try:
    ml_dtypes.finfo(dtype)  # bfloat16, float8_*: ml_dtypes floats with numpy kind 'V'
    return True
  except ValueError:
    return False


def _stored_dtype(dtype: np.dtype) -> np.dtype:
  """The little-endian dtype a tensor of `dtype` is written as."""
  if _is_narrow_float(dtype):
    return np.dtype('<f4')
  if dtype.newbyteorder('=') not in _TAGS:
    raise TypeError(f'cannot store dtype {dtype} in safetensors')
  return dtype.newbyteorder('<')


def write_tensors(path: str | os.PathLike,
                  tensors: Mapping[str, np.ndarray],
                  *,
                  metadata: Mapping[str, object] | None = None) -> None:
  """Write `tensors` (in order) to a safetensors file at `path`, durably and atomically.

  Args:
    path: the final file name; written under a temporary sibling name and renamed into place.
    tensors: {name: array}; narrow floats are widened to f32 and recorded under `jaxckpt.dtypes`.
    metadata: extra string metadata (values are converted with `str`); `format: pt` is added
      because torch and transformers loaders insist on it.
  """
  arrays = {name: np.asarray(x) for name, x in tensors.items()}
  widened = {name: x.dtype.name for name, x in arrays.items() if _is_narrow_float(x.dtype)}
  meta = {'format': 'pt', **{k: str(v) for k, v in (metadata or {}).items()}}
  if widened:
    meta[DTYPES_KEY] = json.dumps(widened)
  header = _header(arrays, meta)
  with atomic_file(path) as tmp, open(tmp, 'wb') as f:
    f.write(struct.pack('<Q', len(header)))
    f.write(header)
    for x in arrays.values():
      # One tensor at a time: at most one converted copy alive, none for f32 C-order arrays.
      f.write(np.ascontiguousarray(x, dtype=_stored_dtype(x.dtype)).reshape(-1).view(np.uint8))


def _header(arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
  entries, offset = {'__metadata__': dict(meta)}, 0
  for name, x in arrays.items():
    dtype = _stored_dtype(x.dtype)
    nbytes = x.size * dtype.itemsize
    entries[name] = {
        'dtype': _TAGS[dtype.newbyteorder('=')], 'shape': list(x.shape),
        'data_offsets': [offset, offset + nbytes]
    }
    offset += nbytes
  raw = json.dumps(entries, separators=(',', ':')).encode()
  return raw + b' ' * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, as safetensors does


def read_tensors(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """({name: array} in file order with original dtypes restored, metadata)."""
  with safe_open(os.fspath(path), framework='numpy') as f:
    meta = dict(f.metadata() or {})
    names = f.offset_keys() if hasattr(f, 'offset_keys') else f.keys()
    tensors = {name: f.get_tensor(name) for name in names}
  recorded = recorded_dtypes(meta, {name: x.dtype for name, x in tensors.items()})
  for name, dtype in recorded.items():
    tensors[name] = tensors[name].astype(dtype)
  return tensors, meta


def _narrow_dtype(name: object) -> np.dtype | None:
  """The narrow float (bfloat16, float16, float8_*) `name` names, else None."""
  if not isinstance(name, str):
    return None
  kind = np.float16 if name == 'float16' else getattr(ml_dtypes, name, None)
  try:
    dtype = np.dtype(kind) if isinstance(kind, type) else None
  except TypeError:
    return None
  return dtype if dtype is not None and dtype.name == name and _is_narrow_float(dtype) else None


def recorded_dtypes(meta: Mapping[str, str], stored: Mapping[str, np.dtype]) -> dict[str, np.dtype]:
  """{name: narrow float dtype} of `jaxckpt.dtypes`, checked against the `stored` dtypes.

  The record is trusted no further than what `write_tensors` writes: a narrow float for a tensor
  stored as f32. Anything else (an int8 for an f32 tensor, a name the file lacks, not JSON)
  raises ValueError saying what, so a foreign record never casts weights to something else.
  """
  if DTYPES_KEY not in meta:
    return {}
  try:
    recorded = json.loads(meta[DTYPES_KEY])
  except (ValueError, RecursionError) as e:
    raise ValueError(f'its {DTYPES_KEY} metadata is not JSON ({e})') from None
  if not isinstance(recorded, dict):
    raise ValueError(f'its {DTYPES_KEY} metadata is not a JSON object')
  out = {}
  for name, dtype_name in recorded.items():
    dtype = _narrow_dtype(dtype_name)
    if name not in stored:
      raise ValueError(f'its {DTYPES_KEY} metadata names {name!r}, which it does not hold')
    if dtype is None or np.dtype(stored[name]) != np.dtype(np.float32):
      raise ValueError(f'its {DTYPES_KEY} metadata records {name} ({stored[name]}) as '
                       f'{str(dtype_name)[:40]!r}: only a bf16 or f16 tensor stored as f32 is')
    out[name] = dtype
  return out


def write_model(path: str | os.PathLike,
                params: Mapping[str, np.ndarray],
                *,
                metadata: Mapping[str, object] | None = None) -> None:
  """`model.safetensors`: {dotted name: array}, e.g. from `jaxckpt.model.gpt.flatten_params`."""
  write_tensors(path, params, metadata=metadata)


def read_model(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """({dotted name: array} in written order, with the dtypes given to `write_model`; metadata)."""
  return read_tensors(path)


def optimizer_names(names: Iterable[str]) -> list[str]:
  """The tensor names of `optimizer.safetensors`: `<name>/m`, `<name>/v` for each parameter."""
  return [f'{n}/{s}' for n in names for s in ('m', 'v')]


def write_optimizer(path: str | os.PathLike,
                    m: Mapping[str, np.ndarray],
                    v: Mapping[str, np.ndarray],
                    *,
                    metadata: Mapping[str, object] | None = None) -> None:
  """`optimizer.safetensors`: Adam's moments as `<name>/m` and `<name>/v`, in `m`'s order."""
  if sorted(m) != sorted(v):
    raise ValueError(f'm and v name different parameters: {sorted(set(m) ^ set(v))[:5]}')
  tensors = {}
  for name in m:
    tensors[f'{name}/m'], tensors[f'{name}/v'] = m[name], v[name]
  write_tensors(path, tensors, metadata=metadata)


def read_optimizer(
    path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, str]]:
  """(m, v, metadata) from an `optimizer.safetensors`, keyed by dotted parameter name."""
  tensors, meta = read_tensors(path)
  m = {k[:-2]: x for k, x in tensors.items() if k.endswith('/m')}
  v = {k[:-2]: x for k, x in tensors.items() if k.endswith('/v')}
  return m, v, meta
