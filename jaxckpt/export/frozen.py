"""The parameters a checkpoint left out (frozen, from `config.train.init_from`), read back from
the pinned file they came from, after checking that it is still the same file."""

from __future__ import annotations

import os
from typing import Any, Mapping

from jaxckpt.errors import ResumeError
from jaxckpt.export import safetensors_io
from jaxckpt.records.provenance import pin_file


def read_excluded(step_dir: str | os.PathLike, manifest: Mapping[str, Any]) -> dict[str, Any]:
  """{dotted name: array} of the parameters a checkpoint left out (frozen, from `init_from`).

  They are read from the pinned file after checking that it is the same file (size, sha256);
  a different or missing file raises ResumeError E-LOAD-001.
  """
  names = [t['name'] for t in manifest.get('excluded') or []]
  if not names:
    return {}
  pin = manifest.get('init_from') or {}
  path = pin.get('path')
  try:
    now = pin_file(path) if path else None
  except OSError:
    now = None
  if now is None or (now['size'], now['sha256']) != (pin.get('size'), pin.get('sha256')):
    raise ResumeError(
        'E-LOAD-001', f'{step_dir} keeps {len(names)} frozen parameter(s) in '
        f'its init_from file {path}, which is missing or changed (pinned: size '
        f'{pin.get("size")}, sha256 {str(pin.get("sha256"))[:12]})',
        'put the original file back at that path')
  tensors, _ = safetensors_io.read_model(path)
  dotted = {n: '.'.join(n.split('/')[1:]) for n in names}
  return {d: tensors[d] for d in dotted.values()}
