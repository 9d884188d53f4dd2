"""The device -> host copy: the only part of an async save the training loop waits for.

The copy must be real: on CPU `np.asarray(jax_array)` aliases the XLA buffer, and a donated train
state is overwritten by the next step while the background write still reads it. Buffers are kept
and reused from one save to the next, because freshly allocated pages cost 10-20x more to touch
than reused ones on a VM that returns freed memory to its host.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from jaxckpt.checkpoint import rawstore
from jaxckpt.errors import CheckpointError


class HostStager:
  """Copies named arrays into host buffers it owns (one staged copy of the state at a time)."""

  def __init__(self):
    self._buffers: dict[str, np.ndarray] = {}

  def stage(self, leaves: Mapping[str, Any]) -> dict[str, np.ndarray]:
    for name, x in leaves.items():
      if isinstance(x, jax.Array):
        if not x.is_fully_addressable:
          raise CheckpointError('E-CKPT-007', f'{name} is not fully addressable from this '
                                'process', 'multi-process saving needs a process-local writer')
        x.copy_to_host_async()  # start every transfer before waiting on any
    staged = {}
    for name, x in leaves.items():
      src = np.asarray(x)
      buf = self._buffers.get(name)
      if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
        # Page-aligned and zero-padded: the raw store writes it to disk with O_DIRECT as is.
        buf = self._buffers[name] = rawstore.aligned_empty(src.shape, src.dtype)
      np.copyto(buf, src)
      staged[name] = buf
    for name in set(self._buffers) - set(leaves):
      del self._buffers[name]
    return staged

  def nbytes(self) -> int:
    return sum(b.nbytes for b in self._buffers.values())
