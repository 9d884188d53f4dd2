"""What this machine's disk and memory allow, and what peer checkpointers achieve on one state.

    python -m benchmarks.baselines --params=12_800_000 --leaves=449 --repeats=3

prints a table and writes benchmarks/results/baselines.json (+ .png). Every baseline works in a
fresh subdirectory of a scratch directory and returns rows like

    {"name": "orbax-sync", "op": "restore", "seconds": 1.27, "bytes": 1449597320, "cold": True,
     "cache": "drop_caches", "disk_bytes": ..., "peak_rss_bytes": ..., "gbps": ...}

Rules that make the numbers comparable:
  * Saves are durable before the clock stops: every file and directory fsync'ed (fsync_tree).
  * Every timed operation starts from the same machine state (common.settle): page cache clean
    and dropped, so no earlier writeback is billed to it; a quiet pause; memory just recycled,
    so its allocations reuse guest pages instead of pages this VM already handed back to its
    host. That is the best case for every peer; fresh-VM numbers are slower and noisier.
  * Restores read from a cold page cache where evict_page_cache manages it ("cold", "cache"),
    allocate their own output, and are checked bit-exact against the state after the clock stops.
  * Library warm-up (imports, thread pools) is paid once on a tiny state before measuring.
"""

import argparse
import contextlib
import gc
import math
import mmap
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import safetensors.numpy
import torch
import torch.distributed.checkpoint as dcp

from benchmarks.common import (OtherLoad, Timer, fsync_tree, median, peak_rss_during, plot_bars,
                               print_table, settle, state_nbytes, synthetic_state, write_results)

BLOCK = 16 << 20  # 16 MiB: large enough that per-syscall cost vanishes, as dd bs=16M
# Memory recycled before each timed operation, in state sizes: orbax's save peaks at ~1.8x the
# state in RSS, plus ~1x in page cache for the files it writes.
RECYCLE_FACTOR = 3
COLUMNS = [
    'name', 'op', 'seconds', 'min', 'gbps', 'bytes', 'disk_bytes', 'peak_rss_bytes', 'cold', 'cache'
]


def _row(name: str, op: str, seconds: float, nbytes: int, **extra) -> dict:
  return {
      'name': name, 'op': op, 'seconds': seconds, 'bytes': nbytes,
      'gbps': nbytes / seconds / 1e9 if seconds > 0 else None, **extra
  }


def _fresh_dir(scratch, name: str) -> Path:
  return Path(tempfile.mkdtemp(prefix=f'{name}-', dir=scratch))


def _disk_bytes(path) -> int:
  return sum(f.stat().st_size for f in Path(path).rglob('*') if f.is_file())


def _random_block() -> mmap.mmap:
  """A 16 MiB buffer of random bytes, page-aligned as O_DIRECT requires (mmap always is).

    Random so that nothing between us and the platter could compress it; one block written
    repeatedly is enough because neither ext4 nor virtio deduplicates.
    """
  buf = mmap.mmap(-1, BLOCK)
  buf.write(os.urandom(BLOCK))
  return buf


def _write_blocks(fd: int, buf, n_blocks: int) -> None:
  for _ in range(n_blocks):
    if os.write(fd, buf) != BLOCK:
      raise OSError(f'short write to fd {fd}')


def _settle(paths, nbytes: int) -> str:
  # Warm-up states free too little memory to be worth waiting for the VM to take back.
  quiet_s = 2.0 if nbytes >= BLOCK else 0.0
  return settle(paths, recycle_bytes=RECYCLE_FACTOR * nbytes, quiet_s=quiet_s)


def _timed_call(fn, *args):
  with Timer() as t:
    result = fn(*args)
  return result, t.seconds


# ---------------------------------------------------------------------------------------------
# What the machine allows


def dd_odirect_write(nbytes: int, scratch) -> dict:
  """Write nbytes (rounded up to 16 MiB) of random data with O_DIRECT, then fsync.

    The ceiling for any saver: no page cache, so no fresh pages to fault in. The row's "path"
    names the file, for cold_read.
    """
  path = _fresh_dir(scratch, 'odirect') / 'data'
  n_blocks = math.ceil(nbytes / BLOCK)
  buf = _random_block()
  _settle([path.parent], nbytes)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
  try:
    with Timer() as t:
      _write_blocks(fd, buf, n_blocks)
      os.fsync(fd)  # O_DIRECT skips the page cache, not the drive's cache or metadata
      fsync_tree(path)
  finally:
    os.close(fd)
    buf.close()
  return _row('disk-odirect', 'write+fsync', t.seconds, n_blocks * BLOCK, path=str(path))


def buffered_write_fsync(nbytes: int, scratch) -> dict:
  """Write nbytes (rounded up to 16 MiB) through the page cache into a new file, then fsync.

    What a plain saver pays: the disk plus filling a page-cache page for every page written.
    """
  path = _fresh_dir(scratch, 'buffered') / 'data'
  n_blocks = math.ceil(nbytes / BLOCK)
  buf = _random_block()
  _settle([path.parent], nbytes)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
  try:
    with Timer() as t:
      _write_blocks(fd, buf, n_blocks)
      os.fsync(fd)
      fsync_tree(path)
  finally:
    os.close(fd)
    buf.close()
  return _row('disk-buffered', 'write+fsync', t.seconds, n_blocks * BLOCK, path=str(path))


def cold_read(path) -> dict:
  """Read a file through the page cache after evicting it, into one reused 16 MiB buffer.

    The reused buffer keeps destination page faults out, so this is the disk's read limit.
    """
  buf = bytearray(BLOCK)
  cache = _settle([path], os.path.getsize(path))
  nbytes = 0
  with open(path, 'rb', buffering=0) as f, Timer() as t:
    while n := f.readinto(buf):
      nbytes += n
  return _row('disk-read', 'read', t.seconds, nbytes, cold=cache != 'none', cache=cache)


def host_copy(state: dict[str, np.ndarray]) -> list[dict]:
  """np.copyto of every leaf into fresh allocations, then again into the same, touched buffers.

    The gap between the two is the cost of first-touch page faults, which any saver allocating a
    staging copy per save pays. Here the memory is recycled (see settle); on memory the VM has
    handed back to its host the fresh copy runs at 0.5-1 GB/s instead.
    """
  nbytes = state_nbytes(state)
  _settle([], nbytes)
  with Timer() as fresh:
    copies = {k: np.empty_like(a) for k, a in state.items()}  # lazy: pages fault in copyto
    for k, a in state.items():
      np.copyto(copies[k], a)
  with Timer() as touched:
    for k, a in state.items():
      np.copyto(copies[k], a)
  return [
      _row('host-copy', 'fresh', fresh.seconds, nbytes),
      _row('host-copy', 'touched', touched.seconds, nbytes)
  ]


# ---------------------------------------------------------------------------------------------
# Peers: each saves the state durably, then restores it cold.


def _check_restored(name: str, state: dict, restored: dict) -> None:
  if set(restored) != set(state):
    raise AssertionError(f'{name}: restored keys differ from saved keys')
  for key, expected in state.items():
    got = np.asarray(restored[key])
    if got.dtype != expected.dtype or not np.array_equal(got, expected):
      raise AssertionError(f'{name}: leaf {key!r} differs after restore')


def _save_and_restore(name: str, state: dict, scratch, save, restore) -> list[dict]:
  """Time save(state, dir) + fsync_tree(dir), then restore(dir) from cold cache; check it."""
  work = _fresh_dir(scratch, name)
  nbytes = state_nbytes(state)

  def durable_save():
    save(state, work)
    fsync_tree(work)

  _settle([work], nbytes)
  (_, save_s), save_peak = peak_rss_during(lambda: _timed_call(durable_save))
  disk = _disk_bytes(work)
  cache = _settle([work], nbytes)
  (restored, restore_s), restore_peak = peak_rss_during(lambda: _timed_call(restore, work))
  _check_restored(name, state, restored)
  del restored
  shutil.rmtree(work)
  return [
      _row(name, 'save', save_s, nbytes, disk_bytes=disk, peak_rss_bytes=save_peak),
      _row(
          name,
          'restore',
          restore_s,
          nbytes,
          disk_bytes=disk,
          peak_rss_bytes=restore_peak,
          cold=cache != 'none',
          cache=cache),
  ]


def orbax_sync(state: dict, scratch) -> list[dict]:
  """orbax's synchronous Checkpointer with StandardCheckpointHandler defaults (zstd, OCDBT)."""
  checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)

  def save(state, work):
    checkpointer.save(work / 'ckpt', args=ocp.args.StandardSave(state))

  def restore(work):
    return checkpointer.restore(work / 'ckpt', args=ocp.args.StandardRestore(abstract))

  try:
    return _save_and_restore('orbax-sync', state, scratch, save, restore)
  finally:
    checkpointer.close()


def orbax_async(state: dict, scratch) -> list[dict]:
  """orbax CheckpointManager's async save: time until save() returns, and until durable.

    The blocking part is what a training loop stalls for. A fresh manager per call, because
    waiting on a manager ourselves makes its next save() log a misleading warning. Restore is
    the same reader as orbax-sync, so it is not measured again.
    """
  work = _fresh_dir(scratch, 'orbax-async')
  manager = ocp.CheckpointManager(work, options=ocp.CheckpointManagerOptions(max_to_keep=1))
  nbytes = state_nbytes(state)

  def save():
    with Timer() as total:
      with Timer() as blocking:
        manager.save(0, args=ocp.args.StandardSave(state))
      manager.wait_until_finished()
      fsync_tree(work)
    return blocking.seconds, total.seconds

  try:
    _settle([work], nbytes)
    (blocking_s, total_s), peak = peak_rss_during(save)
  finally:
    manager.close()
  disk = _disk_bytes(work)
  shutil.rmtree(work)
  return [
      _row('orbax-async', 'save-blocking', blocking_s, nbytes),
      _row('orbax-async', 'save-total', total_s, nbytes, disk_bytes=disk, peak_rss_bytes=peak)
  ]


def _as_tensors(state: dict) -> dict[str, torch.Tensor]:
  return {k: torch.from_numpy(a) for k, a in state.items()}  # shares memory: no copy


def torch_save(state: dict, scratch) -> list[dict]:
  """torch.save of one dict of tensors to one file; torch.load of it (weights_only)."""

  def save(state, work):
    torch.save(_as_tensors(state), work / 'state.pt')

  def restore(work):
    return torch.load(work / 'state.pt', weights_only=True)

  return _save_and_restore('torch', state, scratch, save, restore)


@contextlib.contextmanager
def _quiet_single_process_dcp():
  # With no process group, every dcp.save/load warns that it assumes one process: we know.
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message='torch.distributed is disabled')
    yield


def torch_dcp(state: dict, scratch) -> list[dict]:
  """torch.distributed.checkpoint in one process (no_dist=True, no process group).

    dcp.load fills tensors the caller allocates; that allocation is timed, as every other
    restore allocates its own output.
    """

  def save(state, work):
    with _quiet_single_process_dcp():
      dcp.save(_as_tensors(state), checkpoint_id=work / 'dcp', no_dist=True)

  def restore(work):
    targets = {k: torch.from_numpy(np.empty_like(a)) for k, a in state.items()}
    with _quiet_single_process_dcp():
      dcp.load(targets, checkpoint_id=work / 'dcp', no_dist=True)
    return targets

  return _save_and_restore('torch-dcp', state, scratch, save, restore)


def safetensors_file(state: dict, scratch) -> list[dict]:
  """safetensors.numpy save_file / load_file: one file, header then raw leaves."""

  def save(state, work):
    safetensors.numpy.save_file(state, work / 'state.safetensors')

  def restore(work):
    return safetensors.numpy.load_file(work / 'state.safetensors')

  return _save_and_restore('safetensors', state, scratch, save, restore)


PEERS = (orbax_sync, orbax_async, torch_save, torch_dcp, safetensors_file)

# ---------------------------------------------------------------------------------------------
# Running everything


def _disk_limits(state: dict, scratch) -> list[dict]:
  nbytes = state_nbytes(state)
  write = dd_odirect_write(nbytes, scratch)
  read = cold_read(write.pop('path'))  # the O_DIRECT file: never in the page cache
  buffered = buffered_write_fsync(nbytes, scratch)
  buffered.pop('path')
  return [write, read, buffered]


def _run_once(state: dict, scratch, extra=()) -> list[dict]:
  """One pass of every baseline, in a fixed order: disk limits, host copy, peers, extra."""
  rows = _guarded(_disk_limits, state, scratch) + _guarded(host_copy, state)
  for peer in (*PEERS, *extra):
    _empty_dir(scratch)
    gc.collect()  # free the previous restore before the next peer's peak-RSS baseline
    rows += _guarded(peer, state, scratch)
  return rows


def _guarded(baseline, *args) -> list[dict]:
  # One broken baseline (an API change in a new release, O_DIRECT refused by the scratch
  # filesystem) should cost its rows, not the whole run.
  try:
    return baseline(*args)
  except Exception as e:  # noqa: BLE001 - reported in the row and on stderr
    message = f'{type(e).__name__}: {e}'.splitlines()[0]
    print(f'baseline {baseline.__name__} failed: {message}', file=sys.stderr)
    return [{'name': baseline.__name__, 'op': 'error', 'seconds': None, 'error': message}]


def _empty_dir(path) -> None:
  for child in Path(path).iterdir():
    shutil.rmtree(child) if child.is_dir() else child.unlink()


def _median_rows(passes: list[list[dict]]) -> list[dict]:
  """Merge the rows of several passes by (name, op): median seconds, plus min and all samples."""
  merged: dict[tuple, list[dict]] = {}
  for rows in passes:
    for row in rows:
      merged.setdefault((row['name'], row['op']), []).append(row)
  out = []
  for samples in merged.values():
    row = dict(samples[0])
    seconds = [r['seconds'] for r in samples if r.get('seconds') is not None]
    if seconds:
      row['seconds'] = median(seconds)
      row['min'] = min(seconds)
      row['samples'] = seconds
      row['gbps'] = row['bytes'] / row['seconds'] / 1e9 if row['seconds'] > 0 else None
    if 'cold' in row:
      row['cold'] = all(r.get('cold') for r in samples)  # cold only if every repeat was
    if 'peak_rss_bytes' in row:
      row['peak_rss_bytes'] = max(r['peak_rss_bytes'] for r in samples)
    out.append(row)
  return out


def run_all(state: dict, scratch, repeats: int = 3, warmup: bool = True, extra=()) -> list[dict]:
  """Run every baseline `repeats` times on state; one row per (name, op) with median seconds.

    Passes interleave the baselines (all of pass 1, then all of pass 2, ...) so slow drift in
    the machine spreads over every row instead of landing on one. scratch is emptied between
    baselines, so the disk never holds more than about two copies of the state.

    extra: more contenders, callables (state, scratch) -> rows run at the end of every pass
    under the same rules (benchmarks.checkpoint adds jaxckpt this way). They are not warmed up
    here: warm them up before calling.
    """
  scratch = Path(scratch)
  scratch.mkdir(parents=True, exist_ok=True)
  if warmup:
    tiny = synthetic_state(10_000, n_leaves=8, seed=1)
    for peer in PEERS:
      _guarded(peer, tiny, scratch)
    _empty_dir(scratch)
  passes = []
  for _ in range(repeats):
    passes.append(_run_once(state, scratch, extra))
    _empty_dir(scratch)
  return _median_rows(passes)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--params', type=int, default=12_800_000, help='model parameters')
  parser.add_argument('--leaves', type=int, default=449, help='leaves in the adamw state')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--scratch-root', default='/tmp', help='scratch dir is created in here')
  parser.add_argument('--name', default='baselines', help='results/<name>.json and .png')
  args = parser.parse_args(argv)

  state = synthetic_state(args.params, args.leaves, args.seed)
  nbytes = state_nbytes(state)
  scratch = tempfile.mkdtemp(prefix='jaxckpt-baselines-', dir=args.scratch_root)
  try:
    with OtherLoad() as load:
      rows = run_all(state, scratch, args.repeats)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  if load.share > 0.1:
    print(
        f'warning: other processes used {load.share:.0%} of the CPU during the run; '
        'expect noisy numbers',
        file=sys.stderr)

  title = (f'{args.params / 1e6:.1f}M params, {args.leaves} leaves, {nbytes / 1e9:.3g} GB; '
           f'median of {args.repeats}')
  print(title)
  print_table(rows, COLUMNS)
  meta = {
      'params': args.params, 'leaves': args.leaves, 'state_bytes': nbytes, 'repeats': args.repeats,
      'seed': args.seed, 'scratch_root': args.scratch_root, 'other_cpu_share': load.share
  }
  path = write_results(args.name, rows, meta)
  plot_bars(rows, path.with_suffix('.png'), title)
  print(f"wrote {path} and {path.with_suffix('.png').name}")


if __name__ == '__main__':
  main()
