"""What each upload sends of a run's records that only grow: by segment, against whole.

    python -m benchmarks.record_segments [--steps=1000000] [--every=100] [--row=100]

A run of `--steps` steps writes a `--row`-byte line to its loss history (`loss.jsonl`) per step
and a checkpoint every `--every` steps; each checkpoint's upload carries the history as of its
save. Two phases, on a real file that grows as the run's does:

1. `plan`: every upload of the run through `segments.Segments.plan` (what `objects.upload` writes
   of the record: the new segment and the ones it merges, read from the local file), no store.
   Per upload: the bytes sent, the segments its commit names, the seconds planning took.
   `whole` is what sending the record whole would send: its size at that upload.
2. `store`: the first `--store_uploads` uploads through `objects.upload` to a path store (a
   tiny checkpoint beside the record), then every one of their commits downloaded and its record
   compared, byte for byte, with the file's prefix at its save. The bytes under `records/` that
   each upload added are counted from the store's listing.

Target: no upload sends more than the longest segment (`segments.SEGMENT_BYTES`, 8 MiB) however
long the run, and the whole run sends under log2(uploads) + 1 times the record's bytes (sending
it whole: uploads / 2 times). Prints a table, writes
benchmarks/results/record_segments.json.
"""

import argparse
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

COLUMNS = [
    'phase', 'uploads', 'record_bytes', 'mean_sent', 'max_sent', 'last_sent', 'whole_last',
    'run_sent', 'run_whole', 'max_segments', 'plan_ms', 'identical', 'wall_s', 'target', 'met'
]


def _grow(path: Path, rows: int, row: int, at: int) -> None:
  with open(path, 'ab') as f:
    f.write(b''.join(f'{{"step": {at + i}}}'.encode().ljust(row - 1) + b'\n' for i in range(rows)))


def plan_phase(root: Path, steps: int, every: int, row: int) -> dict:
  """Every upload of a run of `steps` steps, planned."""
  from jaxckpt.checkpoint.remote.segments import SEGMENT_BYTES, Appended, Segments
  record, segments, sent, counts, seconds = root / 'loss.jsonl', Segments(), [], [], []
  for k in range(1, steps // every + 1):
    _grow(record, every, row, (k - 1) * every + 1)
    r = Appended.of(record)
    t0 = time.perf_counter()
    held, writes = segments.plan('loss.jsonl', r)
    seconds.append(time.perf_counter() - t0)
    segments.committed({}, {'loss.jsonl': (r, held)})
    sent.append(sum(len(b) for b in writes.values()))
    counts.append(len(held))
  size = record.stat().st_size
  n = len(sent)
  return {
      'phase': 'plan', 'uploads': n, 'record_bytes': size, 'mean_sent': statistics.mean(sent),
      'max_sent': max(sent), 'last_sent': sent[-1], 'whole_last': size, 'run_sent': sum(sent),
      'run_whole': sum(every * row * k for k in range(1, n + 1)), 'max_segments': max(counts),
      'plan_ms': 1e3 * statistics.mean(seconds), 'all_sent_tail': sent[-16:],
      'target': 'max_sent <= 8 MiB and run_sent < (log2(uploads) + 1) x record',
      'met': max(sent) <= SEGMENT_BYTES and sum(sent) < (math.log2(n) + 1) * size
  }


def store_phase(root: Path, uploads: int, every: int, row: int) -> dict:
  """`uploads` uploads through `objects.upload`, then the newest commit downloaded."""
  import jax.numpy as jnp

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
  from jaxckpt.checkpoint.remote import Store, objects
  from jaxckpt.checkpoint.remote.segments import SEGMENTS, Appended, Segments
  ckpt, record = root / 'checkpoints', root / 'store-loss.jsonl'
  with CheckpointManager(ckpt, CheckpointOptions(every_steps=1, keep=1)) as mgr:
    mgr.save(1, {'w': jnp.zeros((16,), jnp.float32)}, {'step': 1})
  store, segments, sent, sizes = Store(str(root / 'remote')), Segments(), [], []
  step_dir = ckpt / layout.step_dirname(1)
  for k in range(1, uploads + 1):
    _grow(record, every, row, (k - 1) * every + 1)
    before = set(store.list(SEGMENTS + '/'))
    objects.upload(store, step_dir, {'loss.jsonl': Appended.of(record)}, segments=segments)
    added = set(store.list(SEGMENTS + '/')) - before
    sent.append(sum(int(b) - int(a) for a, b, _ in (x.rsplit('/', 1)[1].split('-') for x in added)))
    sizes.append(record.stat().st_size)
  # Each upload replaced step 1's commit (one checkpoint, uploaded again): the newest is checked.
  whole = record.read_bytes()
  _, got = objects.download(store, 1, root / 'fresh')
  return {
      'phase': 'store', 'uploads': uploads, 'record_bytes': sizes[-1],
      'mean_sent': statistics.mean(sent), 'max_sent': max(sent), 'last_sent': sent[-1],
      'whole_last': sizes[-1], 'run_sent': sum(sent), 'run_whole': sum(sizes),
      'max_segments': len(objects.inspect(store, 1)[2]['records']['loss.jsonl']['segments']),
      'identical': got['loss.jsonl'] == whole
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--steps', type=int, default=1_000_000)
  ap.add_argument('--every', type=int, default=100, help='steps between checkpoints')
  ap.add_argument('--row', type=int, default=100, help='bytes per loss line')
  ap.add_argument('--store_uploads', type=int, default=40)
  ap.add_argument('--scratch', default=tempfile.gettempdir(), help='a directory on the disk')
  args = ap.parse_args(argv)
  if args.steps < args.every or args.every < 1 or args.row < 16 or args.store_uploads < 1:
    ap.error('use --steps >= --every >= 1, --row >= 16 and --store_uploads >= 1')
  from benchmarks.common import print_table, write_results
  root = Path(tempfile.mkdtemp(prefix='jaxckpt-record-segments-', dir=args.scratch))
  try:
    rows = []
    for phase, n in ((plan_phase, args.steps), (store_phase, args.store_uploads)):
      t0 = time.perf_counter()
      rows.append({**phase(root, n, args.every, args.row), 'wall_s': time.perf_counter() - t0})
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f'bytes of loss.jsonl sent per upload: {args.steps} steps, a checkpoint every '
        f'{args.every}, {args.row} B per line')
  print_table(rows, COLUMNS)
  path = write_results(
      'record_segments', rows,
      {'steps': args.steps, 'every': args.every, 'row': args.row, 'met': rows[0]['met']})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
