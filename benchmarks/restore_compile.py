"""A restart's restore and its first compile: one after the other, and overlapped.

    python -m benchmarks.restore_compile --config=120m --repeats=3

A restarted trainer reads its checkpoint and compiles its train step. Before, it did one after
the other: the restore, then the compile at the first step. Now the trainer hands the compile to
the restore (`CheckpointManager.restore(..., meanwhile=trainer.compile_train_step)`): the state
file is read into host memory on a thread of its own, page faults included, while the caller's
thread compiles, and the arrays go to the devices once both are done.

Each row is a fresh process with a committed andrea_120m- or andrea_12m-shaped checkpoint (the
trainer's real state tree, one safetensors file) in the page cache, timed from before the
restore to a compiled step and a restored state:

  * `restore, then compile`: `restore()`, then `compile_train_step()`; the two are also timed
    apart (`restore_s`, `compile_s`);
  * `restore while compiling`: `restore(..., meanwhile=compile_train_step)`.

Each runs with a cold compile (no persistent compilation cache) and with a warm one (a restart
on the same machine type with `JAX_COMPILATION_CACHE_DIR` set, where the compile is a load).
The variants alternate, so drift in the machine's load falls on each. Prints a table and writes
benchmarks/results/restore_compile-<config>.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import print_table, write_results
from benchmarks.restore_buffers import _state_file, _warm, _write

VARIANTS = ('restore, then compile', 'restore while compiling')
COLUMNS = [
    'config', 'compile', 'variant', 'seconds', 'restore_s', 'compile_s', 'saved_s', 'vs_sequential',
    'runs'
]


def child(config: str, variant: str, where: str) -> dict:
  _warm(_state_file(where))
  import jax

  from benchmarks.states import get_config
  from jaxckpt.checkpoint import CheckpointManager
  from jaxckpt.train.state import build_trainer
  trainer = build_trainer(get_config(config))
  abstract = trainer.abstract_state()
  mgr = CheckpointManager(where, writer=False)
  row = {'config': config, 'variant': variant}
  t = time.perf_counter()
  if variant == 'restore while compiling':
    state, _ = mgr.restore(1, abstract, meanwhile=trainer.compile_train_step)
    jax.block_until_ready(state)
  else:
    state, _ = mgr.restore(1, abstract)
    jax.block_until_ready(state)
    row['restore_s'] = time.perf_counter() - t
    t1 = time.perf_counter()
    trainer.compile_train_step()
    row['compile_s'] = time.perf_counter() - t1
  row['seconds'] = time.perf_counter() - t
  return row


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--config', default='120m')
  ap.add_argument('--repeats', type=int, default=3, help='fresh processes per variant')
  ap.add_argument('--scratch', default=tempfile.gettempdir())
  ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
  ap.add_argument('--where', default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(json.dumps(child(args.config, args.child, args.where)))
    return
  got = {}
  with tempfile.TemporaryDirectory(dir=args.scratch) as where:
    _write(args.config, where)
    cache = os.path.join(where, 'jax-cache')
    env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_COMPILATION_CACHE')}
    modes = {
        'cold': {**env, 'JAX_ENABLE_COMPILATION_CACHE': 'false'}, 'cached': {
            **env, 'JAX_COMPILATION_CACHE_DIR': cache,
            'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'
        }
    }
    for repeat in range(args.repeats + 1):  # the first round fills the cache; not counted
      for mode, mode_env in modes.items():
        for variant in VARIANTS:
          done = subprocess.run([
              sys.executable, '-m', 'benchmarks.restore_compile', f'--config={args.config}',
              f'--child={variant}', f'--where={where}'
          ],
                                env=mode_env,
                                capture_output=True,
                                text=True,
                                timeout=1800,
                                check=False)
          if done.returncode:
            raise SystemExit(f'{variant}: child failed:\n{done.stderr[-3000:]}')
          row = {**json.loads(done.stdout.strip().splitlines()[-1]), 'compile': mode}
          print(json.dumps(row), flush=True)
          if repeat:
            got.setdefault((mode, variant), []).append(row)
  rows = []
  for (mode, variant), runs in got.items():
    median = lambda key: statistics.median(r[key] for r in runs) if key in runs[0] else None
    rows.append({
        'config': args.config, 'compile': mode, 'variant': variant, 'seconds': median('seconds'),
        'restore_s': median('restore_s'), 'compile_s': median('compile_s'), 'runs': len(runs)
    })
  for row in rows:
    sequential = next(
        r for r in rows if r['compile'] == row['compile'] and r['variant'] == VARIANTS[0])
    row['saved_s'] = sequential['seconds'] - row['seconds']
    row['vs_sequential'] = row['seconds'] / sequential['seconds']
  print_table(rows, COLUMNS)
  runs = {f'{mode}/{variant}': r for (mode, variant), r in got.items()}
  print(f'wrote {write_results(f"restore_compile-{args.config}", rows, {"runs": runs})}')


if __name__ == '__main__':
  main()
