"""Peak extra host memory of a jaxckpt save, as a multiple of the state's size.

    python -m benchmarks.memory --config=120m --repeats=2

For each repeat a fresh `CheckpointManager` (async) saves the trainer's real state three times:
its first save, which allocates the host staging buffers, then two steady-state saves, which
reuse them. For each save:

  held_before  RSS the manager already held when save() was called (its staging buffers, kept
               from one save to the next), over the RSS before the manager existed;
  growth       the peak RSS during save() + wait_until_finished() over the RSS at the call
               (common.peak_rss_during: sampled and the kernel's exact high-water mark);
  peak_extra   held_before + growth: all the memory checkpointing needs at its peak. The
               contract's target is <= 1x the state: one staged copy and nothing more.

RSS is anonymous memory; the page cache that written files occupy is not counted (the kernel
can drop it). The state itself lives in host memory on CPU and is in every baseline.
Writes benchmarks/results/memory.json and memory.png.
"""

import argparse
import gc
import shutil
import sys
import tempfile

import psutil

from benchmarks import baselines
from benchmarks.checkpoint import options, variant_name, warm_up
from benchmarks.common import (RESULTS_DIR, OtherLoad, _release_free_heap, median, peak_rss_during,
                               plot_bars, print_table, write_results)
from benchmarks.states import train_state
from jaxckpt.checkpoint import CheckpointManager

COLUMNS = [
    'name', 'op', 'x_state', 'peak_extra_bytes', 'held_before_bytes', 'growth_bytes',
    'held_after_bytes', 'staged_bytes', 'target', 'met'
]
TARGET = 1.0  # peak extra memory <= 1 x the state: one staged copy...
# ...where "one copy" allows each leaf's padding to a 4 KiB page (the raw store's O_DIRECT
# buffers) and the manager's small bookkeeping: 1% of the state, 15 MB for andrea_120m.
SLACK = 0.01


def _rss() -> int:
  _release_free_heap()
  return psutil.Process().memory_info().rss


def one_manager(state, nbytes: int, scratch, saves: int = 3, storage: str = 'auto') -> list[dict]:
  """Rows for the first and following saves of one fresh manager."""
  work = baselines._fresh_dir(scratch, 'jaxckpt-memory')
  gc.collect()
  base = _rss()  # before the manager exists: the state and the libraries only
  mgr = CheckpointManager(work, options(storage, mode='async', keep=1))
  rows = []
  try:
    for i in range(saves):
      baselines._settle([work], nbytes)
      held_before = _rss() - base

      def save():
        mgr.save(i + 1, state, run_state={'data_position': i + 1})
        mgr.wait_until_finished()

      _, growth = peak_rss_during(save)
      peak = max(0, held_before) + growth
      rows.append({
          'name': variant_name(storage),
          'op': 'save (first)' if i == 0 else 'save (steady state)',
          'peak_extra_bytes': peak,
          'held_before_bytes': held_before,
          'growth_bytes': growth,
          'held_after_bytes': _rss() - base,
          'staged_bytes': mgr._stager.nbytes(),
          'x_state': peak / nbytes,
          'target': f'<= {TARGET:g}x (+{SLACK:.0%})',
          'met': peak / nbytes <= TARGET + SLACK,
      })
  finally:
    mgr.close()
    shutil.rmtree(work, ignore_errors=True)
  return rows


def summarize(samples: list[dict], nbytes: int) -> list[dict]:
  """One row per (variant, op): the median of every byte count, judged on the median peak."""
  out = []
  for key in dict.fromkeys((r['name'], r['op']) for r in samples):
    same = [r for r in samples if (r['name'], r['op']) == key]
    row = dict(same[0])
    for key in ('peak_extra_bytes', 'held_before_bytes', 'growth_bytes', 'held_after_bytes'):
      row[key] = median([r[key] for r in same])
    row['max_peak_extra_bytes'] = max(r['peak_extra_bytes'] for r in same)
    row['x_state'] = row['peak_extra_bytes'] / nbytes
    row['met'] = row['x_state'] <= TARGET + SLACK
    row['samples'] = len(same)
    out.append(row)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', choices=['12m', '120m'], default='120m')
  parser.add_argument('--repeats', type=int, default=2, help='fresh managers')
  parser.add_argument(
      '--storage',
      choices=['auto', 'raw', 'orbax', 'both'],
      default='auto',
      help="jaxckpt's array storage (CheckpointOptions.storage)")
  parser.add_argument('--scratch-root', default='/tmp')
  parser.add_argument('--name', default='memory')
  args = parser.parse_args(argv)

  storages = ['raw', 'orbax'] if args.storage == 'both' else [args.storage]
  _, state, nbytes = train_state(args.config)
  scratch = tempfile.mkdtemp(prefix='jaxckpt-memory-', dir=args.scratch_root)
  try:
    warm_up(scratch, storages)
    with OtherLoad() as load:
      samples = [
          r for _ in range(args.repeats) for storage in storages
          for r in one_manager(state, nbytes, scratch, storage=storage)
      ]
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  rows = summarize(samples, nbytes)
  title = (f'andrea_{args.config} state {nbytes / 1e9:.3g} GB: peak extra host memory of a '
           f'jaxckpt save (x state); median of {args.repeats} managers')
  print(title)
  print_table(rows, COLUMNS)
  if load.share > 0.1:
    print(f'warning: other processes used {load.share:.0%} of the CPU', file=sys.stderr)
  meta = {
      'config': args.config, 'state_bytes': nbytes, 'repeats': args.repeats, 'storages': storages,
      'other_cpu_share': load.share, 'samples': samples
  }
  path = write_results(args.name, rows, meta)
  plot_bars(rows, RESULTS_DIR / f'{args.name}.png', title, value='x_state', unit='x state')
  print(f'wrote {path} and {args.name}.png')


if __name__ == '__main__':
  main()
