"""Device-to-host copies of a state, round after round, in a process of their own.

    python -m benchmarks.device_transfer --config=configs/andrea_120m.py --how=numpy

On an H200 the first two or three checkpoints of a run cost several times what later ones do
(a host-staged `save()` blocked 1.16, 1.04, 0.94 s, then 0.36 s; the steps beside the first two
device-staged writes ran at half speed). This separates what a transfer costs the first times
from what it costs once the process is warm, by the way the bytes come to the host:

- `numpy`: `copy_to_host_async` on a fresh device copy of every leaf, then `np.asarray` (what
  `HostStager.stage` does): jax allocates the host arrays.
- `pinned`: `jax.device_put` to the device's `pinned_host` memory first, then `np.asarray`.
- `stager`: `jaxckpt.checkpoint.staging.HostStager.stage` into its one kept buffer, the way a save
  stages (through pinned memory on an accelerator), after `prepare` (as the trainer calls it).
- `h2d`, `h2d_pinned`: the other way, as a restore places what it read: host arrays to the
  devices with `jax.device_put`, directly (the driver's pageable path) or through pinned host
  memory first.
- `fault`: no transfer: a fresh host buffer of the state's size, one write per page (the rate at
  which this machine hands out fresh memory).

With `--busy`, it also times a jitted loop on the device alone and while another thread runs the
transfers: whether a background copy slows the loop that dispatches steps.

Prints one JSON line, `RESULT {...}`; run under `benchmarks.device`'s `transfer` step.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def state_leaves(config: str) -> list:
  import jax

  from jaxckpt.records import provenance
  from jaxckpt.train.state import build_trainer
  trainer = build_trainer(provenance.load_config_file(config))
  state = trainer.init_fn(jax.random.key(0))
  leaves = [
      x for x in jax.tree.leaves(state)
      if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  return jax.block_until_ready(leaves)


_STAGER = None
_HOST = []  # `h2d`: the state in host memory, made once


def one_round(leaves: list, how: str) -> dict:
  """Seconds for one transfer of `leaves` to host memory, `how` as the module says."""
  import jax
  import numpy as np
  global _STAGER
  if how == 'stager':
    from jaxckpt.checkpoint.staging import HostStager
    if _STAGER is None:  # prepared as the trainer does, while it compiles: outside the timing
      _STAGER = HostStager()
      _STAGER.prepare({str(i): x for i, x in enumerate(leaves)})
      _STAGER.wait_prepared()
    fresh = jax.block_until_ready(
        jax.device_put(leaves, [x.sharding for x in leaves], may_alias=False))
    t0 = time.perf_counter()
    _STAGER.stage({str(i): x for i, x in enumerate(fresh)})
    return {'seconds': time.perf_counter() - t0}
  if how.startswith('h2d'):
    if not _HOST:
      _HOST.extend(np.array(x) for x in leaves)
    shardings = [x.sharding for x in leaves]
    t0 = time.perf_counter()
    if how == 'h2d_pinned':
      pinned = jax.device_put(_HOST, [s.with_memory_kind('pinned_host') for s in shardings])
      placed = jax.block_until_ready(jax.device_put(pinned, shardings))
    else:
      placed = jax.block_until_ready(jax.device_put(_HOST, shardings))
    row = {'seconds': time.perf_counter() - t0}
    for x in placed:
      x.delete()
    return row
  if how == 'fault':
    nbytes = sum(x.nbytes for x in leaves)
    t0 = time.perf_counter()
    buf = np.empty(nbytes, np.uint8)
    buf[::4096] = 1
    return {'seconds': time.perf_counter() - t0}
  fresh = jax.block_until_ready(
      jax.device_put(leaves, [x.sharding for x in leaves], may_alias=False))
  row = {}
  t0 = time.perf_counter()
  if how == 'pinned':
    fresh = jax.block_until_ready(
        jax.device_put(fresh, [x.sharding.with_memory_kind('pinned_host') for x in fresh]))
    row['to_pinned_s'] = time.perf_counter() - t0
  for x in fresh:
    x.copy_to_host_async()
  hosts = [np.asarray(x) for x in fresh]
  row['seconds'] = time.perf_counter() - t0
  del hosts
  return row


def device_loop_rate(seconds: float = 2.0) -> float:
  """Calls per second of a small jitted matmul chain, each call waited for (a training loop's
  dispatch and wait, without its data)."""
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
  a = jax.block_until_ready(f(jnp.ones((2048, 2048), jnp.float32)))
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    a = jax.block_until_ready(f(a))
    n += 1
  return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True)
  parser.add_argument(
      '--how', choices=('numpy', 'pinned', 'stager', 'h2d', 'h2d_pinned', 'fault'), default='numpy')
  parser.add_argument('--rounds', type=int, default=6)
  parser.add_argument('--busy', action='store_true')
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f'--rounds={args.rounds}: give at least 1')
  leaves = state_leaves(args.config)
  result = {
      'how': args.how, 'state_bytes': sum(x.nbytes for x in leaves),
      'rounds': [one_round(leaves, args.how) for _ in range(args.rounds)]
  }
  if args.busy:
    alone = device_loop_rate()
    busy_rounds, stop = [], threading.Event()

    def transfers():
      while not stop.is_set():
        busy_rounds.append(one_round(leaves, args.how)['seconds'])

    thread = threading.Thread(target=transfers, daemon=True)
    thread.start()
    beside = device_loop_rate()
    stop.set()
    thread.join(120)
    result['loop'] = {
        'calls_per_s_alone':
            alone, 'calls_per_s_beside_transfers':
                beside, 'beside_over_alone':
                    beside / alone, 'transfers_meanwhile':
                        len(busy_rounds), 'transfer_s_meanwhile_median':
                            sorted(busy_rounds)[len(busy_rounds) // 2] if busy_rounds else None
    }
  print('RESULT ' + json.dumps(result), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
