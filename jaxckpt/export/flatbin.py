"""The raw ANDREA checkpoint `step_NNNNNN.bin`.

Layout, all little-endian, 8 + 12n bytes for n parameters:

    int32 step
    int32 n_params
    f32[n]  weights   every tensor flattened (C order), concatenated in canonical order
    f32[n]  Adam m    same order
    f32[n]  Adam v    same order

The canonical order is `jaxckpt.model.gpt.parameter_names(config.model)`: token and position
embeddings, then per layer attention and MLP, then the final LayerNorm and the output head.
There are no names or shapes in the file, so reading it takes the model's shapes, and a file
whose size is not 8 + 12n for them is refused (`E-BIN-001`). Writing streams the header and then
each tensor's bytes; it never builds the 12n-byte image in memory.

    write_bin(f'exports/{bin_name(300)}', 300, params, m, v)
    step, params, m, v = read_bin('exports/step_000300.bin', model_lib.param_shapes(config.model))
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Mapping

import numpy as np

from jaxckpt.errors import CheckpointError, ResumeError
from jaxckpt.export import atomic_file

HEADER = struct.Struct('<ii')  # step, n_params
INT32_MAX = 2**31 - 1
_F32 = np.dtype('<f4')
SECTIONS = ('weights', 'm', 'v')


def bin_name(step: int) -> str:
  """`step_000300.bin`: six digits, more when the step needs them."""
  return f'step_{step:06d}.bin'


def expected_size(n_params: int) -> int:
  return HEADER.size + 3 * 4 * n_params


def offsets(shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, int, int]]:
  """[(name, offset, count)] of each tensor inside a section, in elements.

  The byte offset of tensor `name` in section s (0 weights, 1 m, 2 v) is
  `8 + 4 * (s * n_params + offset)`.
  """
  out, offset = [], 0
  for name, shape in shapes.items():
    count = math.prod(shape)
    out.append((name, offset, count))
    offset += count
  return out


def write_bin(path: str | os.PathLike, step: int, params: Mapping[str, np.ndarray],
              m: Mapping[str, np.ndarray], v: Mapping[str, np.ndarray]) -> None:
  """Write `step_NNNNNN.bin` durably and atomically.

  Args:
    path: the final file name (see `bin_name`).
    step: the step the state belongs to (int32).
    params: {dotted name: array} in canonical order (`jaxckpt.model.gpt.flatten_params` gives it).
    m, v: Adam's first and second moments with the same names and shapes; written in `params`'
      order whatever their own.

  Raises:
    CheckpointError (E-BIN-002): the step or parameter count does not fit the int32 header.
  """
  if sorted(m) != sorted(params) or sorted(v) != sorted(params):
    raise ValueError('m and v must name exactly the parameters: '
                     f'{sorted((set(m) | set(v)) ^ set(params))[:5]}')
  n = sum(math.prod(np.shape(x)) for x in params.values())
  if n > INT32_MAX or not 0 <= step <= INT32_MAX:
    raise CheckpointError(
        'E-BIN-002', f'the .bin header is int32 and cannot hold step={step}, '
        f'n_params={n:,} (max {INT32_MAX:,})', 'export this model as safetensors instead')
  with atomic_file(path) as tmp, open(tmp, 'wb') as f:
    f.write(HEADER.pack(step, n))
    for section in (params, m, v):
      for name, x in params.items():
        f.write(_f32_bytes(section[name], np.shape(x), name))


def _f32_bytes(x, shape, name) -> np.ndarray:
  """One tensor as contiguous little-endian f32 bytes (a copy only when it is not already)."""
  x = np.asarray(x)
  if x.shape != tuple(shape):
    raise ValueError(f"{name}: shape {x.shape} differs from the parameter's {tuple(shape)}")
  return np.ascontiguousarray(x, dtype=_F32).reshape(-1).view(np.uint8)


def read_bin(
    path: str | os.PathLike, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[int, dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
  """(step, params, m, v) from a `.bin`; each a {name: f32 array} in the order of `shapes`.

  Args:
    path: the `.bin` file.
    shapes: {dotted name: shape} in canonical order (`model_lib.param_shapes(config.model)`).

  Raises:
    ResumeError (E-BIN-001): the file's size or header does not fit these shapes, or its header
      step is negative.
    ResumeError (E-BIN-003): the file cannot be read.
  """
  path = Path(path)
  n = sum(math.prod(s) for s in shapes.values())
  try:
    size = path.stat().st_size
  except OSError as e:
    raise ResumeError('E-BIN-003', f'cannot read {path}: {e.strerror or e}',
                      'check the path of the .bin file') from e
  if size != expected_size(n):
    raise ResumeError(
        'E-BIN-001', f'{path} is {size:,} bytes but this model ({n:,} parameters) '
        f'needs 8 + 12*{n:,} = {expected_size(n):,} bytes',
        'read it with the model config that wrote it')
  try:
    with open(path, 'rb') as f:
      step, header_n = HEADER.unpack(f.read(HEADER.size))
      if header_n != n:
        raise ResumeError(
            'E-BIN-001', f'{path} header says n_params={header_n:,} but this model '
            f'has {n:,} (expected size {expected_size(n):,} bytes, actual {size:,})',
            'read it with the model config that wrote it')
      if step < 0:  # write_bin refuses one: not a .bin it wrote
        raise ResumeError('E-BIN-001',
                          f'{path} header says step={step:,}: a step is never negative',
                          'the file is not a .bin jaxckpt wrote; export or resume from another')
      flat = [np.fromfile(f, dtype=_F32, count=n).astype(np.float32, copy=False) for _ in SECTIONS]
  except OSError as e:  # no read permission, a failing disk
    raise ResumeError('E-BIN-003', f'cannot read {path}: {e.strerror or e}',
                      'check the path of the .bin file') from e
  return (step, *(_split(section, shapes) for section in flat))


def _split(flat: np.ndarray, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
  return {name: flat[off:off + count].reshape(shapes[name]) for name, off, count in offsets(shapes)}
