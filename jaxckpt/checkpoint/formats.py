"""Which state format a checkpoint holds, and reading it whatever it is.

    safetensors   state/process_0.safetensors (`statefile`), what jaxckpt writes on one process;
                  across processes one file per process, its shards (`boxrestore`)
    raw           state/arrays.bin + index.json (`rawstore`), the first format: read only
    orbax         orbax-checkpoint's tensorstore files (`orbaxstore`), across processes

The manifest's `storage` says which.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from . import boxrestore, layout, manifest, orbaxstore, rawstore, statefile

SAFETENSORS = 'safetensors'  # the manifest's `storage` of a single-file state (raw: format 1)


def data_file(meta: Mapping[str, Any]) -> str | None:
  """The relative path of a checkpoint's single state file (None: orbax's many files, or one
  safetensors file per process that wrote it: `state_files`)."""
  storage = meta.get('storage')
  if storage == SAFETENSORS and not meta.get('state_files'):
    return f'{layout.STATE_DIR}/{statefile.file_name(0)}'
  if storage == 'raw':  # the first format, read-only
    return f'{layout.STATE_DIR}/{rawstore.DATA}'
  return None


def read_state_file(step_dir: Path,
                    meta: Mapping[str, Any],
                    names=None,
                    *,
                    checksums=True,
                    place=None,
                    direct=True) -> dict[str, Any]:
  """The tensors `names` (all: None) of a single-file checkpoint, their checksums checked as
  they are read (the file's CRC for all of them, each tensor's for a subset)."""
  directory = step_dir / layout.STATE_DIR
  expect = meta['files'][data_file(meta)]['crc32'] if checksums else None
  if meta['storage'] == SAFETENSORS:
    return statefile.read(
        directory,
        names,
        expect_crc32=expect,
        checksums=checksums,
        tensor_crc32={t['name']: t.get('crc32') for t in meta['tensors']},
        place=place,
        direct=direct)
  return rawstore.read(directory, names, expect_crc32=expect, place=place, direct=direct)


def read_host_arrays(step_dir: os.PathLike) -> dict[str, np.ndarray]:
  """Every array of a committed checkpoint as host numpy, whatever wrote it; no devices used.

  A single state file is checked against the manifest's CRC as it is read (E-CKPT-003 on a
  mismatch), so a caller verifying the other files can skip `data_file(meta)`: one pass over it.
  """
  step_dir = Path(step_dir).absolute()
  meta = manifest.read(step_dir)
  if meta.get('state_files'):  # written by several processes: shards, each CRC checked
    return boxrestore.read_host(step_dir, meta)
  if data_file(meta):
    return read_state_file(step_dir, meta)
  return orbaxstore.read_host(step_dir / layout.STATE_DIR, [t['name'] for t in meta['tensors']])
