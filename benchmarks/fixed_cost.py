"""The per-save cost that does not scale with size: jaxckpt and peers on the tiny config's state.

    python -m benchmarks.fixed_cost --repeats=10

The tiny config's adamw state (137k parameters, 89 leaves, 1.6 MB) takes under a millisecond
of disk bandwidth, so what a save and a restore cost here is fixed per-save and per-leaf work:
set-up, metadata, fsyncs, thread hand-offs. jaxckpt (async manager: save to commit, steady
state; restore from a cold cache) is measured beside orbax's synchronous Checkpointer,
torch.save, torch.distributed.checkpoint and safetensors under benchmarks.baselines' rules, and
one steady-state jaxckpt save is broken into phases (benchmarks.save_phases) to show where its
fixed cost goes. Writes benchmarks/results/fixed_cost.json and fixed_cost.png.
"""

import argparse
import gc
import shutil
import sys
import tempfile
import time

from benchmarks import baselines
from benchmarks.checkpoint import jaxckpt_contender, options, variant_name, warm_up
from benchmarks.common import (RESULTS_DIR, OtherLoad, median, plot_bars, print_table, settle,
                               write_results)
from benchmarks.save_phases import SavePhases
from benchmarks.states import as_numpy, train_state
from jaxckpt.checkpoint import CheckpointManager

COLUMNS = ['name', 'op', 'seconds', 'min', 'ms_per_leaf', 'bytes', 'disk_bytes', 'cold']
PEERS = (baselines.orbax_sync, baselines.torch_save, baselines.torch_dcp,
         baselines.safetensors_file)
# The rows shown: what a caller waits for until a save is durable, and a cold restore.
JAXCKPT_SHOWN = ('save-committed', 'save-blocking', 'restore', 'restore-noverify',
                 'save-committed-first')
SHOWN = {('orbax-sync', 'save'), ('orbax-sync', 'restore'), ('torch', 'save'), ('torch', 'restore'),
         ('torch-dcp', 'save'), ('torch-dcp', 'restore'), ('safetensors', 'save'),
         ('safetensors', 'restore')}


def phases_of_steady_save(state, scratch, saves: int = 5, storage: str = 'auto') -> dict:
  """Median seconds per phase of `saves` steady-state saves on one manager."""
  work = baselines._fresh_dir(scratch, 'jaxckpt-phases')
  per_save = []
  with CheckpointManager(work, options(storage, mode='async', keep=1)) as mgr:
    mgr.save(0, state)  # the first save allocates the staging buffers; not counted
    mgr.wait_until_finished()
    for step in range(1, saves + 1):
      settle([work], quiet_s=0.0)
      with SavePhases() as phases:
        start = time.perf_counter()
        mgr.save(step, state)
        mgr.wait_until_finished()
        wall = time.perf_counter() - start
      per_save.append({'wall': wall, **phases.breakdown(wall)})
  shutil.rmtree(work, ignore_errors=True)
  names = list(dict.fromkeys(k for s in per_save for k in s))
  return {k: median([s.get(k, 0.0) for s in per_save]) for k in names}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument(
      '--storage',
      choices=['auto', 'raw', 'orbax'],
      default='auto',
      help="jaxckpt's array storage (CheckpointOptions.storage)")
  parser.add_argument('--scratch-root', default='/tmp')
  parser.add_argument('--name', default='fixed_cost')
  args = parser.parse_args(argv)

  trainer, state, nbytes = train_state('tiny')
  numpy_state = as_numpy(state)
  leaves = len(numpy_state)
  contenders = [*PEERS, jaxckpt_contender(trainer, state, storage=args.storage)]
  shown = SHOWN | {(variant_name(args.storage), op) for op in JAXCKPT_SHOWN}
  scratch = tempfile.mkdtemp(prefix='jaxckpt-fixed-', dir=args.scratch_root)
  try:
    warm_up(scratch, [args.storage])
    for peer in PEERS:  # one untimed round: imports, thread pools
      baselines._guarded(peer, numpy_state, scratch)
    with OtherLoad() as load:
      passes = []
      for _ in range(args.repeats):
        rows = []
        for contender in contenders:
          baselines._empty_dir(scratch)
          gc.collect()
          rows += baselines._guarded(contender, numpy_state, scratch)
        passes.append(rows)
      phases = phases_of_steady_save(state, scratch, storage=args.storage)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  rows = [r for r in baselines._median_rows(passes) if (r['name'], r['op']) in shown]
  for row in rows:
    row['ms_per_leaf'] = row['seconds'] * 1e3 / leaves
  title = (f'tiny config: {nbytes / 1e6:.2g} MB, {leaves} leaves; median of {args.repeats}; '
           f'other processes used {load.share:.0%} of the CPU')
  print(title)
  print_table(rows, COLUMNS)
  print(f'\n{variant_name(args.storage)} steady-state save of the tiny state, by phase '
        '(median of 5 saves)')
  print_table([{'phase': k, 'seconds': v, 'share': v / phases['wall']}
               for k, v in phases.items()
               if k != 'wall'] +
              [{'phase': 'total (save to commit)', 'seconds': phases['wall'], 'share': 1.0}])
  if load.share > 0.1:
    print(f'warning: other processes used {load.share:.0%} of the CPU', file=sys.stderr)
  meta = {
      'config': 'tiny', 'state_bytes': nbytes, 'leaves': leaves, 'repeats': args.repeats,
      'storage': args.storage, 'other_cpu_share': load.share, 'jaxckpt_steady_save_phases': phases
  }
  path = write_results(args.name, rows, meta)
  plot_bars(rows, RESULTS_DIR / f'{args.name}.png', title)
  print(f'wrote {path} and {args.name}.png')


if __name__ == '__main__':
  main()
