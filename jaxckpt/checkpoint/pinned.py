"""Device-to-host copies through an accelerator's pinned host memory (`HostStager.stage`).

Each shard a device holds (one replica of a replicated array: its bytes come over once) is copied
to the `pinned_host` memory of its device with `jax.device_put` (a DMA), and from there into the
save's kept host buffer (`np.asarray` of a single-device pinned array shares its memory). The
plain way, `np.asarray` of a device array, allocates fresh host arrays and fills them through
the driver's pageable path: on an H200 that took 0.76-0.97 s for andrea_120m's 1.46 GB every
time, and a loop dispatching steps on another thread ran at under 1% of its rate meanwhile.
Through pinned memory the same bytes took 0.05 s once its memory was there (0.87 s the first
time), and the loop kept a quarter of its rate beside transfers run back to back
(`benchmarks/device_transfer.py`).

The shards go in windows of `WINDOW` bytes, the next window's transfer under way while the last
is copied, so the pinned memory held stays at two windows (a shard larger than a window is a
window of its own) whatever the state's size. The runtime sets that memory up the first time
(0.87 s for 1.46 GB on the H200, kept for later copies): `warm` has it done while the first
step compiles (`HostStager.prepare`). A CPU has no use for any of it: its arrays are host memory
already.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import jax
import numpy as np

from . import bounded

_log = logging.getLogger(__name__)

# Bytes of the shards one window copies.
WINDOW = 256 << 20
Piece = tuple[str, tuple, Any]  # (leaf name, the shard's index in the leaf, the shard's array)


def available(x: Any) -> bool:
  """Whether `x` sits on accelerators that have pinned host memory."""
  return all(d.platform != 'cpu' and _has_pinned(d) for d in x.sharding.addressable_devices)


def _has_pinned(device) -> bool:
  try:
    return any(m.kind == 'pinned_host' for m in device.addressable_memories())
  except Exception:  # pylint: disable=broad-except  # a backend without memory spaces
    return False


def pieces(leaves: Mapping[str, Any], names: list[str]) -> list[Piece]:
  """The shards of `names` to copy: one replica of each part of each array, in leaf order."""
  return [(name, shard.index, shard.data)
          for name in names
          for shard in leaves[name].addressable_shards
          if shard.replica_id == 0]


def windows(pieces_: list[Piece], window: int) -> list[list[Piece]]:
  """`pieces_` in order, in runs of at most `window` bytes (a larger piece alone)."""
  runs: list[list[Piece]] = []
  held = 0
  for piece in pieces_:
    size = piece[2].nbytes
    if not runs or held + size > window:
      runs.append([])
      held = 0
    runs[-1].append(piece)
    held += size
  return runs


def copy(pieces_: list[Piece],
         into: Callable[[str, tuple], np.ndarray],
         copy_pairs: Callable[[list[tuple[np.ndarray, np.ndarray]]], None],
         window: int | None = None) -> int:
  """Copies every piece into `into(name, index)` (a view of the host buffer), window by window
  through pinned memory, by `copy_pairs([(destination, source), ...])`; returns the windows.
  The pinned copies are let go as each window is done, and on an error too."""
  runs = windows(pieces_, WINDOW if window is None else window)
  here: list[Any] = []
  arriving = _to_pinned(runs[0]) if runs else []
  try:
    for i, run in enumerate(runs):
      here, arriving = arriving, []
      if i + 1 < len(runs):
        arriving = _to_pinned(runs[i + 1])  # under way while this window is copied
      bounded.ready([(name, x) for (name, _, _), x in zip(run, here)], 'staging to pinned memory')
      copy_pairs([
          (into(name, index), np.asarray(host)) for (name, index, _), host in zip(run, here)
      ])
      _let_go(here)
  finally:
    _let_go(here)
    _let_go(arriving)
  return len(runs)


def warm(device: Any, nbytes: int) -> bool:
  """Has the runtime set up `nbytes` of `device`'s pinned host memory (two arrays of half of
  it, let go at once), so that the first save does not; False, and logged, where it cannot."""
  if nbytes <= 0:
    return False
  try:
    sharding = jax.sharding.SingleDeviceSharding(device, memory_kind='pinned_host')
    held = [jax.device_put(np.zeros(-(-nbytes // 2), np.uint8), sharding) for _ in range(2)]
    jax.block_until_ready(held)
  except Exception as e:  # pylint: disable=broad-except  # the first save sets it up instead
    _log.info('pinned host memory not set up ahead of the first save: %s: %s', type(e).__name__, e)
    return False
  _let_go(held)
  return True


def _to_pinned(run: list[Piece]) -> list[Any]:
  arrays = [x for _, _, x in run]
  return jax.device_put(arrays, [x.sharding.with_memory_kind('pinned_host') for x in arrays])


def _let_go(arrays: list[Any]) -> None:
  for x in arrays:
    if not x.is_deleted():
      x.delete()  # its pinned memory goes back to the device's pool
