"""Bounded waits for a save: on the devices it was handed, and for the save in flight.

JAX's own waits (`jax.block_until_ready`, `np.asarray` of a device array) have no timeout, and a
save waits on the devices: for the arrays it is handed to be computed (the step that made them
may still be running), for their copy to host memory, and for the moves of other processes'
parts (`replicas`). A step or collective that never finishes (a stuck device; a collective that
hangs with every process alive) would hold the save for good, and a training loop inside it,
whose own watch (a step timeout) leaves a save to its bounded waits. So:

- `ready` waits for arrays on a helper thread and gives up after `DEVICE_WAIT_SECS` plus a second
  per 50 MB, with E-CKPT-018 naming the first array still not there. The wait left behind is a
  daemon thread: the process can still exit.
- `finished` bounds the wait for the save in flight in the background (its writer waits on the
  devices, the disk and the other processes): twice the barrier timeout (a part's barrier, then
  the commit's), plus `DEVICE_WAIT_SECS`, plus a second per 5 MB of state (its write and its
  `on_commit` exports at 5 MB/s, far below any disk's speed).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Iterable

import jax

from .errors import CheckpointError

# A step's arrays that are not computed after this long come from a step that will not finish
# (a trainer's default step timeout is as long).
DEVICE_WAIT_SECS = 600.0
COPY_BYTES_PER_SEC = 50e6  # a device-to-host copy at this rate is stuck, not slow
WRITE_BYTES_PER_SEC = 5e6  # a save that writes (and exports) at this rate is stuck, not slow
WAITER = 'jaxckpt-device-wait'


def ready(arrays: Iterable[tuple[str, Any]], what: str, seconds: float | None = None) -> None:
  """Returns once every `jax.Array` of `arrays` ((name, array) pairs) is computed; E-CKPT-018
  naming the first that is not after `seconds` (default: DEVICE_WAIT_SECS + a second per 50 MB).
  `what` says what waits ('save'). An array that failed or was deleted counts as ready: reading
  it raises its own error."""
  pending = [(n, x) for n, x in arrays if isinstance(x, jax.Array) and not _ready(x)]
  if not pending:
    return
  if seconds is None:
    seconds = DEVICE_WAIT_SECS + sum(x.nbytes for _, x in pending) / COPY_BYTES_PER_SEC
  done = threading.Event()

  def wait() -> None:
    try:
      jax.block_until_ready([x for _, x in pending])
    except Exception:  # pylint: disable=broad-except  # raised again where the bytes are read
      pass
    finally:
      done.set()

  threading.Thread(target=wait, name=WAITER, daemon=True).start()
  if done.wait(seconds):
    return
  late = [n for n, x in pending if not _ready(x)] or [pending[0][0]]
  more = f' and {len(late) - 1} more' if len(late) > 1 else ''
  raise CheckpointError(
      'E-CKPT-018', f'{what} waited {seconds:.0f} s for {late[0]}{more} on the devices: the '
      'step or collective computing them never finished', 'look for a stuck device or a process '
      'that stopped; nothing of this save was written: restart, the run resumes from its last '
      'checkpoint')


def save_wait(nbytes: int, barrier_secs: float) -> float:
  """Seconds the wait for a save in flight of `nbytes` of state gives it (module docstring)."""
  return 2 * barrier_secs + DEVICE_WAIT_SECS + nbytes / WRITE_BYTES_PER_SEC


class Stuck(CheckpointError):
  """The save in flight did not finish within its bound: its thread is still waiting."""


def finished(future: concurrent.futures.Future, step: int, nbytes: int,
             barrier_secs: float) -> None:
  """`future.result()` of the save of `step` in flight (`nbytes` of state), bounded by
  `save_wait`: `Stuck` (E-CKPT-018) naming the step past it."""
  limit = save_wait(nbytes, barrier_secs)
  concurrent.futures.wait([future], limit)
  if not future.done():
    raise Stuck(
        'E-CKPT-018', f'the save of step {step} in the background (thread jaxckpt-save) had '
        f'not finished after {limit:.0f} s', 'look for a stuck device, a stopped process or a '
        'hung disk, then restart: the run resumes from its newest committed checkpoint')
  future.result()


def _ready(x: jax.Array) -> bool:
  try:  # is_ready() of a deleted array crashes the process (jax 0.10)
    return x.is_deleted() or x.is_ready()
  except Exception:  # pylint: disable=broad-except  # deleted, or failed: not ours to wait for
    return True
