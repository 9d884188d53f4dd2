"""The state file, side by side with jaxckpt's first format, under the baselines' rules.

    state-file     `statefile.write` from a staged region / `statefile.read`, every CRC checked
    format1-file   the first format (arrays.bin at 4 KiB-aligned offsets + index.json), written
                   as jaxckpt wrote it until the state file became safetensors / `rawstore.read`

Both write from page-aligned host buffers staged before the clock starts (what the manager's
staging gives them), so the rows compare the file formats alone; the `jaxckpt` rows measure the
whole save and restore through the manager.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from pathlib import Path

import numpy as np

from benchmarks.baselines import _save_and_restore
from jaxckpt.checkpoint import directio, rawstore, staging, statefile
from jaxckpt.checkpoint.checksum import crc32

_CHUNK = 64 << 20


def state_file(state: dict, scratch) -> list[dict]:
  stager = staging.HostStager()
  staged = stager.stage(state)
  expect = {}

  def save(_state, work: Path) -> None:
    files, _ = statefile.write(work, staged, region=stager.region)
    expect['crc'] = files[statefile.file_name(0)]['crc32']

  def restore(work: Path) -> dict:
    return statefile.read(work, expect_crc32=expect['crc'])

  try:
    return _save_and_restore('state-file', state, scratch, save, restore)
  finally:
    stager.close()


def format1_file(state: dict, scratch) -> list[dict]:
  staged = {}
  for name, x in state.items():  # one page-aligned, zero-padded buffer per array, as it staged
    staged[name] = directio.aligned_empty(x.shape, x.dtype)
    np.copyto(staged[name], x)
  expect = {}

  def save(_state, work: Path) -> None:
    expect['crc'] = write_format1(work, staged)

  def restore(work: Path) -> dict:
    return rawstore.read(work, expect_crc32=expect['crc'])

  return _save_and_restore('format1-file', state, scratch, save, restore)


def write_format1(directory: Path, arrays: dict[str, np.ndarray]) -> str:
  """The first format's writer: each array one O_DIRECT write at a 4 KiB-aligned offset, the
  file's CRC computed while the writes are in flight, then index.json. Returns the CRC."""
  directory.mkdir(parents=True, exist_ok=True)
  index, offset = {}, 0
  for name, x in arrays.items():
    index[name] = {
        'offset': offset, 'nbytes': int(x.nbytes), 'shape': list(x.shape), 'dtype': str(x.dtype),
        'crc32': f'{crc32(x.reshape(-1).view(np.uint8)):08x}'
    }
    offset += directio.padded(x.nbytes)
  fd, _ = directio.open_direct(directory / rawstore.DATA, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  crc = 0
  try:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      pending = []
      for name, x in arrays.items():
        view = directio.padded_view(x)
        for lo in range(0, len(view), _CHUNK):
          chunk = view[lo:lo + _CHUNK]
          pending.append(pool.submit(directio.pwrite_all, fd, chunk, index[name]['offset'] + lo))
          crc = crc32(chunk, crc)
      for f in pending:
        f.result()
    os.fsync(fd)
  finally:
    os.close(fd)
  (directory / rawstore.INDEX).write_text(json.dumps({'format': rawstore.FORMAT, 'arrays': index}))
  return f'{crc:08x}'


FORMATS = (state_file, format1_file)
