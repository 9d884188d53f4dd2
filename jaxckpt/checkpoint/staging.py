"""The device -> host copy: the only part of an async save the training loop waits for.

Or, with staging `device`, not even that: a second copy of the state on the devices themselves
(`DeviceSnapshot`, a device-to-device copy the next step cannot donate away) is all the loop
waits for, and the writer thread copies it to host memory afterwards and frees it. That costs one
more copy of the state in device memory while a save is in flight; `auto` takes it only when
every device has room for it twice over, by the device's own memory statistics (a CPU reports
none: host staging there).

The copy must be real: on CPU `np.asarray(jax_array)` aliases the XLA buffer, and a donated train
state is overwritten by the next step while the background write still reads it. Buffers are kept
and reused from one save to the next, because freshly allocated pages cost 10-20x more to touch
than reused ones on a VM that returns freed memory to its host.

The training loop is idle while it waits, so a large state is copied by two threads: the caller
copies the first half of its bytes and a helper thread the second. One memcpy stream does not
saturate memory bandwidth: for andrea_120m two take 88 ms where one takes 111 ms here.

The first save of a process would also allocate the buffer and fault its pages in (~0.5 GB/s on
this VM: 3 s for andrea_120m, on the training thread). `HostStager.prepare` does that on a
background thread as soon as the state's shapes are known, while the caller does something else
(compiling a step function); the first save then waits at most for that thread.

On an accelerator the bytes come to the host through its pinned host memory, in windows
(`pinned`): the plain `np.asarray` of a device array goes through the driver's pageable path,
which on an H200 was 16x slower and stalled the training loop while it ran.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
from typing import Any, Mapping

import jax
import numpy as np

from . import bounded, orbaxstore, statefile
from . import pinned as pinned_memory
from .directio import ALIGN, aligned_empty, padded
from .errors import CheckpointError

_log = logging.getLogger(__name__)
# Waking the helper costs ~1-3 ms on this VM (an idle vCPU), while splitting saves a quarter of a
# copy at ~12 GB/s: below ~100 MB it does not pay (andrea_12m, 154 MB, only breaks even).
_SPLIT_MIN_BYTES = 128 << 20
# `prepare` faults the buffer in pieces this large, so that `close` stops it within one piece.
_FAULT_PIECE = 64 << 20
# The first save waits this long for `prepare`, plus a second per 50 MB: over 10x slower than the
# 0.6 GB/s it faults at here on a loaded VM (a swapping host), and then fails naming it.
_PREPARE_WAIT_SECS = 120.0
_PREPARE_WAIT_BYTES_PER_SEC = 50e6


class InMemory:
  """A state file still in host memory after its write: its header and the staging region it
  was written from, `size` bytes in all. `read` answers until the region is staged over (or let
  go): then None, and a reader (the upload) goes to the file on disk instead."""

  def __init__(self, header: bytes, region: np.ndarray, size: int):
    self.size, self.served = size, 0  # the bytes `read` answered from memory
    self._header, self._data = header, memoryview(region)[:size - len(header)]
    self._lock = threading.Lock()

  def read(self, start: int, stop: int) -> bytes | None:
    """Bytes [start, stop) of the file; None once the region is no longer this file's."""
    with self._lock:  # `revoke` waits for a copy under way (one part: milliseconds)
      if self._data is None or not 0 <= start <= stop <= self.size:
        return None
      h = len(self._header)
      head = self._header[start:min(stop, h)]
      out = head + bytes(self._data[max(start - h, 0):max(stop - h, 0)])
      self.served += len(out)
      return out

  def revoke(self) -> None:
    with self._lock:
      self._data = None


class HostStager:
  """Copies named arrays into one host buffer it owns (one staged copy of the state at a time).

  The buffer (`region`) is page-aligned and laid out as the state file's data region
  (`statefile.plan`): the writer sends it to disk as it is, with O_DIRECT. It is kept while the
  layout stays the same, which in a training run is always. Dtypes a state file cannot hold
  (complex, int4) are laid out too, for orbax to write from: which storage takes which dtypes is
  `check_storable`'s to say, at the call.
  """

  def __init__(self, pinned: bool | None = None):
    # Through pinned host memory: None, where the arrays are on an accelerator that has it.
    self.pinned = pinned
    self.region: np.ndarray | None = None
    self._plan: statefile.Plan | None = None
    self._views: dict[str, np.ndarray] = {}
    self._helper: concurrent.futures.ThreadPoolExecutor | None = None
    self._preparing: threading.Thread | None = None
    self._prepare_error: BaseException | None = None
    self._stop_preparing = threading.Event()
    self._prepare_wait = _PREPARE_WAIT_SECS
    self.prepared = False  # the region was laid out by `prepare` and no save has used it yet
    self._lent: list[InMemory] = []  # files written from the region, read until it changes

  def lend(self, header: bytes, size: int) -> InMemory:
    """The state file of `size` bytes just written from the region (with `header`), readable
    from memory until the region is staged over, let go or closed."""
    held = InMemory(header, self.region, size)
    self._lent.append(held)
    return held

  def _revoke(self) -> None:
    for held in self._lent:
      held.revoke()
    self._lent = []

  def prepare(self, leaves: Mapping[str, Any]) -> None:
    """Allocate and fault in the region for `leaves` (anything with shape and dtype, e.g.
    `jax.ShapeDtypeStruct`s) on a background thread; `stage` waits for it. Not while a staged
    copy is in use: the caller waits for its save first."""
    self.wait_prepared()
    self._revoke()
    p = statefile.plan(leaves, any_dtype=True)  # in the caller's thread
    size = max(padded(p.data_len), ALIGN)
    if self.region is not None and len(self.region) == size:
      return  # already there, and touched
    self._stop_preparing.clear()
    split = p.data_len >= _SPLIT_MIN_BYTES
    device = self._pinned_device(leaves)

    def run():
      try:
        region = aligned_empty((size,), np.uint8, populate=False)  # asks for huge pages first
        for lo in range(0, size, _FAULT_PIECE):
          if self._stop_preparing.is_set():
            return  # closing: the buffer is not needed any more
          region[lo:lo + _FAULT_PIECE:ALIGN] = 0  # one write per page faults it in
        if split:  # the helper's thread starts now, not in the first save
          self._helper_pool().submit(int).result()
        self.region, self._plan = region, None
        self._lay_out(p)
        if device is not None:  # the pinned memory a save holds at most, set up now
          pinned_memory.warm(device, min(p.data_len, 2 * pinned_memory.WINDOW))
        self.prepared = True
      except BaseException as e:  # pylint: disable=broad-except  # raised by `wait_prepared`
        self._prepare_error = e

    self._prepare_wait = _PREPARE_WAIT_SECS + size / _PREPARE_WAIT_BYTES_PER_SEC
    self._preparing = threading.Thread(target=run, name='jaxckpt-prepare', daemon=True)
    self._preparing.start()

  def wait_prepared(self) -> None:
    """Wait for `prepare`'s thread, bounded; raise what it failed with."""
    thread = self._preparing
    if thread is None:
      return
    thread.join(self._prepare_wait)
    if thread.is_alive():
      raise CheckpointError(
          'E-CKPT-014', f'the staging buffer prepared in the background (thread '
          f'{thread.name}) was not ready after {self._prepare_wait:.0f} s',
          'check host memory and swapping, or do not call prepare')
    self._preparing = None
    error, self._prepare_error = self._prepare_error, None
    if error is not None:
      raise CheckpointError(
          'E-CKPT-014', f'preparing the staging buffer (thread {thread.name}) failed: '
          f'{type(error).__name__}: {error}',
          'check host memory, or do not call prepare') from error

  def stage(self, leaves: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Copy `leaves` into the region; returns {name: the host array (a view of the region)}."""
    self.wait_prepared()
    self._revoke()
    self.prepared = False
    for name, x in leaves.items():
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise CheckpointError('E-CKPT-007', f'{name} is not fully addressable from this '
                              'process', 'multi-process saving needs a process-local writer')
    bounded.ready(leaves.items(), 'save')  # the step computing them may still be running
    self._lay_out(statefile.plan(leaves, any_dtype=True))
    through = [n for n, x in leaves.items() if self._through_pinned(x)]
    taken = set(through)
    rest = {n: x for n, x in leaves.items() if n not in taken}
    for x in rest.values():
      if isinstance(x, jax.Array):
        x.copy_to_host_async()  # start every transfer before waiting on any
    if through:
      try:
        pinned_memory.copy(pinned_memory.pieces(leaves, through), self._view, self._copy_pairs)
      except Exception as e:  # pylint: disable=broad-except  # the plain way still works
        _log.warning(
            'staging through pinned host memory failed (%s: %s); copying the plain '
            'way from now on',
            type(e).__name__, e)
        self.pinned = False
        rest = dict(leaves)  # every leaf again: the region is written over whole
    self._copy_all(rest)
    return {name: self._views[name] for name in leaves}

  def _through_pinned(self, x: Any) -> bool:
    """Whether a save stages `x` (an array, or a `ShapeDtypeStruct` with a sharding) through
    pinned memory."""
    if not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or x.sharding is None or \
        getattr(x.sharding, 'memory_kind', None) == 'pinned_host':
      return False
    return pinned_memory.available(x) if self.pinned is None else self.pinned

  def _pinned_device(self, leaves: Mapping[str, Any]) -> Any:
    """A device a save of `leaves` stages through pinned memory from; None when it does not."""
    return next((next(iter(x.sharding.addressable_devices))
                 for x in leaves.values()
                 if self._through_pinned(x)), None)

  def _view(self, name: str, index: tuple) -> np.ndarray:
    return self._views[name][index + (Ellipsis,)]  # a view, a 0-d array's too

  def _copy_pairs(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """np.copyto(destination, source) for each pair, with the helper thread taking the second
    half of the bytes when they are large (pairs whole: a shard's view may not be contiguous)."""
    total, at, cut = sum(src.nbytes for _, src in pairs), 0, len(pairs)
    for i, (_, src) in enumerate(pairs):
      if at >= total // 2:
        cut = i
        break
      at += src.nbytes
    if total < _SPLIT_MIN_BYTES or cut == len(pairs):
      _copy_into(pairs)
      return
    helper = self._helper_pool().submit(_copy_into, pairs[cut:])
    try:
      _copy_into(pairs[:cut])
    finally:
      helper.result()

  def _helper_pool(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._helper is None:
      self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='jaxckpt-stage')
    return self._helper

  def _copy_all(self, leaves: Mapping[str, Any]) -> None:
    """Copy `leaves` whole into their views, with the helper thread when they are large."""
    sizes = {name: x.nbytes for name, x in leaves.items()}
    if sum(sizes.values()) < _SPLIT_MIN_BYTES:
      self._copy(leaves, [(name, 0, None) for name in leaves])
      return
    first, second = _halves(sizes, {name: np.dtype(x.dtype).itemsize for name, x in leaves.items()})
    helper = self._helper_pool().submit(self._copy, leaves, second)
    try:
      self._copy(leaves, first)
    finally:
      helper.result()

  def _lay_out(self, plan: statefile.Plan) -> None:
    if plan is self._plan:
      return
    size = max(padded(plan.data_len), ALIGN)
    if self.region is None or len(self.region) != size:
      # Fresh pages: the tail past the data stays zero, the O_DIRECT padding of the last chunk.
      self.region = aligned_empty((size,), np.uint8)
    self._plan = plan
    self._views = {}
    for name in plan.names:
      b, e = plan.offsets[name]
      self._views[name] = self.region[b:e].view(plan.dtypes[name]).reshape(plan.shapes[name])

  def _copy(self, leaves: Mapping[str, Any], pieces: list[tuple[str, int, int | None]]) -> None:
    """Copies elements [lo, hi) of each named leaf, flat (hi None: to the end)."""
    for name, lo, hi in pieces:
      src, dst = np.asarray(leaves[name]), self._views[name]
      if hi is None and not lo:
        np.copyto(dst, src)
      else:
        np.copyto(dst.reshape(-1)[lo:hi], src.reshape(-1)[lo:hi])

  def nbytes(self) -> int:
    return 0 if self.region is None else len(self.region)

  def release(self) -> None:
    """Let the staged buffer go (a save that writes without a staged copy does not need it)."""
    self.wait_prepared()
    self._revoke()
    self.region, self._plan, self._views, self.prepared = None, None, {}, False

  def close(self) -> None:
    self._stop_preparing.set()  # a prepare still faulting stops within one piece
    self._revoke()
    try:
      self.wait_prepared()
    finally:
      self._close_helper()

  def _close_helper(self) -> None:
    if self._helper is not None:
      self._helper.shutdown(wait=True)
      self._helper = None


Pieces = list[tuple[str, int, 'int | None']]


def _copy_into(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
  for dst, src in pairs:
    np.copyto(dst, src)


def _halves(sizes: Mapping[str, int], itemsizes: Mapping[str, int]) -> tuple[Pieces, Pieces]:
  """(caller's, helper's) pieces (name, lo, hi): half the bytes each, in leaf order, the leaf
  that straddles the middle split at an element boundary."""
  half = sum(sizes.values()) // 2
  first, second, at = [], [], 0
  for name, size in sizes.items():
    cut = (half - at) // itemsizes[name]  # elements of this leaf that go to the caller
    if at + size <= half:
      first.append((name, 0, None))
    elif cut <= 0:
      second.append((name, 0, None))
    else:
      first.append((name, 0, cut))
      second.append((name, cut, None))
    at += size
  return first, second


def check_storable(storage: str, leaves: Mapping[str, Any]) -> None:
  """An ArgumentError (E-CKPT-013) naming a leaf `storage` cannot save, for a save to call before
  anything is staged (the stager lays out any dtype): for safetensors a dtype it has no code for
  (complex, int4); for orbax an empty state, a zero-size array or a dtype tensorstore lacks
  (uint4). Leaves are anything with shape and dtype."""
  if storage == 'orbax':
    orbaxstore.check(leaves)
  else:
    statefile.check_dtypes(leaves)


def available_host_memory(meminfo: str = '/proc/meminfo') -> int | None:
  """Bytes the kernel can hand out without swapping (`MemAvailable`: free memory plus the page
  cache it can reclaim); None where that is not known.

  Free pages alone (`SC_AVPHYS_PAGES`) shrink as the page cache fills with checkpoint data the
  kernel would drop at once, and would push `auto` to sync for no reason.
  """
  try:
    with open(meminfo) as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def choose_mode(mode: str, needed: int, available: int | None) -> str:
  """The mode of one save: `auto` is async when the staged copy's `needed` new bytes fit twice
  into `available` host memory (the copy, and headroom for the training step that runs beside
  the write), else sync; unknown memory counts as room."""
  if mode != 'auto':
    return mode
  return 'async' if available is None or available > 2 * needed else 'sync'


def auto_mode(needed: int, stager: HostStager, available: int | None) -> str:
  """`choose_mode('auto')` for a save of `needed` bytes into `stager`: the buffer it holds is
  room already, except one `prepare` made that no save used yet: that counts as the free memory
  it was, so preparing never makes a save async that would have written inline without it."""
  held = stager.nbytes()
  if stager.prepared and available is not None:
    return choose_mode('auto', needed, available + held)
  return choose_mode('auto', max(0, needed - held), available)


class Unstaged(Mapping[str, np.ndarray]):
  """Leaves read as host arrays one at a time, when a save writes inline without a staged copy
  (`auto` short of memory): on CPU `np.asarray` shares the device buffer, on an accelerator each
  leaf is fetched when the writer reaches it."""

  def __init__(self, leaves: Mapping[str, Any]):
    bounded.ready(leaves.items(), 'save')  # the step computing them may still be running
    self._leaves = leaves

  def __getitem__(self, name: str) -> np.ndarray:
    return np.asarray(self._leaves[name])

  def __iter__(self):
    return iter(self._leaves)

  def __len__(self) -> int:
    return len(self._leaves)


def choose_staging(staging: str, leaves: Mapping[str, Any]) -> str:
  """Where a save stages `leaves` first: 'host' or 'device' (see the module docstring)."""
  if staging == 'host' or not leaves or not all(isinstance(x, jax.Array) for x in leaves.values()):
    return 'host'
  if staging == 'device':
    return 'device'
  first = next(iter(leaves.values()))
  if not device_has_room(next(iter(first.sharding.addressable_devices)), 0):
    return 'host'  # no memory statistics (a CPU): no need to size anything, every save
  need: dict[Any, int] = {}  # bytes a second copy takes on each device
  for x in leaves.values():
    shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for device in x.sharding.addressable_devices:
      need[device] = need.get(device, 0) + shard
  return 'device' if all(device_has_room(d, 2 * n) for d, n in need.items()) else 'host'


def device_has_room(device, nbytes: int) -> bool:
  """Whether `device` reports at least `nbytes` free; False when it reports nothing (a CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # backends without statistics raise
    return False
  if not stats or 'bytes_limit' not in stats:
    return False
  return stats['bytes_limit'] - stats.get('bytes_in_use', 0) >= nbytes


class DeviceSnapshot:
  """A copy of the state on its own devices, taken without waiting for the host."""

  def __init__(self, leaves: Mapping[str, Any], parts=None):
    names = list(leaves)
    copies = jax.device_put([leaves[n] for n in names], [leaves[n].sharding for n in names],
                            may_alias=False)
    self.leaves = dict(zip(names, copies))
    self._parts = parts  # across processes: (leaves) -> (the shards this one writes, places)

  def to_host(self, stager: 'HostStager') -> dict[str, np.ndarray]:
    """Stage the snapshot to host memory (on the writer thread) and free its device memory."""
    staged = stager.stage(self.leaves if self._parts is None else self._parts(self.leaves)[0])
    for x in self.leaves.values():
      x.delete()
    self.leaves = {}
    return staged
