"""The parameters a checkpoint left out (frozen, from `config.train.init_from`), read back from
the pinned files they came from, after checking that they are still the same files."""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from jaxckpt.errors import CheckpointError, ResumeError
from jaxckpt.export import weights


def read_excluded(step_dir: str | os.PathLike, manifest: Mapping[str, Any]) -> dict[str, Any]:
  """{dotted name: array} of the parameters a checkpoint left out (frozen, from `init_from`).

  Only the tensors needed are read, from the files and tensors the manifest's `init_from` pin
  names, after checking each file's size and version (sha256, S3 ETag, GCS generation); a
  changed or missing file raises ResumeError E-LOAD-001 naming the tensor, the file and both pins.
  """
  names = ['.'.join(t['name'].split('/')[1:]) for t in manifest.get('excluded') or []]
  if not names:
    return {}
  pin = manifest.get('init_from')
  problem = weights.pin_problem(pin) if pin is not None else None
  if problem:
    raise CheckpointError('E-CKPT-004', f'{step_dir}/manifest.json: {problem}',
                          'the checkpoint is damaged: verify it, resume from another')
  arrays = weights.read_pinned(pin, names) if pin else {}
  missing = [n for n in names if n not in arrays]
  if missing:
    raise ResumeError(
        'E-LOAD-001', f'{step_dir} keeps {len(names)} frozen parameter(s) in its init_from '
        f'file, whose pin does not name {", ".join(missing[:5])}', 'export a checkpoint '
        'that holds them')
  # Narrow floats (a bf16 file) were widened into the run's f32 parameters: the same here.
  return {n: _as_param(arrays[n]) for n in names}


def _as_param(x: np.ndarray) -> np.ndarray:
  narrow = x.dtype.kind in 'fV' and x.dtype.itemsize < 4
  return np.asarray(x, dtype=np.float32) if narrow else x
