"""What the plan of a restore from the peers costs at many hosts: its bytes and its making.

    python -m benchmarks.peer_plan [--processes=8,64,256,1024] [--layouts=data,fsdp]

Process 0 builds the plan (`peerplan.build`: who sends which part to whom) and every process
gets it whole, then reads its moves and puts them in rounds (`peerplan.moves_of`,
`sends.rounds`). The plan goes to the others over the interconnect (`spreads.share`); the
coordinator's key-value store carries its size and CRC-32 to each. No job of 1024 processes runs here: the
checkpoint is synthetic (a manifest and a shard table on this machine's disk, as
`benchmarks.manifest_scale` lays them out) and so is the target's sharding (which process's
devices hold which box). Layouts:

- `data`: every leaf whole, written by one process (leaf i by process i % N), and replicated on
  every process's devices: each process needs every part. Tree `70b` (2,891 leaves: one part or
  more for every process at 1024).
- `fsdp`: every leaf split N ways along its first dimension of at least N elements, as the
  job's devices hold it. Tree `120m`.

Scenarios: `lost`, host 1's disk wiped, one replica each (a process holds its own part and the
one before it on the ring); `fresh`, every disk wiped but process 0's own files, the remote
holding the checkpoint. Columns: the plan's bytes, what the coordinator serves the other
processes of what grows with N (the plan's size and CRC-32, and the verdict at the end; before,
the plan itself and every process's word at the end), process 0's time to build it, one process's time to read it and make
the rounds, and the sends: point to point (in rounds), and to several processes at once, whole
parts and subsets. Prints a table, writes benchmarks/results/peer_plan.json.
"""

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import manifest_scale as ms
from benchmarks.common import print_table, write_results
from jaxckpt.checkpoint import atomic, layout, manifest, peerplan, sends, shardtable, statefile

TREES = {'data': '70b', 'fsdp': '120m'}
# What a process other than 0 reads of the key-value store in a restore that grows with N:
# the plan's size and CRC-32 and the verdict at the end (`peers.restore_dir`); before, the plan
# itself and every process's word at the end (a directory of N keys).
SIZED = {'bytes': 193_000, 'crc32': '00000000'}
VERDICT = {'failed': [], 'cause': '', 'hung': [], 'hang': ''}
OWN = [layout.MANIFEST, shardtable.SHARDS, layout.RUN_STATE]
COLUMNS = [
    'layout', 'scenario', 'processes', 'plan_kb', 'coordinator_mb', 'coordinator_mb_before',
    'build_s', 'read_s', 'pairs', 'rounds', 'spread_parts', 'spread_subsets'
]


class _Leaf:

  def __init__(self, shape, sharding):
    self.shape, self.sharding = shape, sharding


def checkpoint(kind: str, processes: int, root: Path) -> tuple[Path, dict]:
  """A committed checkpoint 1 under `root` and the target (as a restore's `target`)."""
  tree = ms.padded(ms.leaves(TREES[kind]), processes)
  axis = (lambda shape: ms.split_axis(shape, processes)) if kind == 'fsdp' else (lambda _: None)
  if kind == 'fsdp':
    parts = ms.layout_shards(tree, processes)
  else:
    parts = [{} for _ in range(processes)]
    for i, (name, shape) in enumerate(tree):
      parts[i % processes][name] = (name, tuple((0, n) for n in shape))
  # The fully sharded layout's shards as a save files them (a grid); the other's as rows.
  grid = ms.grid_of(tree, processes) if kind == 'fsdp' else None
  built = [ms.record(k, p, grid) for k, p in enumerate(parts)]
  files, shards = shardtable.merge_records([r for r, _ in built], expect=processes, grid=grid)
  step_dir = root / layout.step_dirname(1)
  (step_dir / layout.STATE_DIR).mkdir(parents=True)
  files[layout.RUN_STATE] = {'size': 2, 'crc32': f'{manifest.crc32(b"{}"):08x}'}
  (step_dir / layout.RUN_STATE).write_bytes(b'{}')
  written = shardtable.write(step_dir / shardtable.SHARDS, shards)
  table = [{'name': n, 'shape': list(s), 'dtype': 'float32', 'spec': None} for n, s in tree]
  meta = {
      'storage': 'safetensors', 'state_files': sorted(r for r in files if r != layout.RUN_STATE),
      shardtable.KEY: shardtable.SHARDS
  }
  raw = manifest.sealed_json(manifest.build(1, {**files, shardtable.SHARDS: written}, table, meta))
  atomic.write_file_durably(step_dir / layout.MANIFEST, raw)
  devices = [ms.Device(k) for k in range(processes)]
  return root, {n: _Leaf(s, ms.Sharding(devices, axis(s))) for n, s in tree}


def holdings(scenario: str, processes: int) -> list[list[str]]:
  part = lambda k: f'{layout.STATE_DIR}/{statefile.file_name(k)}'
  if scenario == 'fresh':
    return [list(OWN)] + [[] for _ in range(processes - 1)]
  # Each host holds the manifest and the run state; process 0's alone the shard table.
  intact = [[part(k), part((k - 1) % processes), layout.MANIFEST, layout.RUN_STATE]
            for k in range(processes)]
  intact[0].append(shardtable.SHARDS)
  intact[1] = []
  return intact


def measure(kind: str, scenario: str, processes: int, root: Path) -> dict:
  ckpt_dir, target = checkpoint(kind, processes, root)
  intact = holdings(scenario, processes)
  t0 = time.perf_counter()
  plan = peerplan.build(ckpt_dir, 1, intact, target, processes, scenario == 'fresh',
                        0 if scenario == 'fresh' else 1)
  build_s = time.perf_counter() - t0
  word = json.dumps(plan)
  t0 = time.perf_counter()
  moves = peerplan.moves_of(json.loads(word))
  rounds = sends.rounds(moves.pairs)
  read_s = time.perf_counter() - t0
  return {
      'layout':
          kind, 'scenario':
              scenario, 'processes':
                  processes, 'plan_kb':
                      len(word) / 1e3,
      'coordinator_mb': (len(json.dumps(SIZED)) + len(json.dumps(VERDICT))) * (processes - 1) / 1e6,
      'coordinator_mb_before':
          (len(word) + sum(len(f'jaxckpt/group/0/peers/done/1/part/{k}') for k in range(processes)))
          * (processes - 1) / 1e6, 'build_s':
              build_s, 'read_s':
                  read_s, 'pairs':
                      len(moves.pairs), 'rounds':
                          len(rounds), 'spread_parts':
                              sum(t is None for *_, t in moves.spreads), 'spread_subsets':
                                  sum(t is not None for *_, t in moves.spreads)
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--processes', default='8,64,256,1024')
  ap.add_argument('--layouts', default='data,fsdp')
  ap.add_argument('--scenarios', default='lost,fresh')
  args = ap.parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory(prefix='peer-plan-', dir=os.environ.get('TMPDIR')) as tmp:
    for kind in args.layouts.split(','):
      for scenario in args.scenarios.split(','):
        for n in map(int, args.processes.split(',')):
          root = Path(tmp) / f'{kind}-{scenario}-{n}'
          rows.append(measure(kind, scenario, n, root))
          shutil.rmtree(root)
          print_table(rows[-1:], COLUMNS)
  print()
  print_table(rows, COLUMNS)
  path = write_results('peer_plan', rows, {'trees': TREES})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
