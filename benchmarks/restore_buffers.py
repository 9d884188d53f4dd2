"""A restore's host buffers: what faulting fresh memory in costs a process's one restore.

    python -m benchmarks.restore_buffers --config=120m --repeats=3

A save's staging buffer is faulted in ahead of the first save (`CheckpointManager.prepare`,
benchmarks.first_save); a restore is once per process, into buffers it allocates then. On this
VM fresh memory faults in at about 0.5 GB/s in 4 KiB pages, so the question is what that costs a
restore. Each row is a fresh process holding nothing but the bytes of a committed andrea_120m-
or andrea_12m-shaped checkpoint (the trainer's real state tree, one safetensors file) in the
page cache, so that the disk is out of it and the buffers are what differs:

  * `jaxckpt restore`: `CheckpointManager.restore` of the whole state onto the CPU device,
    every CRC checked (its reader threads `pread` into page-aligned buffers that ask for
    transparent huge pages first);
  * `pread, 4 KiB pages`: the file's bytes read into one fresh buffer that asks for no huge
    pages (MADV_NOHUGEPAGE): what a plain allocation costs where huge pages are not given;
  * `pread, huge pages`: the same into one fresh buffer that asks for them (MADV_HUGEPAGE);
  * `pread, touched`: the same into a buffer whose every page was written before the clock
    started: what a buffer faulted in ahead (during the compile) would give.

Prints a table and writes benchmarks/results/restore_buffers.json.
"""

import argparse
import json
import mmap
import os
import statistics
import tempfile
import time

import numpy as np

from benchmarks.common import child_row, print_table, write_results

VARIANTS = ('jaxckpt restore', 'pread, 4 KiB pages', 'pread, huge pages', 'pread, touched')
COLUMNS = ['config', 'variant', 'bytes', 'seconds', 'gb_per_s', 'vs_touched', 'runs']


def _write(config: str, where: str) -> None:
  """A committed checkpoint of `config`'s real state tree at step 1 under `where`."""
  from benchmarks.first_save import real_state
  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions
  _, state = real_state(config)
  with CheckpointManager(where, CheckpointOptions(keep=1, mode='sync')) as mgr:
    mgr.save(1, state)


def _state_file(where: str) -> str:
  state = os.path.join(where, 'step_00000001', 'state')
  return os.path.join(state, os.listdir(state)[0])


def _warm(path: str) -> int:
  """Reads the file once so its pages are cached; its size."""
  with open(path, 'rb', buffering=0) as f:
    buf = bytearray(64 << 20)
    while f.readinto(buf):
      pass
  return os.path.getsize(path)


def _pread_into(path: str, buf: np.ndarray) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    view, at = memoryview(buf), 0
    while at < len(view):
      n = os.preadv(fd, [view[at:at + (64 << 20)]], at)
      if n <= 0:
        break
      at += n
  finally:
    os.close(fd)


def child(config: str, variant: str, where: str) -> dict:
  path = _state_file(where)
  size = _warm(path)
  if variant == 'jaxckpt restore':
    import jax

    from benchmarks.states import get_config
    from jaxckpt.checkpoint import CheckpointManager
    from jaxckpt.train.state import build_trainer
    abstract = build_trainer(get_config(config)).abstract_state()
    mgr = CheckpointManager(where, writer=False)
    t = time.perf_counter()
    state, _ = mgr.restore(1, abstract)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t
  else:
    raw = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw.madvise(mmap.MADV_HUGEPAGE if variant == 'pread, huge pages' else mmap.MADV_NOHUGEPAGE)
    buf = np.frombuffer(raw, np.uint8)
    if variant == 'pread, touched':
      buf[::4096] = 1
    t = time.perf_counter()
    _pread_into(path, buf)
    seconds = time.perf_counter() - t
  return {'config': config, 'variant': variant, 'bytes': size, 'seconds': seconds}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--config', default='120m')
  ap.add_argument('--repeats', type=int, default=3, help='fresh processes per variant')
  ap.add_argument('--scratch', default=tempfile.gettempdir())
  ap.add_argument('--child', default=None, help=argparse.SUPPRESS)
  ap.add_argument('--where', default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print(json.dumps(child(args.config, args.child, args.where)))
    return
  with tempfile.TemporaryDirectory(dir=args.scratch) as where:
    _write(args.config, where)
    got = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):  # alternating: drift in the machine's load falls on every row
      for variant in VARIANTS:
        got[variant].append(child_row('benchmarks.restore_buffers', args.config, variant, where))
        print(json.dumps(got[variant][-1]), flush=True)
  touched = statistics.median(r['seconds'] for r in got['pread, touched'])
  rows = []
  for variant, runs in got.items():
    seconds = statistics.median(r['seconds'] for r in runs)
    rows.append({
        'config': args.config, 'variant': variant, 'bytes': runs[0]['bytes'], 'seconds': seconds,
        'gb_per_s': runs[0]['bytes'] / seconds / 1e9, 'vs_touched': seconds / touched,
        'runs': len(runs)
    })
  print_table(rows, COLUMNS)
  print(f'wrote {write_results(f"restore_buffers-{args.config}", rows, {"runs": got})}')


if __name__ == '__main__':
  main()
