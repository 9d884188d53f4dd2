"""A restart of a job of several processes: each one's restore and its first compile, one after
the other and overlapped.

    python -m benchmarks.restore_compile_hosts --config=120m --processes=2 --repeats=2

`benchmarks.restore_compile` measures one process. Across processes a restore reads, on each
process, the byte ranges of the state files its devices hold (`boxrestore.restore`); it used to
run `meanwhile` (the trainer's compile of its first step) first and read after it. Now each
process reads its byte ranges on a thread of its own while its compile runs, and places them
once both are done.

`--processes` real jax.distributed processes (one CPU device each, gloo) save the trainer's real
`config` state tree (every leaf filled) into one shared directory, one state file each. Then, in
fresh jobs, alternating, each timed on every process from a barrier common to all to a restored
state and a compiled step; the job's time is the slowest process's:

  * `restore, then compile`: `restore()`, then `compile_train_step()`;
  * `restore while compiling`: `restore(..., meanwhile=compile_train_step)`.

Each with a cold compile (no persistent compilation cache) and a warm one. The state files are
read once before each job, so they are in the page cache (the disk is out of it); the processes
share this machine's cores, so their compiles and reads compete for them.

`--remote`: a fresh job on one shared, empty workdir instead, the checkpoint in a local S3 server
(moto, niced, on the same cores), a cold compile. Timed from a common barrier to the checkpoint
downloaded and every process's step compiled (the restore after it is the same in both):

  * `download, then compile`: process 0 downloads while the others wait, then every process
    compiles (what the trainer did);
  * `download while compiling`: process 0 downloads beside its compile and the others compile
    while they wait (`sync_down(..., meanwhile=)` without `fetch`, what it does now).

Prints a table and writes benchmarks/results/restore_compile_hosts-<config>[-remote].json.
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

from benchmarks.common import print_table, write_results
from benchmarks.restore_compile import VARIANTS, timed_restart

REPO = Path(__file__).resolve().parents[1]
REMOTE_VARIANTS = ('download, then compile', 'download while compiling')
COLUMNS = [
    'config', 'processes', 'compile', 'variant', 'job_s', 'download_s', 'restore_s', 'compile_s',
    'saved_s', 'vs_sequential', 'runs'
]


def worker(variant: str, process: int, count: int, coordinator: str, config: str,
           where: str) -> dict:
  """`save` (step 1 of `config`'s state), or one variant of VARIANTS, timed on this process."""
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
  from benchmarks.first_save import real_state
  from benchmarks.states import get_config
  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, multihost
  from jaxckpt.train.state import build_trainer
  if variant == 'save':
    _, state = real_state(config)
    with CheckpointManager(where, CheckpointOptions(keep=1, mode='sync')) as mgr:
      mgr.save(1, state)
    return {}
  if variant in REMOTE_VARIANTS:
    return fetch_worker(variant, process, build_trainer(get_config(config)), where)
  trainer = build_trainer(get_config(config))
  mgr = CheckpointManager(where, writer=False)
  multihost.client().wait_at_barrier(f'bench/restore_compile/{variant}', 600_000)
  return {'process': process, **timed_restart(trainer, mgr, variant)}


def fetch_worker(variant: str, process: int, trainer, where: str) -> dict:
  """A fresh job's start on one shared workdir: process 0 downloads step 1 from $BENCH_URL into
  `where`; every process compiles, after the download or beside it."""
  from jaxckpt.checkpoint import multihost
  from jaxckpt.checkpoint.remote import Store, objects
  from jaxckpt.hosts.remote_start import _beside, _Progress
  client, row = multihost.client(), {'process': process}
  download = lambda: objects.download(Store(os.environ['BENCH_URL']), 1, Path(where))
  client.wait_at_barrier('bench/fetch/start', 600_000)
  t = time.perf_counter()
  if process == 0 and variant == REMOTE_VARIANTS[1]:
    _beside(download, trainer.compile_train_step, _Progress(1), 'step 1')
  elif process == 0:
    download()
  elif variant == REMOTE_VARIANTS[1]:
    trainer.compile_train_step()  # while process 0 downloads
  if process == 0:
    row['download_s'] = time.perf_counter() - t  # its compile included, when beside it
  client.wait_at_barrier('bench/fetch/synced', 600_000)  # the trainer's `remote_synced`
  row['synced_s'] = time.perf_counter() - t  # every process: the download is there
  if variant == REMOTE_VARIANTS[0]:
    trainer.compile_train_step()
  row['seconds'] = time.perf_counter() - t
  return row


def measure_remote(config: str, count: int, repeats: int, scratch: str) -> tuple[list, dict]:
  """The `--remote` table's rows, and every job's rows by variant."""
  from benchmarks.remote import BUCKET, Server
  from benchmarks.restore_compile import _upload
  got: dict = {}
  with tempfile.TemporaryDirectory(dir=scratch) as where:
    env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
    env.update(JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO), JAX_ENABLE_COMPILATION_CACHE='false')
    job('save', count, config, where, env)
    server = Server()  # its endpoint and credentials go into os.environ
    try:
      url = f's3://{BUCKET}/restore-compile-hosts'
      _upload(where, url)
      env = {**env, **{k: v for k, v in os.environ.items() if k.startswith('AWS_')}}
      env['BENCH_URL'] = url
      for repeat in range(repeats + 1):  # the first round is not counted
        for variant in REMOTE_VARIANTS:
          fresh = tempfile.mkdtemp(dir=where)
          rows = job(variant, count, config, fresh, env)
          shutil.rmtree(fresh)
          print(json.dumps({'variant': variant, 'rows': rows}), flush=True)
          if repeat:
            got.setdefault(variant, []).append(rows)
    finally:
      server.stop()
  out = []
  for variant, runs in got.items():
    out.append({
        'config': config, 'processes': count, 'compile': 'cold', 'variant': variant,
        'runs': len(runs),
        'job_s': statistics.median(max(r['seconds'] for r in run) for run in runs),
        'download_s': statistics.median(run[0]['download_s'] for run in runs)
    })
  for row in out:
    row['saved_s'] = out[0]['job_s'] - row['job_s']
    row['vs_sequential'] = row['job_s'] / out[0]['job_s']
  return out, got


def job(variant: str, count: int, config: str, where: str, env: dict) -> list[dict]:
  """One job of `count` workers in `variant`: each one's row. The first worker that fails ends
  the others (they would wait for it at the barrier) and the run, with its output."""
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    coordinator = f'127.0.0.1:{s.getsockname()[1]}'
  logs = [
      Path(where) / f'{variant.replace(" ", "-").replace(",", "")}-{k}.log' for k in range(count)
  ]
  procs = []
  for k, log in enumerate(logs):
    with open(log, 'w') as out:  # a file, not a pipe: no worker blocks on output unread
      procs.append(
          subprocess.Popen([
              sys.executable, '-m', 'benchmarks.restore_compile_hosts', '--worker', variant,
              str(k),
              str(count), coordinator, f'--config={config}', f'--where={where}'
          ],
                           cwd=REPO,
                           env=env,
                           stdout=out,
                           stderr=subprocess.STDOUT))
  deadline = time.monotonic() + 1800
  try:
    while any(p.poll() is None for p in procs):
      failed = [k for k, p in enumerate(procs) if p.returncode]
      if failed or time.monotonic() > deadline:
        k = failed[0] if failed else 0
        raise SystemExit(f'{variant}: process {k} ' + ('failed' if failed else 'timed out') +
                         f':\n{logs[k].read_text()[-3000:]}')
      time.sleep(0.2)
    failed = [k for k, p in enumerate(procs) if p.returncode]
    if failed:
      raise SystemExit(f'{variant}: process {failed[0]} failed:\n'
                       f'{logs[failed[0]].read_text()[-3000:]}')
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [json.loads(log.read_text().strip().splitlines()[-1]) for log in logs]


def measure(config: str, count: int, repeats: int, scratch: str) -> tuple[list, dict]:
  """(the table's rows, every job's rows by compile mode and variant)."""
  from benchmarks.restore_buffers import _warm
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO))
  got: dict = {}
  with tempfile.TemporaryDirectory(dir=scratch) as where:
    job('save', count, config, where, {**env, 'JAX_ENABLE_COMPILATION_CACHE': 'false'})
    files = sorted((Path(where) / 'step_00000001' / 'state').glob('*'))
    modes = {
        'cold': {**env, 'JAX_ENABLE_COMPILATION_CACHE': 'false'}, 'cached': {
            **env, 'JAX_COMPILATION_CACHE_DIR': os.path.join(where, 'jax-cache'),
            'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'
        }
    }
    for repeat in range(repeats + 1):  # the first round fills the cache; not counted
      for mode, mode_env in modes.items():
        for variant in VARIANTS:
          for f in files:
            _warm(str(f))
          rows = job(variant, count, config, where, mode_env)
          print(json.dumps({'compile': mode, 'variant': variant, 'rows': rows}), flush=True)
          if repeat:
            got.setdefault((mode, variant), []).append(rows)
  out = []
  for (mode, variant), runs in got.items():
    row = {
        'config': config, 'processes': count, 'compile': mode, 'variant': variant,
        'runs': len(runs),
        'job_s': statistics.median(max(r['seconds'] for r in run) for run in runs)
    }
    for key in ('restore_s', 'compile_s'):
      if key in runs[0][0]:
        row[key] = statistics.median(max(r[key] for r in run) for run in runs)
    out.append(row)
  for row in out:
    first = next(r for r in out if r['compile'] == row['compile'] and r['variant'] == VARIANTS[0])
    row['saved_s'] = first['job_s'] - row['job_s']
    row['vs_sequential'] = row['job_s'] / first['job_s']
  return out, {f'{mode}/{variant}': runs for (mode, variant), runs in got.items()}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--config', default='120m')
  ap.add_argument('--processes', type=int, default=2)
  ap.add_argument('--repeats', type=int, default=2, help='jobs per variant and compile mode')
  ap.add_argument('--remote', action='store_true', help='a fresh job, from a local S3 server')
  ap.add_argument('--scratch', default=tempfile.gettempdir())
  ap.add_argument('--where', default=None, help=argparse.SUPPRESS)
  ap.add_argument('--worker', nargs=4, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.repeats < 1:
    ap.error('--repeats: at least 1 (the first round, which fills the caches, is not counted)')
  if args.worker:
    variant, process, count, coordinator = args.worker
    print(
        json.dumps(worker(variant, int(process), int(count), coordinator, args.config, args.where)))
    return
  run = measure_remote if args.remote else measure
  rows, runs = run(args.config, args.processes, args.repeats, args.scratch)
  print_table(rows, COLUMNS)
  name = f'restore_compile_hosts-{args.config}' + ('-remote' if args.remote else '')
  print(f'wrote {write_results(name, rows, {"runs": runs})}')


if __name__ == '__main__':
  main()
