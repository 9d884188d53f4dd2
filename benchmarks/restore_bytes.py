"""Bytes each process reads from the remote tier when a job of fresh machines resumes.

    python -m benchmarks.restore_bytes [--params=120.8e6] [--processes=2] [--layouts=data,model]

`--processes` real jax.distributed processes (one CPU device each, gloo collectives), each with
its own directory (ROOT/host{k}, its host's own disk), save an andrea_120m-shaped adamw state
(`benchmarks.common.synthetic_state(120.8e6, 449)`: 1.45 GB of float32) on a 1-D mesh ('data',)
in one of two layouts:

- `data`: every leaf replicated (data parallelism: every process needs every byte);
- `model`: every leaf whose leading dimension divides by the process count split over 'data'
  (the mesh splits the model: each process needs its share), the few others replicated.

The complete checkpoint is uploaded to a moto S3 server (in this process, on loopback), as the
hosts' uploaders would have. Then every host's directory is wiped (the job's VMs replaced) and
the job restores, in two ways, each timed from a common barrier to the state on every device:

1. `parts` (what `--remote` on each host's own disk does): `peers.restore_dir` with the remote
   as its source. Process 0 commits the checkpoint's own files alone; each part is read from
   the remote once in the job, by a process that needs it, and sent to the others that need it
   over the collectives (`sends`).
2. `whole` (what it did before): every process downloads the whole checkpoint
   (`objects.download`) and restores from it.

Every shard restored is checked against the CRC-32 the save recorded. Reported per row: the
bytes each process read from the remote (`remote_bytes`, and the largest share of the state
`max_share`), the job's total, and `job_s` (the slowest process). Target: in `parts`, no
process reads more than 1.25/N of the state (about 1/N: each byte once, spread over the job).

What the times do not say: the server is Python on the same two cores as the workers, and the
collective is gloo over loopback; the bytes are what carries to a real bucket.

Prints a table, writes benchmarks/results/restore_bytes.json.
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.peers import (_directory, build_state, check_restored, local_s3, run_workers,
                              upload_whole)

BUCKET = 'bench-restore-bytes'
MODES = ('parts', 'whole')
LAYOUTS = ('data', 'model')
SLACK = 1.25  # the most a process may read, in shares of 1/N of the state
COLUMNS = [
    'layout', 'mode', 'processes', 'state_bytes', 'remote_bytes', 'max_share', 'job_remote_bytes',
    'peers_bytes', 'job_s', 'target', 'met'
]


def worker(mode: str, process: int, count: int, coordinator: str, root: str, params: float,
           leaves: int, url: str, timeout: float, layout_name: str) -> None:
  """`save` (step 1; the state's spec and this process's shard CRCs to ROOT), or one restore
  in a mode of MODES, timed (prints RESULT {json})."""
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, multihost, peers
  from jaxckpt.checkpoint.remote import Store, objects, partial
  root_dir = Path(root)
  directory = _directory(root_dir, process)
  mesh = Mesh(np.asarray(jax.devices()), ('data',))

  def sharding(shape):
    split = layout_name == 'model' and len(shape) > 0 and shape[0] % count == 0
    return NamedSharding(mesh, P('data') if split else P())

  if mode == 'save':
    state = build_state(root_dir, process, params, leaves, sharding)
    with CheckpointManager(directory, CheckpointOptions(keep=0,
                                                        barrier_timeout_secs=timeout)) as mgr:
      mgr.save(1, state)
    print('RESULT {}', flush=True)
    return

  spec = json.loads((root_dir / 'spec.json').read_text())
  target = {
      n: jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=sharding(tuple(s)))
      for n, (s, d) in spec.items()
  }
  store = Store(url)
  multihost.client().wait_at_barrier(f'bench/restore_bytes/{mode}', int(timeout * 1000))
  start = time.perf_counter()
  if mode == 'parts':
    remote = partial.peer_source(store, 1, inspect=process == 0)
    got = peers.restore_dir(directory, target, multihost.Group(timeout), remote)
    if got is None:
      raise SystemExit(f'process {process}: nothing to restore from the remote')
    step_dir, sources = got.path, got.sources
  else:
    step_dir, _ = objects.download(store, 1, directory)
    fetched = sum(p.stat().st_size for p in step_dir.rglob('*') if p.is_file())
    sources = {'own': 0, 'peers': 0, 'remote': fetched}
  mgr = CheckpointManager(directory, CheckpointOptions(barrier_timeout_secs=timeout))
  state, _ = mgr.restore(step_dir, target)
  jax.block_until_ready(state)
  done = time.perf_counter()
  mgr.close()
  check_restored(root_dir, process, state)
  print('RESULT ' + json.dumps({'seconds': done - start, **sources}), flush=True)


def _wipe(root: Path, count: int) -> None:
  for k in range(count):
    shutil.rmtree(root / f'host{k}', ignore_errors=True)


def _row(layout_name: str, mode: str, runs: list[list[dict]], count: int, state_bytes: int) -> dict:
  first = runs[0]
  remote = [r['remote'] for r in first]
  row = {
      'layout': layout_name, 'mode': mode, 'processes': count, 'state_bytes': state_bytes,
      'remote_bytes': remote, 'max_share': max(remote) / state_bytes,
      'job_remote_bytes': sum(remote), 'peers_bytes': [r['peers'] for r in first],
      'job_s': statistics.median(max(r['seconds'] for r in run) for run in runs),
      'all_job_s': [max(r['seconds'] for r in run) for run in runs]
  }
  if mode == 'parts':
    row.update(target=f'max_share <= {SLACK:g}/{count}', met=row['max_share'] <= SLACK / count)
  return row


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--params', type=float, default=120.8e6, help='model parameters (x3: adamw)')
  ap.add_argument('--leaves', type=int, default=449)
  ap.add_argument('--processes', type=int, default=2, choices=(2, 3, 4))
  ap.add_argument('--layouts', default=','.join(LAYOUTS), help=f'some of {",".join(LAYOUTS)}')
  ap.add_argument('--repeats', type=int, default=1, help='rounds of the two restores')
  ap.add_argument('--timeout', type=float, default=900, help='seconds any wait of a worker takes')
  ap.add_argument(
      '--scratch', default=tempfile.gettempdir(), help='where the disks of the hosts are')
  args = ap.parse_args(argv)
  layouts = [x for x in args.layouts.split(',') if x]
  if not layouts or set(layouts) - set(LAYOUTS):
    ap.error(f'--layouts={args.layouts}: use some of {",".join(LAYOUTS)}')
  from benchmarks.common import print_table, write_results
  server = local_s3(BUCKET)
  rows, runs, started = [], {}, time.perf_counter()
  try:
    for layout_name in layouts:
      root = Path(tempfile.mkdtemp(prefix='jaxckpt-restore-bytes-', dir=args.scratch))
      url = f's3://{BUCKET}/{layout_name}'
      try:
        extra = (layout_name,)
        run_workers('save', args, root, url, 'benchmarks.restore_bytes', extra)
        state_bytes = upload_whole(root, args.processes, url)
        print(f'{layout_name}: uploaded {state_bytes / 1e9:.2f} GB', file=sys.stderr, flush=True)
        for mode in MODES:
          runs[f'{layout_name}/{mode}'] = got = []
          for _ in range(args.repeats):
            _wipe(root, args.processes)  # the job's VMs are replaced: every disk is new
            got.append(run_workers(mode, args, root, url, 'benchmarks.restore_bytes', extra))
            print(f'{layout_name}/{mode}: {json.dumps(got[-1])}', file=sys.stderr, flush=True)
          rows.append(_row(layout_name, mode, got, args.processes, state_bytes))
      finally:
        shutil.rmtree(root, ignore_errors=True)
  finally:
    server.stop()
  print(f'{args.processes} processes, every disk wiped, the state restored from the remote: '
        'the bytes each process read from it (remote_bytes, one per process) and the time '
        f'from a common start to the state on every device (job_s, median of {args.repeats})')
  print_table(rows, COLUMNS)
  met = all(r['met'] for r in rows if 'met' in r)
  path = write_results(
      'restore_bytes', rows, {
          'params': args.params, 'leaves': args.leaves, 'processes': args.processes,
          'repeats': args.repeats, 'runs': runs, 'target': f'parts: max_share <= {SLACK:g}/N',
          'met': met, 'wall_s': time.perf_counter() - started
      })
  print(f'wrote {path}')


if __name__ == '__main__':
  if len(sys.argv) > 1 and sys.argv[1] == '--worker':
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6],
           float(sys.argv[7]), int(sys.argv[8]), sys.argv[9], float(sys.argv[10]), sys.argv[11])
  else:
    main()
