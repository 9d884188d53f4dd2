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

from .errors import ArgumentError


def save(directory: Path, arrays: Mapping[str, Any]) -> None:
  arrays = dict(arrays)  # once: a `staging.Unstaged` fetches each leaf as it is asked for
  check(arrays)  # before orbax says it its own way, from its threads
  ocp = _ocp()
  _checkpointer().save(directory, args=ocp.args.PyTreeSave(arrays))


def check(arrays: Mapping[str, Any]) -> None:
  """ArgumentError (E-CKPT-013) naming what orbax cannot save, before anything is written: an
  empty state, a zero-size array, a dtype tensorstore has no name for (uint4). `arrays`: anything
  with shape and dtype."""
  if not arrays:
    raise ArgumentError('E-CKPT-013', 'orbax cannot save an empty state (no arrays)',
                        'use storage=safetensors, or save at least one array')
  import tensorstore as ts  # pylint: disable=import-outside-toplevel  # orbax's, loaded with it
  for name, x in arrays.items():
    if 0 in np.shape(x):
      raise ArgumentError('E-CKPT-013', f'orbax cannot save a zero-size array: {name} '
                          f'{list(np.shape(x))}', 'use storage=safetensors')
  for dtype in {x.dtype for x in arrays.values()}:  # each distinct dtype once
    try:
      ts.dtype(np.dtype(dtype).name)
    except (TypeError, ValueError):
      name = next(n for n, x in arrays.items() if x.dtype == dtype)
      raise ArgumentError(
          'E-CKPT-013', f'orbax cannot save {name}: dtype {np.dtype(dtype)} has '
          'no tensorstore type', 'save it as another dtype') from None


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
