"""Saving one state from 2 jax.distributed processes to one disk, against 1 process and orbax.

    python -m benchmarks.multihost --config=120m --repeats=3

The trainer's andrea_120m adamw state (`benchmarks.states.train_state`: 449 leaves, 1.46 GB, the
trainer's own tree and shardings) on a data-parallel mesh over one CPU device per process, so
every process holds all of it. Each variant is a fresh set of real processes (CPU, gloo
collectives) that saves the same state `--repeats` times into one directory of one disk:

  jaxckpt-1proc    one process writes the whole state (state/process_0.safetensors)
  jaxckpt-2proc    two processes each write the shards they own (about half the bytes each,
                   state/process_<k>.safetensors), then process 0 commits
  orbax-2proc      the same two processes with storage=orbax (orbax's own multi-host commit)

With `--remote`, two more variants upload to a local S3 server (moto, its own niced process), each
process on its own directory (as on hosts with their own disks), timed from save() until the
checkpoint is committed remotely (process 0's manifest, after every part):

  remote-1proc     one process uploads the whole state
  remote-2proc     each of two processes uploads its own part; process 0 commits once all are up

Timed on process 0, after a barrier: from the call of save() until the checkpoint is committed
(`wait_until_finished()`: every part durable, the manifest written). The median of the repeats
is reported, with its GB/s over the state's bytes. Prints a table, writes
benchmarks/results/multihost.json. The machine is shared: `load_before` says how busy it was.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {'jaxckpt-1proc': (1, 'auto'), 'jaxckpt-2proc': (2, 'auto'), 'orbax-2proc': (2, 'orbax')}
REMOTE = {'remote-1proc': (1, 'auto'), 'remote-2proc': (2, 'auto')}
COLUMNS = ['variant', 'processes', 'seconds', 'min', 'gbps', 'bytes', 'vs_1proc', 'vs_orbax']


def worker(variant: str, process: int, count: int, coordinator: str, directory: str, repeats: int,
           config: str) -> None:
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.config.update('jax_enable_preemption_service', False)
  if count > 1:
    jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
  from benchmarks.states import train_state
  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions
  from jaxckpt.checkpoint.multihost import client
  from jaxckpt.checkpoint.remote import Parts, Store, Uploader
  _, state, nbytes = train_state(config)
  uploader = None
  if variant in REMOTE:
    directory = f'{directory}/host{process}'
    uploader = Uploader(
        Store(os.environ['BENCH_REMOTE']), parts=Parts(process, count) if count > 1 else None)
  mgr = CheckpointManager(
      directory,
      CheckpointOptions(storage={**VARIANTS, **REMOTE}[variant][1], keep=1),
      on_commit=uploader and (lambda info: uploader.submit(info.step, info.path)))
  for step in range(1, repeats + 1):
    if count > 1:
      client().wait_at_barrier(f'bench/{step}', 600_000)  # everyone starts together
    start = time.perf_counter()
    mgr.save(step, state, {'step': step})
    mgr.wait_until_finished()
    if uploader is not None:
      assert uploader.wait(step, timeout=900), uploader.error
    seconds = time.perf_counter() - start
    if process == 0:
      print('RESULT ' + json.dumps({'step': step, 'seconds': seconds, 'bytes': nbytes}), flush=True)
  mgr.close()
  if uploader is not None:
    uploader.close()


def run_variant(variant: str, repeats: int, config: str, scratch: Path) -> dict:
  count = {**VARIANTS, **REMOTE}[variant][0]
  directory = scratch / variant
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO))
  procs = [
      subprocess.Popen([
          sys.executable, '-m', 'benchmarks.multihost', '--worker', variant,
          str(k),
          str(count), f'127.0.0.1:{port}',
          str(directory),
          str(repeats), config
      ],
                       cwd=REPO,
                       env=env,
                       stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT,
                       text=True) for k in range(count)
  ]
  outputs = [p.communicate(timeout=1800)[0] for p in procs]
  if any(p.returncode for p in procs):
    raise SystemExit(f'{variant} failed:\n' + '\n'.join(o[-3000:] for o in outputs))
  results = [json.loads(l[7:]) for l in outputs[0].splitlines() if l.startswith('RESULT ')]
  shutil.rmtree(directory, ignore_errors=True)
  seconds = [r['seconds'] for r in results]
  nbytes = results[0]['bytes']
  median = statistics.median(seconds)
  return {
      'variant': variant, 'processes': count, 'seconds': median, 'min': min(seconds),
      'gbps': nbytes / median / 1e9, 'bytes': nbytes, 'all_seconds': seconds
  }


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='120m', help='tiny | 12m | 120m')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--scratch', default=None, help='directory on the disk to measure')
  parser.add_argument('--remote', action='store_true', help='also the uploads to a local S3')
  args = parser.parse_args()
  from benchmarks.common import print_table, write_results
  scratch = Path(tempfile.mkdtemp(prefix='jaxckpt-multihost-', dir=args.scratch))
  load_before = os.getloadavg()[0]
  server = None
  try:
    rows = [run_variant(v, args.repeats, args.config, scratch) for v in VARIANTS]
    if args.remote:
      from benchmarks.remote import BUCKET, Server
      server = Server()  # sets AWS_ENDPOINT_URL and credentials for the workers
      os.environ['BENCH_REMOTE'] = f's3://{BUCKET}/multihost'
      rows += [run_variant(v, args.repeats, args.config, scratch) for v in REMOTE]
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
    if server is not None:
      server.stop()
  by = {r['variant']: r for r in rows}
  for r in rows:
    one = by['remote-1proc' if r['variant'] in REMOTE else 'jaxckpt-1proc']
    r['vs_1proc'] = one['seconds'] / r['seconds']  # > 1: faster than 1 process
    r['vs_orbax'] = by['orbax-2proc']['seconds'] / r['seconds']  # > 1: faster than orbax
  print(f'{args.config}: seconds from save() to committed (median of {args.repeats}); '
        'vs_*: how many times faster than that variant')
  print_table(rows, COLUMNS)
  path = write_results(
      'multihost', rows, {
          'config': args.config, 'repeats': args.repeats, 'load_before': load_before,
          'load_after': os.getloadavg()[0], 'cpus': os.cpu_count()
      })
  print(f'wrote {path}')


if __name__ == '__main__':
  if len(sys.argv) > 1 and sys.argv[1] == '--worker':
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6],
           int(sys.argv[7]), sys.argv[8])
  else:
    main()
