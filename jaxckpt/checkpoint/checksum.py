"""CRC-32 (the zlib polynomial) at memory speed.

Every checkpoint byte is checksummed when it is written and again when it is restored or
verified, so the checksum's speed bounds both. zlib's `crc32` runs at ~4 GB/s on one core here: a
third of a second on an andrea_120m state, as long as reading it from disk. ISA-L's
(`isal.isal_zlib.crc32`, the same function computed with carry-less multiplies) runs at ~29 GB/s
and gives the same values, so manifests stay readable with plain zlib. zlib is the fallback on a
platform without an isal wheel.
"""

from __future__ import annotations

try:
  from isal.isal_zlib import crc32 as _crc32
  IMPLEMENTATION = 'isal'
except ImportError:  # pragma: no cover - isal has wheels for the usual platforms
  from zlib import crc32 as _crc32
  IMPLEMENTATION = 'zlib'


def crc32(data, value: int = 0) -> int:
  """CRC-32 of `data` (any buffer) continuing from `value`; equal to `zlib.crc32(data, value)`."""
  return _crc32(data, value)
