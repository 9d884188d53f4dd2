"""CRC-32 (the zlib polynomial) at memory speed.

Every checkpoint byte is checksummed when it is written and again when it is restored or
verified, so the checksum's speed bounds both. zlib's `crc32` runs at ~4 GB/s on one core here: a
third of a second on an andrea_120m state, as long as reading it from disk. ISA-L's
(`isal.isal_zlib.crc32`, the same function computed with carry-less multiplies) runs at ~29 GB/s
and gives the same values, so manifests stay readable with plain zlib.

`crc32_combine(a, b, len_b)` is the CRC of two buffers back to back from the CRCs of each: a file's
CRC follows from its tensors' without reading them twice. isal is a required dependency (it has
wheels for the usual platforms): a pure-Python combine would hold the GIL for every tensor.
"""

from __future__ import annotations

from isal.isal_zlib import crc32 as _crc32
from isal.isal_zlib import crc32_combine as _combine


def crc32(data, value: int = 0) -> int:
  """CRC-32 of `data` (any buffer) continuing from `value`; equal to `zlib.crc32(data, value)`."""
  return _crc32(data, value)


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
  """The CRC-32 of A followed by B, from crc32(A), crc32(B) and len(B)."""
  return _combine(crc_a, crc_b, len_b)
