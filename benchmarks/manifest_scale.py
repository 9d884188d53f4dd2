"""What the manifest of a checkpoint written by many processes costs: commit, `latest`, inspect.

    python -m benchmarks.manifest_scale [--processes=8,64,256,1024] [--trees=120m,70b]

A checkpoint written by N processes lists every shard of every array, with its file, tensor,
start, shape and CRC-32. No real job of 1024 processes runs here, so the shards are synthetic,
laid out the way a fully sharded (FSDP) job lays them out: each leaf of the adamw state (params,
mu and nu, shaped like `benchmarks.common.synthetic_state`'s) is split N ways along its first
dimension of at least N elements, and a leaf with none (the counters) is whole, owned by one
process.
Then, with jaxckpt's own functions and on this machine's disk:

- records: one process's part record (`shardtable.part_record`), what it posts to process 0;
- merge: process 0's `shardtable.merge_records` of the N records;
- commit: what process 0 then writes: `shards.json` (`shardtable.write`) and the manifest
  (`manifest.build`, `manifest.sealed_json`, `atomic.write_file_durably`);
- latest: what `jaxckpt.checkpoint.discovery` does to find the newest checkpoint and check it:
  `manifest.audit(..., checksums=False)`, the files present at their sizes (sparse files);
- inspect: `jaxckpt inspect STEP_DIR --json` as a subprocess, minus the same command's time on a
  one-process checkpoint (its start-up);
- shard table: `shardtable.shard_table`, what every restore builds first (reading and
  checking `shards.json`).

Trees: `120m` (andrea_120m: 120.8M parameters, 449 leaves) and `70b` (80 layers: 70e9
parameters, 2,891 leaves). Target (the scale issue): commit and latest/inspect <= 1 s at 1024
processes. Prints a table, writes benchmarks/results/manifest_scale.json.
"""

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import _model_shapes, print_table, write_results
from jaxckpt.checkpoint import atomic, layout, manifest, multihost, shardgrid, shardtable, statefile

TREES = {'120m': (120.8e6, 449), '70b': (70e9, 80 * 12 * 3 + 11)}
TARGET_S = 1.0
COLUMNS = [
    'tree', 'processes', 'table', 'shards', 'manifest_mb', 'shards_mb', 'record_kb', 'records_s',
    'merge_s', 'commit_s', 'latest_s', 'inspect_s', 'shard_table_s', 'lookup_s'
]


def leaves(tree: str) -> list[tuple[str, tuple[int, ...]]]:
  params, count = TREES[tree]
  shapes = _model_shapes(int(params), (count - 2) // 3)
  return [(f'{group}/{name}', shape)
          for group in ('params', 'opt/mu', 'opt/nu')
          for name, shape in shapes] + [('step', ()), ('opt/count', ())]


def split_axis(shape: tuple[int, ...], processes: int) -> int | None:
  """The dimension a fully sharded job splits `processes` ways: the first of at least that many
  elements (None: the leaf is whole, owned by one process)."""
  return next((d for d, n in enumerate(shape) if n >= processes), None)


def padded(tree: list, processes: int) -> list[tuple[str, tuple[int, ...]]]:
  """`tree` with each split dimension rounded up to a multiple of `processes`, as a job pads a
  dimension it shards: jax splits an array only evenly (752 over 256 devices is refused)."""
  out = []
  for name, shape in tree:
    axis = split_axis(shape, processes)
    out.append(
        (name,
         tuple(-(-n // processes) * processes if d == axis else n for d, n in enumerate(shape))))
  return out


def layout_shards(tree: list, processes: int) -> list[dict[str, tuple]]:
  """For each process, {tensor: (array, box)} of the shards it writes."""
  parts = [{} for _ in range(processes)]
  for i, (name, shape) in enumerate(tree):
    axis = split_axis(shape, processes)
    if axis is None:
      box = tuple((0, n) for n in shape)
      parts[i % processes][multihost.tensor_name(name, box, shape)] = (name, box)
      continue
    c = shape[axis] // processes
    for k in range(processes):
      box = tuple((k * c, (k + 1) * c) if d == axis else (0, n) for d, n in enumerate(shape))
      parts[k][multihost.tensor_name(name, box, shape)] = (name, box)
  return parts


def grid_of(tree: list, processes: int) -> shardgrid.Grid:
  return shardgrid.Grid(
      (name, shape,
       [processes if d == split_axis(shape, processes) else 1
        for d in range(len(shape))])
      for name, shape in tree)


def record(k: int, shards: dict[str, tuple], grid: shardgrid.Grid | None) -> tuple[str, int]:
  places = {
      t: {'array': a, 'start': [lo for lo, _ in box], 'global_shape': []}
      for t, (a, box) in shards.items()
  }
  shapes = {t: tuple(hi - lo for lo, hi in box) for t, (_, box) in shards.items()}
  size = sum(4 * max(1, math.prod(s)) for s in shapes.values())
  crcs = {t: f'{(hash(t) & 0xffffffff):08x}' for t in shards}
  rel = f'{layout.STATE_DIR}/{statefile.file_name(k)}'
  return shardtable.part_record(rel, {'size': size, 'crc32': '0badcafe'}, crcs, places, shapes,
                                grid), size


class Device:
  """A device of process `process`, as a sharding names it."""

  def __init__(self, process: int):
    self.process_index = process


class Sharding:
  """A synthetic sharding (for a job that does not run here): the boxes of an array split evenly
  over `devices` along `axis` (None: replicated on all of them), as `jax.sharding` gives them."""

  def __init__(self, devices: list, axis: int | None):
    self.devices, self.axis = devices, axis

  # Equal when laid out alike, as jax's shardings are (a NamedSharding: same mesh and spec).
  def __eq__(self, other):
    return isinstance(other, Sharding) and (self.devices, self.axis) == (other.devices, other.axis)

  def __hash__(self):
    return hash((len(self.devices), self.axis))

  def devices_indices_map(self, shape):
    if self.axis is None:
      whole = tuple(slice(None) for _ in shape)
      return {d: whole for d in self.devices}
    c = shape[self.axis] // len(self.devices)
    return {
        d:
            tuple(
                slice(k * c, (k + 1) * c) if a == self.axis else slice(None)
                for a in range(len(shape))) for k, d in enumerate(self.devices)
    }


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def _inspect_s(step_dir: Path) -> float:
  t0 = time.perf_counter()
  subprocess.run([sys.executable, '-m', 'jaxckpt.cli', 'inspect',
                  str(step_dir), '--json'],
                 check=True,
                 stdout=subprocess.DEVNULL)
  return time.perf_counter() - t0


def measure(tree_name: str, processes: int, root: Path, table_kind: str = 'grid') -> dict:
  tree = padded(leaves(tree_name), processes)
  parts = layout_shards(tree, processes)
  grid = grid_of(tree, processes) if table_kind == 'grid' else None
  built = [record(k, p, grid) for k, p in enumerate(parts)]
  _, records_s = _timed(lambda: record(0, parts[0], grid))
  table = [{'name': n, 'shape': list(s), 'dtype': 'float32', 'spec': None} for n, s in tree]
  (files, shards), merge_s = _timed(
      lambda: shardtable.merge_records([r for r, _ in built], expect=processes, grid=grid))
  step_dir = root / f'{tree_name}-{processes}-{table_kind}' / layout.step_dirname(1)
  (step_dir / layout.STATE_DIR).mkdir(parents=True)
  for rel, entry in files.items():
    with open(step_dir / rel, 'wb') as f:
      f.truncate(entry['size'])  # sparse: audit without checksums looks at sizes alone
  state_files = sorted(files)
  files[layout.RUN_STATE] = {'size': 2, 'crc32': f'{manifest.crc32(b"{}"):08x}'}
  (step_dir / layout.RUN_STATE).write_bytes(b'{}')
  meta = {'storage': 'safetensors', 'state_files': state_files, shardtable.KEY: shardtable.SHARDS}

  def commit():
    written = shardtable.write(step_dir / shardtable.SHARDS, shards)
    raw = manifest.sealed_json(
        manifest.build(1, {**files, shardtable.SHARDS: written}, table, meta))
    atomic.write_file_durably(step_dir / layout.MANIFEST, raw)
    return raw

  raw, commit_s = _timed(commit)
  (m, problems), latest_s = _timed(lambda: manifest.audit(step_dir, checksums=False))
  if problems:
    raise SystemExit(f'{step_dir}: {problems[:3]}')
  got, table_s = _timed(lambda: shardtable.shard_table(step_dir, m, None))
  # What a restore on the same mesh then looks up: the rows under each of one process's boxes.
  mine = parts[processes // 2]
  found, lookup_s = _timed(lambda: sum(len(got.overlapping(a, box)) for a, box in mine.values()))
  assert found == len(mine), (found, len(mine))
  return {
      'tree': tree_name, 'processes': processes, 'table': table_kind,
      'shards': sum(map(len, parts)), 'manifest_mb': len(raw) / 1e6, 'shards_mb':
          (step_dir / shardtable.SHARDS).stat().st_size / 1e6, 'record_kb': len(built[0][0]) / 1e3,
      'records_s': records_s, 'merge_s': merge_s, 'commit_s': commit_s, 'latest_s': latest_s,
      'inspect_s': _inspect_s(step_dir), 'shard_table_s': table_s, 'lookup_s': lookup_s,
      'step_dir': step_dir
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--processes', default='8,64,256,1024')
  ap.add_argument('--trees', default='120m,70b')
  ap.add_argument('--tables', default='grid,rows', help='grid (version 2), rows (JSON rows)')
  args = ap.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory(prefix='manifest-scale-', dir=os.environ.get('TMPDIR')) as tmp:
    root = Path(tmp)
    base = measure('120m', 1, root)['step_dir']
    start = min(_inspect_s(base) for _ in range(3))  # the command's own start-up
    for tree in args.trees.split(','):
      for n in map(int, args.processes.split(',')):
        for kind in args.tables.split(','):
          row = measure(tree, n, root, kind)
          row['inspect_s'] = max(0.0, row['inspect_s'] - start)
          shutil.rmtree(row.pop('step_dir').parent)
          rows.append(row)
          print_table(rows[-1:], COLUMNS)
  print()
  print_table(rows, COLUMNS)
  path = write_results(
      'manifest_scale', rows, {
          'target': f'commit_s, latest_s and inspect_s <= {TARGET_S} s at 1024 processes',
          'inspect_start_s': start
      })
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
