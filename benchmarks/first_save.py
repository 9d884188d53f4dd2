"""The first `save()` of a process against a steady one, with and without `prepare`.

    python -m benchmarks.first_save --configs=12m,120m --repeats=3

The first save of a process used to allocate the staging buffer and fault its pages in, on the
caller's thread (andrea_120m: 3.6 s against 0.15-0.56 s for later saves). `prepare(abstract)`
does that on a background thread once the shapes are known; a trainer calls it before its first
step compiles. Each measurement is a fresh process (the first save is once per process) holding
the trainer's real andrea_12m / andrea_120m state tree (`trainer.abstract_state()`: names, shapes,
dtypes, shardings), each leaf a filled array (no compression in the store: the values do not
change the timing). In the child:

  * `prepare`: `mgr.prepare(abstract)` and then a wait for its thread, standing in for the
    compile it overlaps (`prepare_call_s`: the call itself; `prepare_s`: until the thread ends);
  * the first save, timed from the call of `save()` to its return (the caller's block);
  * `--steady` more saves, each after the previous one committed, timed the same way (median).

Target: first / steady <= 1.5 on andrea_120m, <= 3 on andrea_12m (other one-time costs weigh more
there), with prepare. Prints a table and writes benchmarks/results/first_save.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from benchmarks.common import OtherLoad, print_table, write_results
from benchmarks.states import get_config
from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions

TARGETS = {'12m': 3.0, '120m': 1.5}
COLUMNS = [
    'config', 'prepare', 'bytes', 'first_s', 'steady_s', 'ratio', 'target', 'met', 'prepare_call_s',
    'prepare_s', 'runs', 'other_cpu_share'
]


def real_state(config: str):
  """(abstract state, state) of the trainer's `config`, every leaf filled (pages touched)."""
  from jaxckpt.train.state import build_trainer
  abstract = build_trainer(get_config(config)).abstract_state()

  def fill(s):
    # np.full writes every page: zeros would be untouched pages and make copies look free.
    host = np.full(s.shape, 1 if np.issubdtype(s.dtype, np.integer) else 0.01, s.dtype)
    return jax.device_put(host, s.sharding)

  state = jax.tree.map(fill, abstract)
  jax.block_until_ready(state)
  return abstract, state


def child(config: str, prepare: bool, steady: int, scratch: str) -> dict:
  """One process: (prepare,) the first save, then `steady` saves; the seconds each blocked."""
  abstract, state = real_state(config)
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  out = {'config': config, 'prepare': prepare, 'bytes': nbytes}
  with tempfile.TemporaryDirectory(dir=scratch) as where, OtherLoad() as load:
    mgr = CheckpointManager(where, CheckpointOptions(keep=1))
    if prepare:
      t = time.perf_counter()
      out['prepared'] = mgr.prepare(abstract)
      out['prepare_call_s'] = time.perf_counter() - t
      mgr._stager.wait_prepared()  # the compile it overlaps in a trainer is longer than this
      out['prepare_s'] = time.perf_counter() - t
    blocked = []
    for step in range(1 + steady):
      mgr.wait_until_finished()  # the previous write is not part of this save's block
      t = time.perf_counter()
      mgr.save(step, state)
      blocked.append(time.perf_counter() - t)
    out['mode'] = mgr.mode_used
    mgr.close()
  out.update(first_s=blocked[0], steady_s=statistics.median(blocked[1:]), steady_runs=blocked[1:])
  out['other_cpu_share'] = load.share
  return out


def run_child(config: str, prepare: bool, steady: int, scratch: str) -> dict:
  argv = [
      sys.executable, '-m', 'benchmarks.first_save', '--child', f'--configs={config}',
      f'--steady={steady}', f'--scratch={scratch}'
  ] + (['--prepare'] if prepare else [])
  done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
  if done.returncode:
    raise SystemExit(f'{config} prepare={prepare}: child failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--configs', default='12m,120m')
  ap.add_argument('--repeats', type=int, default=3, help='fresh processes per variant')
  ap.add_argument('--repeats_120m', type=int, default=0, help='for 120m, if not --repeats')
  ap.add_argument('--steady', type=int, default=3, help='saves after the first, per process')
  ap.add_argument('--scratch', default=tempfile.gettempdir(), help='where checkpoints go')
  ap.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  ap.add_argument('--prepare', action='store_true', help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(json.dumps(child(args.configs, args.prepare, args.steady, args.scratch)))
    return
  rows, runs = [], []
  for config in args.configs.split(','):
    repeats = args.repeats_120m if config == '120m' and args.repeats_120m else args.repeats
    got = {False: [], True: []}
    for _ in range(repeats):  # alternating, so that drift in the machine's load falls on both
      for prepare in (False, True):
        got[prepare].append(run_child(config, prepare, args.steady, args.scratch))
        runs.append(got[prepare][-1])
        print(json.dumps(runs[-1]), flush=True)
    for prepare in (False, True):
      r = got[prepare]
      first = statistics.median(x['first_s'] for x in r)
      steady = statistics.median(x['steady_s'] for x in r)
      ratio = statistics.median(x['first_s'] / x['steady_s'] for x in r)
      rows.append({
          'config': config, 'prepare': 'yes' if prepare else 'no', 'bytes': r[0]['bytes'],
          'first_s': first, 'steady_s': steady, 'ratio': ratio,
          'target': TARGETS.get(config) if prepare else None, 'met':
              (ratio <= TARGETS[config]) if prepare and config in TARGETS else None,
          'prepare_call_s': statistics.median(x['prepare_call_s'] for x in r) if prepare else None,
          'prepare_s': statistics.median(x['prepare_s'] for x in r) if prepare else None,
          'runs': len(r), 'other_cpu_share': max(x['other_cpu_share'] for x in r
                                                ), 'modes': sorted({x['mode'] for x in r})
      })
  print_table(rows, COLUMNS)
  path = write_results('first_save', rows, {'runs': runs, 'steady': args.steady})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
