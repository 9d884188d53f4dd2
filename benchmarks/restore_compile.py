"""A restart's restore and its first compile: one after the other, and overlapped.

    python -m benchmarks.restore_compile --config=120m --repeats=3

A restarted trainer reads its checkpoint and compiles its train step. Before, it did one after
the other: the restore, then the compile at the first step. Now the trainer hands the compile to
the restore (`CheckpointManager.restore(..., meanwhile=trainer.compile_train_step)`): the state
file is read on a thread of its own, page faults included, and each window placed as it lands,
while the caller's thread compiles.

Each row is a fresh process with a committed andrea_120m- or andrea_12m-shaped checkpoint (the
trainer's real state tree, one safetensors file) in the page cache, timed from before the
restore to a compiled step and a restored state:

  * `restore, then compile`: `restore()`, then `compile_train_step()`; the two are also timed
    apart (`restore_s`, `compile_s`);
  * `restore while compiling`: `restore(..., meanwhile=compile_train_step)`.

Each runs with a cold compile (no persistent compilation cache) and with a warm one (a restart
on the same machine type with `JAX_COMPILATION_CACHE_DIR` set, where the compile is a load).

`--remote`: a fresh machine instead, its workdir empty, the checkpoint in a local S3 server
(moto, niced: it stands for another machine, but shares these cores), a cold compile:

  * `download, restore, compile`: one after the other (a fresh machine before this);
  * `download, restore while compiling`: the restore's overlap alone;
  * `download while compiling, restore`: what a one-process trainer does now, the download
    beside the compile (`remote_start.fetch_step(..., meanwhile=...)`), then the restore.

The variants alternate, so drift in the machine's load falls on each. Prints a table and writes
benchmarks/results/restore_compile-<config>[-remote].json.
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import child_row, print_table, write_results
from benchmarks.restore_buffers import _state_file, _warm, _write

VARIANTS = ('restore, then compile', 'restore while compiling')
REMOTE_VARIANTS = ('download, restore, compile', 'download, restore while compiling',
                   'download while compiling, restore')
COLUMNS = [
    'config', 'compile', 'variant', 'seconds', 'download_s', 'restore_s', 'compile_s', 'saved_s',
    'vs_sequential', 'runs'
]


def remote_child(config: str, variant: str, url: str) -> dict:
  import jax

  from benchmarks.states import get_config
  from jaxckpt.checkpoint import CheckpointManager
  from jaxckpt.checkpoint.remote import Store, objects
  from jaxckpt.hosts.remote_start import _beside, _Progress
  from jaxckpt.train.state import build_trainer
  trainer = build_trainer(get_config(config))
  abstract = trainer.abstract_state()
  store = Store(url)
  row = {'config': config, 'variant': variant}
  with tempfile.TemporaryDirectory() as fresh:
    download = lambda: objects.download(store, 1, Path(fresh) / 'ckpt')
    t = time.perf_counter()
    if variant == REMOTE_VARIANTS[2]:
      path, _ = _beside(download, trainer.compile_train_step, _Progress(1), 'step 1')
    else:
      path, _ = download()
    row['download_s'] = time.perf_counter() - t
    mgr = CheckpointManager(os.path.join(fresh, 'ckpt'), writer=False)
    if variant == REMOTE_VARIANTS[0]:
      state, _ = mgr.restore(path, abstract)
      jax.block_until_ready(state)
      t1 = time.perf_counter()
      trainer.compile_train_step()
      row['compile_s'] = time.perf_counter() - t1
    else:  # a no-op compile after the download beside it
      state, _ = mgr.restore(path, abstract, meanwhile=trainer.compile_train_step)
      jax.block_until_ready(state)
    row['seconds'] = time.perf_counter() - t
  return row


def child(config: str, variant: str, where: str) -> dict:
  _warm(_state_file(where))

  from benchmarks.states import get_config
  from jaxckpt.checkpoint import CheckpointManager
  from jaxckpt.train.state import build_trainer
  trainer = build_trainer(get_config(config))
  return {
      'config': config, **timed_restart(trainer, CheckpointManager(where, writer=False), variant)
  }


def timed_restart(trainer, mgr, variant: str) -> dict:
  """A restart's restore of step 1 and its compile, in `variant` (VARIANTS): the seconds of the
  whole (`seconds`) and, one after the other, of each (`restore_s`, `compile_s`)."""
  import jax
  abstract = trainer.abstract_state()
  row = {'variant': variant}
  t = time.perf_counter()
  if variant == VARIANTS[1]:
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


def _upload(where: str, url: str) -> None:
  from jaxckpt.checkpoint.remote import Store, Uploader
  uploader = Uploader(Store(url))
  try:
    uploader.submit(1, Path(where) / 'step_00000001')
    assert uploader.wait(1, timeout=900), uploader.error
  finally:
    uploader.close()


def measure(config: str, repeats: int, remote: bool, scratch: str) -> tuple[list, dict]:
  """(the table's rows, every run's row by variant): fresh processes, alternating variants."""
  got, server = {}, None
  with tempfile.TemporaryDirectory(dir=scratch) as where:
    _write(config, where)
    if remote:  # the server's endpoint and credentials go into the environment
      from benchmarks.remote import BUCKET, Server
      server = Server()
      url = f's3://{BUCKET}/restore-compile'
      _upload(where, url)
    env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_COMPILATION_CACHE')}
    cold = {**env, 'JAX_ENABLE_COMPILATION_CACHE': 'false'}
    if remote:
      modes, variants, target = {'cold': cold}, REMOTE_VARIANTS, url
    else:
      cache = os.path.join(where, 'jax-cache')
      cached = {
          **env, 'JAX_COMPILATION_CACHE_DIR': cache,
          'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'
      }
      modes, variants, target = {'cold': cold, 'cached': cached}, VARIANTS, where
    try:
      for repeat in range(repeats + 1):  # the first round fills the caches; not counted
        for mode, mode_env in modes.items():
          for variant in variants:
            row = {
                **child_row('benchmarks.restore_compile', config, variant, target, mode_env),
                'compile':
                    mode
            }
            print(json.dumps(row), flush=True)
            if repeat:
              got.setdefault((mode, variant), []).append(row)
    finally:
      if server is not None:
        server.stop()
  rows = []
  for (mode, variant), runs in got.items():
    row = {'config': config, 'compile': mode, 'variant': variant, 'runs': len(runs)}
    for key in ('seconds', 'download_s', 'restore_s', 'compile_s'):
      if key in runs[0]:
        row[key] = statistics.median(r[key] for r in runs)
    rows.append(row)
  for row in rows:
    first = next(r for r in rows if r['compile'] == row['compile'] and r['variant'] == variants[0])
    row['saved_s'] = first['seconds'] - row['seconds']
    row['vs_sequential'] = row['seconds'] / first['seconds']
  runs = {f'{mode}/{variant}': r for (mode, variant), r in got.items()}
  return rows, runs


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--config', default='120m')
  ap.add_argument('--repeats', type=int, default=3, help='fresh processes per variant')
  ap.add_argument('--remote', action='store_true', help='a fresh machine, from a local S3 server')
  ap.add_argument('--scratch', default=tempfile.gettempdir())
  ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
  ap.add_argument('--where', default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.repeats < 1:
    ap.error('--repeats: at least 1 (the first round, which fills the caches, is not counted)')
  if args.child:
    run = remote_child if args.child in REMOTE_VARIANTS else child
    print(json.dumps(run(args.config, args.child, args.where)))
    return
  rows, runs = measure(args.config, args.repeats, args.remote, args.scratch)
  print_table(rows, COLUMNS)
  name = f'restore_compile-{args.config}' + ('-remote' if args.remote else '')
  print(f'wrote {write_results(name, rows, {"runs": runs})}')


if __name__ == '__main__':
  main()
