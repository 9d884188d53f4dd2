"""What each process works out of the job's layout at its first save, at many hosts.

    python -m benchmarks.save_layout [--processes=8,64,256,1024] [--devices=8]

Every process of a save works out, from the shardings alone, which shards it writes
(`multihost._owned`: a box one process holds is its own, one several hold goes to the least
loaded of them) and whether every
leaf is an even split (`multihost.grid`: the shard table's compact form). Both walk the job's
devices: a process's first save pays it, on the training thread (later saves reuse it). No job
of 1024 hosts runs here: the shardings are synthetic (`manifest_scale.Sharding`, equal when
laid out alike, as jax's are), over `--devices` devices per process, for the 70B tree (2,891
leaves): `data`, every leaf replicated on every device (data parallelism); `fsdp`, every leaf
split over all the devices along its first dimension that takes them (padded as a job pads it).
Each figure is one cold run (caches cleared). Prints a table, writes
benchmarks/results/save_layout.json.
"""

import argparse
import time

from benchmarks import manifest_scale as ms
from benchmarks.common import print_table, write_results
from jaxckpt.checkpoint import multihost

COLUMNS = ['layout', 'processes', 'devices', 'leaves', 'owners_s', 'grid_s', 'first_save_s']


def key_of(kind: str, processes: int, per_process: int) -> tuple:
  """`multihost._key`'s answer for the 70B tree laid out as `kind` over the job's devices."""
  devices = [ms.Device(k) for k in range(processes) for _ in range(per_process)]
  count = len(devices)
  tree = ms.padded(ms.leaves('70b'), count) if kind == 'fsdp' else ms.leaves('70b')
  axis = (lambda shape: ms.split_axis(shape, count)) if kind == 'fsdp' else (lambda _: None)
  return tuple((name, shape, 4, ms.Sharding(devices, axis(shape))) for name, shape in tree)


def measure(kind: str, processes: int, per_process: int) -> dict:
  key = key_of(kind, processes, per_process)
  owned = getattr(multihost, '_owned', None)
  for name in ('_owned', '_owners', '_grid', 'box_holders', '_held', '_parts'):
    if hasattr(multihost, name):
      getattr(multihost, name).cache_clear()
  t0 = time.perf_counter()
  if owned is not None:  # what process 0 writes
    owned(key, processes, 0)
  else:  # the code before: every box's owner
    multihost._owners(key, processes)
  owners_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  multihost._grid(key)
  grid_s = time.perf_counter() - t0
  return {
      'layout': kind, 'processes': processes, 'devices': processes * per_process,
      'leaves': len(key), 'owners_s': owners_s, 'grid_s': grid_s, 'first_save_s': owners_s + grid_s
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--processes', default='8,64,256,1024')
  ap.add_argument('--devices', type=int, default=8, help='devices per process')
  ap.add_argument('--layouts', default='data,fsdp')
  args = ap.parse_args(argv)
  rows = []
  for kind in args.layouts.split(','):
    for n in map(int, args.processes.split(',')):
      rows.append(measure(kind, n, args.devices))
      print_table(rows[-1:], COLUMNS)
  print()
  print_table(rows, COLUMNS)
  path = write_results('save_layout', rows, {'tree': '70b', 'devices_per_process': args.devices})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
