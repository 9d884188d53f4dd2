"""A committed checkpoint's arrays read onto their target shardings, whatever mesh wrote them.

- Across processes, or from several state files: each process reads the byte ranges of its
  own shards (`multihost.restore`).
- One safetensors file: read in runs of tensors, each run placed on the devices as soon as it is
  read, overlapping the next reads.
- Orbax: tensorstore reads what each device needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from . import layout, multihost, orbaxstore, shardtable
from .formats import SAFETENSORS, data_file, read_state_file


def read_arrays(step_dir: Path, meta: Mapping[str, Any], want: Mapping[str, Any], *,
                checksums: bool, verify: bool, partial: bool) -> dict[str, jax.Array]:
  """{name: array} of the tensors `want` names (each a `ShapeDtypeStruct` with its sharding or
  an array). `verify=False`: the caller's check just read the file (no direct I/O needed)."""
  single = data_file(meta)
  if meta.get('storage') == SAFETENSORS and (jax.process_count() > 1 or 'state_files' in meta):
    return multihost.restore(
        step_dir, shardtable.shard_table(step_dir, meta, single), want, checksums=checksums)
  if single:

    def place(arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
      # One batched call per run (andrea_12m's 233 leaves: 6 ms batched, 9 ms one device_put
      # per leaf).
      return dict(
          zip(arrays, jax.device_put(list(arrays.values()), [want[n].sharding for n in arrays])))

    return read_state_file(
        step_dir, meta, list(want), checksums=checksums, place=place, direct=verify)
  return orbaxstore.restore(step_dir / layout.STATE_DIR, want, partial=partial)
