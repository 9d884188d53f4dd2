"""orbax-checkpoint (tensorstore, OCDBT) for states that span processes.

On one process the raw store (`rawstore`) writes at disk speed; across processes each one holds
only its shards, and orbax writes them. Compression is off: zstd costs ~35% of save time on
random-looking weights and saves almost nothing. orbax is imported at the first use: a run on
one process never pays for its import (0.3 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np


def save(directory: Path, arrays: Mapping[str, Any]) -> None:
  ocp = _ocp()
  _checkpointer().save(directory, args=ocp.args.PyTreeSave(dict(arrays)))


def restore(directory: Path, want: Mapping[str, Any], *, partial: bool) -> dict[str, Any]:
  """The arrays `want` ({name: target with shape, dtype and sharding}) from `directory`."""
  ocp = _ocp()
  item = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for n, x in want.items()}
  restore_args = {
      n: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)
      for n, x in want.items()
  }
  return _checkpointer().restore(
      directory,
      args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=partial))


def _ocp():
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return ocp


def _checkpointer():
  # zstd costs ~35% of save time on incompressible weights and saves almost nothing: off.
  ocp = _ocp()
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def read_host(directory: Path, names) -> dict[str, np.ndarray]:
  """The arrays `names` as host numpy arrays, whatever mesh wrote them; no devices used."""
  ocp = _ocp()
  args = {name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}
  restored = _checkpointer().restore(directory, args=ocp.args.PyTreeRestore(restore_args=args))
  return {k: np.asarray(v) for k, v in restored.items()}
