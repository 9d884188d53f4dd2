"""Where a jaxckpt save and restore of the real state spend their time.

    python -m benchmarks.profile_save --config=120m --saves=3

Two views of the same path:

1. Phases (benchmarks.save_phases): wall seconds of the host copy, orbax's save (tensorstore
   writing the arrays), the checksum pass (`manifest.file_table`: reading every file back for
   its CRC-32, and fsyncing it), directory fsyncs and the durable JSON writes, for the first save
   of a fresh async manager and for steady-state saves (median), and for a cold restore (CRC
   verification, then orbax's read). Every save starts from `settle` like the benchmarks.
2. py-spy (when installed: `pip install py-spy`): one more steady-state save sampled from
   outside (`py-spy record --idle --threads --nonblocking`), summarized per Python thread by the
   innermost jaxckpt/orbax/tensorstore frames. The raw collapsed stacks are kept in
   benchmarks/results/<name>-pyspy.txt for a flame graph (flamegraph.pl or speedscope).

Writes benchmarks/results/<name>.json (default profile_save).
"""

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from benchmarks import baselines
from benchmarks.checkpoint import options, variant_name, warm_up
from benchmarks.common import RESULTS_DIR, OtherLoad, median, print_table, write_results
from benchmarks.save_phases import SavePhases
from benchmarks.states import train_state
from jaxckpt.checkpoint import CheckpointManager


def _timed_save(mgr, step, state):
  with SavePhases() as phases:
    start = time.perf_counter()
    mgr.save(step, state)
    blocked = time.perf_counter() - start
    mgr.wait_until_finished()
    wall = time.perf_counter() - start
  return {'blocking (save() returns)': blocked, 'wall': wall, **phases.breakdown(wall)}


def phase_profile(trainer, state, nbytes, scratch, saves: int, storage: str = 'auto'):
  work = baselines._fresh_dir(scratch, 'profile')
  mgr = CheckpointManager(work, options(storage, mode='async', keep=0))
  try:
    baselines._settle([work], nbytes)
    first = _timed_save(mgr, 1, state)
    steady = []
    for step in range(2, saves + 2):
      shutil.rmtree(mgr.step_dir(step - 1))
      baselines._settle([work], nbytes)
      steady.append(_timed_save(mgr, step, state))
    abstract = trainer.abstract_state()
    reader = CheckpointManager(work, writer=False)
    baselines._settle([work], nbytes)
    with SavePhases() as phases:
      start = time.perf_counter()
      jax.block_until_ready(reader.restore(saves + 1, abstract)[0])
      wall = time.perf_counter() - start
    restore = {'wall': wall, **phases.breakdown(wall)}
  finally:
    mgr.close()
  names = list(dict.fromkeys(k for s in [first, *steady] for k in s))
  steady_median = {k: median([s.get(k, 0.0) for s in steady]) for k in names}
  return work, mgr, first, steady_median, restore


# What a sample was doing, by the first rule whose pattern its stack matches (frames are
# "function (file:line)"; py-spy shortens site-packages paths, so match on function names).
_CATEGORIES = (
    ('waiting for py-spy to attach', r'pyspy_profile \([^;]*$'),
    ('stage (host copy)', r'HostStager\.stage'),
    ('checksum pass (file_table: read + crc32 + fsync)', r'file_table'),
    ('raw store write (pwrite + crc32 + fsync)', r'rawstore\.py'),
    ('manifest / run_state.json', r'sealed_json|write_json_durably|write_file_durably|'
     r'manifest\.build'),
    ('retention / cleanup', r'_apply_retention|rmtree'),
    ('orbax save (incl. its threads)', r'Checkpointer\.save|^(asyncio|np_type_handler|'
     r'write_metadata|array_type_handler|thread_pool)'),
    ('main thread waiting for the commit', r'wait_until_finished'),
)


def _frame_label(frame: str) -> str:
  """'save (checkpointer.py:306)' -> 'save (checkpointer.py)': samples of a function merged."""
  return re.sub(r':\d+\)$', ')', frame.strip())


def summarize_pyspy(raw: Path, top: int = 6) -> dict:
  """Per Python thread: samples by category (_CATEGORIES) and, within each, innermost frames.

    py-spy sees Python threads only; time inside tensorstore's C++ workers shows as the Python
    frame that waits for them (sampled with --idle). The save thread (`jaxckpt-save_0`) is the
    critical path from save() returning to the commit; orbax runs its event loop on it.
    """
  per_thread = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
  for line in raw.read_text().splitlines():
    stack, _, count = line.rpartition(' ')
    if not stack or not count.isdigit():
      continue
    stack = re.sub(r'^thread \((?:0x[0-9a-f]+|\d+)\): ', '', stack)
    thread = stack.split(';')[0]
    category = next((name for name, pattern in _CATEGORIES if re.search(pattern, stack)), 'other')
    if category.startswith('waiting for py-spy'):
      continue
    per_thread[thread][category][_frame_label(stack.split(';')[-1])] += int(count)
  out = {}
  for thread, categories in per_thread.items():
    total = sum(sum(c.values()) for c in categories.values())
    out[thread] = {
        'samples':
            total, 'categories': [{
                'category': c, 'samples': sum(f.values()), 'share': sum(f.values()) / total,
                'top_frames': [{'frame': k, 'samples': n} for k, n in f.most_common(top)]
            } for c, f in sorted(categories.items(), key=lambda kv: -sum(kv[1].values()))]
    }
  return dict(sorted(out.items(), key=lambda kv: -kv[1]['samples']))


def pyspy_profile(state, nbytes, work: Path, mgr, step: int, out: Path) -> dict | None:
  exe = shutil.which('py-spy') or str(Path(sys.executable).with_name('py-spy'))
  if not os.path.exists(exe):
    print('py-spy not found: skipping the sampled profile', file=sys.stderr)
    return None
  baselines._settle([work], nbytes)
  spy = subprocess.Popen([
      exe, 'record', '--pid',
      str(os.getpid()), '--rate', '200', '--idle', '--threads', '--nonblocking', '--format', 'raw',
      '-o',
      str(out)
  ],
                         stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
  time.sleep(1.5)  # let it attach
  start = time.perf_counter()
  mgr.save(step, state)
  mgr.wait_until_finished()
  wall = time.perf_counter() - start
  spy.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
  _, err = spy.communicate(timeout=60)
  if not out.exists():
    print(f"py-spy failed: {err.decode(errors='replace')[-500:]}", file=sys.stderr)
    return None
  return {'wall': wall, 'raw': str(out), 'summary': summarize_pyspy(out)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', choices=['tiny', '12m', '120m'], default='120m')
  parser.add_argument('--saves', type=int, default=3, help='steady-state saves timed')
  parser.add_argument(
      '--storage',
      choices=['auto', 'raw', 'orbax'],
      default='auto',
      help="jaxckpt's array storage (CheckpointOptions.storage)")
  parser.add_argument('--no-pyspy', action='store_true')
  parser.add_argument('--scratch-root', default='/tmp')
  parser.add_argument('--name', default='profile_save')
  args = parser.parse_args(argv)

  trainer, state, nbytes = train_state(args.config)
  scratch = tempfile.mkdtemp(prefix='jaxckpt-profile-', dir=args.scratch_root)
  spy = None
  try:
    warm_up(scratch, [args.storage])
    with OtherLoad() as load:
      work, mgr, first, steady, restore = phase_profile(trainer, state, nbytes, scratch, args.saves,
                                                        args.storage)
      if not args.no_pyspy:
        with mgr:
          shutil.rmtree(mgr.step_dir(args.saves + 1))
          spy = pyspy_profile(state, nbytes, work, mgr, args.saves + 2,
                              RESULTS_DIR / f'{args.name}-pyspy.txt')
  finally:
    shutil.rmtree(scratch, ignore_errors=True)

  print(f'{variant_name(args.storage)}, andrea_{args.config}: {nbytes / 1e9:.3g} GB; other '
        f'processes used '
        f'{load.share:.0%} of the CPU')
  rows = [{
      'phase': k, 'first_s': first.get(k, 0.0), 'steady_s': steady.get(k, 0.0),
      'steady_share': steady.get(k, 0.0) / steady['wall']
  } for k in steady if k not in ('wall', 'blocking (save() returns)')]
  rows.append({
      'phase': 'total: save() to committed', 'first_s': first['wall'], 'steady_s': steady['wall'],
      'steady_share': 1.0
  })
  rows.append({
      'phase': '  of which save() blocked', 'first_s': first['blocking (save() returns)'],
      'steady_s': steady['blocking (save() returns)'],
      'steady_share': steady['blocking (save() returns)'] / steady['wall']
  })
  print(f'save, by phase (first save; steady state: median of {args.saves})')
  print_table(rows)
  restore_rows = [{'phase': k, 'seconds': v, 'share': v / restore['wall']}
                  for k, v in restore.items()
                  if k != 'wall']
  restore_rows.append({'phase': 'total: restore (cold)', 'seconds': restore['wall'], 'share': 1.0})
  print('\nrestore (cold), by phase')
  print_table(restore_rows)
  if spy:
    print(f"\npy-spy, one steady-state save ({spy['wall']:.2f} s), per Python thread: what "
          "its samples were doing, and the innermost frames")
    for thread, info in spy['summary'].items():
      print(f"  {thread}: {info['samples']} samples")
      for c in info['categories'][:4]:
        print(f"    {c['share']:6.1%}  {c['category']}")
        for f in c['top_frames'][:4]:
          print(f"              {f['samples']:5d}  {f['frame']}")
  meta = {
      'config': args.config, 'state_bytes': nbytes, 'saves': args.saves, 'storage': args.storage,
      'other_cpu_share': load.share, 'first': first, 'steady': steady, 'restore': restore,
      'pyspy': spy
  }
  path = write_results(args.name, rows + restore_rows, meta)
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
