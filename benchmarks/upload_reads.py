"""What an upload reads from the local disk: the state from the save's memory, or from the file.

    python -m benchmarks.upload_reads [--states=andrea_12m,andrea_120m] [--repeats=2]

For each state (`benchmarks.common.synthetic_state`: andrea_12m-shaped, 154 MB; andrea_120m-
shaped, 1.46 GB), a `CheckpointManager` saves step 1 (async, host staging: its state file is
written with O_DIRECT from the staging buffer, so the page cache does not hold it), then the
checkpoint is uploaded (`objects.upload`) to a path store on the same disk twice in each repeat:

- `memory`: with `CommitInfo.in_memory`, as the trainer's uploader does while the save's buffer
  still holds the state (until the next save stages over it);
- `disk`: without it, as before (and as an upload that starts after the next save does).

Each upload reports the bytes this process read from storage while it ran (`read_bytes` of
/proc/self/io: every thread, the page cache excluded) and its seconds. The page cache is
evicted before each `disk` upload (`benchmarks.common.evict_page_cache`), so each reads the disk
as the first upload after an O_DIRECT save does. Target: `memory` reads nothing of the state
(under 1% of its bytes). Prints a table, writes benchmarks/results/upload_reads.json.
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

STATES = {'andrea_12m': (12.8e6, 233), 'andrea_120m': (120.8e6, 449)}
COLUMNS = [
    'state', 'mode', 'state_bytes', 'disk_read_bytes', 'read_share', 'upload_s', 'target', 'met'
]


def read_bytes() -> int:
  """Bytes this process has read from storage (/proc/self/io), every thread."""
  with open('/proc/self/io', encoding='ascii') as f:
    return next(int(line.split()[1]) for line in f if line.startswith('read_bytes:'))


def measure(name: str, params: float, leaves: int, repeats: int, scratch: str) -> list[dict]:
  import jax

  from benchmarks.common import evict_page_cache, synthetic_state
  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
  from jaxckpt.checkpoint.remote import Store, objects
  root = Path(tempfile.mkdtemp(prefix='jaxckpt-upload-reads-', dir=scratch))
  try:
    state = {n: jax.device_put(x) for n, x in synthetic_state(int(params), leaves).items()}
    infos = []
    mgr = CheckpointManager(
        root / 'ckpt', CheckpointOptions(mode='async', staging='host'), on_commit=infos.append)
    mgr.save(1, state)
    mgr.wait_until_finished()
    step_dir = root / 'ckpt' / layout.step_dirname(1)
    files = [p for p in step_dir.rglob('*') if p.is_file()]
    state_bytes = sum(p.stat().st_size for p in (step_dir / layout.STATE_DIR).iterdir())
    runs = {'memory': [], 'disk': []}
    for i in range(repeats):
      for mode in runs:
        if mode == 'disk':
          evict_page_cache(files)
        store = Store(str(root / f'remote-{mode}-{i}'))
        before, t0 = read_bytes(), time.perf_counter()
        objects.upload(
            store, step_dir, {}, memory=infos[-1].in_memory if mode == 'memory' else None)
        runs[mode].append((read_bytes() - before, time.perf_counter() - t0))
        shutil.rmtree(root / f'remote-{mode}-{i}')
    mgr.close()
  finally:
    shutil.rmtree(root, ignore_errors=True)
  rows = []
  for mode, got in runs.items():
    disk = max(b for b, _ in got)
    row = {
        'state': name, 'mode': mode, 'state_bytes': state_bytes, 'disk_read_bytes': disk,
        'read_share': disk / state_bytes, 'upload_s': statistics.median(s for _, s in got),
        'all_upload_s': [s for _, s in got], 'all_read_bytes': [b for b, _ in got]
    }
    if mode == 'memory':
      row.update(target='read_share < 0.01', met=row['read_share'] < 0.01)
    rows.append(row)
  return rows


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--states', default=','.join(STATES), help=f'some of {",".join(STATES)}')
  ap.add_argument('--repeats', type=int, default=2)
  ap.add_argument('--scratch', default=tempfile.gettempdir(), help='a directory on the disk')
  args = ap.parse_args(argv)
  names = [x for x in args.states.split(',') if x]
  if not names or set(names) - set(STATES):
    ap.error(f'--states={args.states}: use some of {",".join(STATES)}')
  from benchmarks.common import print_table, write_results
  rows = []
  for name in names:
    rows += measure(name, *STATES[name], args.repeats, args.scratch)
  print('bytes read from storage while each upload ran (the largest over the repeats), and its '
        'seconds (median), to a path store on the same disk')
  print_table(rows, COLUMNS)
  path = write_results('upload_reads', rows,
                       {'repeats': args.repeats, 'met': all(r['met'] for r in rows if 'met' in r)})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
