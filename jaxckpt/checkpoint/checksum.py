"""CRC-32 (the zlib polynomial) at memory speed.

Every checkpoint byte is checksummed when it is written and again when it is restored or
verified, so the checksum's speed bounds both. zlib's `crc32` runs at ~4 GB/s on one core here: a
third of a second on an andrea_120m state, as long as reading it from disk. ISA-L's
(`isal.isal_zlib.crc32`, the same function computed with carry-less multiplies) runs at ~29 GB/s
and gives the same values, so manifests stay readable with plain zlib. zlib is the fallback on a
platform without an isal wheel.

`crc32_combine(a, b, len_b)` is the CRC of two buffers back to back from the CRCs of each: a file's
CRC follows from its tensors' without reading them twice.
"""

from __future__ import annotations

try:
  from isal.isal_zlib import crc32 as _crc32
  from isal.isal_zlib import crc32_combine as _combine
  IMPLEMENTATION = 'isal'
except ImportError:  # pragma: no cover - isal has wheels for the usual platforms
  from zlib import crc32 as _crc32
  _combine = None
  IMPLEMENTATION = 'zlib'


def crc32(data, value: int = 0) -> int:
  """CRC-32 of `data` (any buffer) continuing from `value`; equal to `zlib.crc32(data, value)`."""
  return _crc32(data, value)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
  """The CRC-32 of A followed by B, from crc32(A), crc32(B) and len(B)."""
  if _combine is not None:
    return _combine(crc_a, crc_b, len_b)
  return _combine_gf2(crc_a, crc_b, len_b)


def _combine_gf2(crc1: int, crc2: int, len2: int) -> int:
  """zlib's crc32_combine: shift crc1 by len2 zero bytes (GF(2) matrix powers), add crc2."""
  if len2 <= 0:
    return crc1

  def times(matrix, vector):
    out, i = 0, 0
    while vector:
      if vector & 1:
        out ^= matrix[i]
      vector >>= 1
      i += 1
    return out

  def square(matrix):
    return [times(matrix, matrix[n]) for n in range(32)]

  odd = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
  even = square(odd)  # two zero bits
  odd = square(even)  # four zero bits
  while True:
    even = square(odd)  # the first pass: one zero byte
    if len2 & 1:
      crc1 = times(even, crc1)
    len2 >>= 1
    if not len2:
      break
    odd = square(even)
    if len2 & 1:
      crc1 = times(odd, crc1)
    len2 >>= 1
    if not len2:
      break
  return crc1 ^ crc2
