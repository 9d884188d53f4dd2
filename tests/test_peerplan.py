"""The plan of a restore from the peers (`peerplan`), which every process fetches whole from the
coordinator: what it says, and that it grows with the processes, not with their pairs.

No job of 64 processes runs here: the checkpoints are synthetic (a manifest and a shard table
on disk, each process's part sparse), and so are the targets' shardings (which process's devices
hold which box), as `benchmarks/peer_plan.py` builds them for 1024 hosts."""

import json
import random

import pytest

from jaxckpt.checkpoint import atomic, layout, manifest, peerplan, shardtable, statefile

OWN = [layout.MANIFEST, 'shards.json', layout.RUN_STATE]


class _Device:

  def __init__(self, process: int):
    self.process_index = process


class _Replicated:
  """Every process's devices hold the whole array (data parallelism)."""

  def __init__(self, count: int):
    self.devices = [_Device(k) for k in range(count)]

  def devices_indices_map(self, shape):
    return {d: tuple(slice(None) for _ in shape) for d in self.devices}


class _Leaf:

  def __init__(self, shape, sharding):
    self.shape, self.sharding = shape, sharding


def _checkpoint(root, count: int, leaves: int = 64):
  """Checkpoint 1 of a data-parallel job of `count` processes: `leaves` whole float32 arrays of
  4 x 8, leaf i written by process i % count."""
  records = []
  for k in range(count):
    places = {
        f'w{i:03d}': {'array': f'w{i:03d}', 'start': [0, 0], 'global_shape': [4, 8]}
        for i in range(k, leaves, count)
    }
    shapes = {t: (4, 8) for t in places}
    crcs = {t: f'{i:08x}' for i, t in enumerate(places)}
    rel = f'{layout.STATE_DIR}/{statefile.file_name(k)}'
    size = 128 * len(places) + 64
    records.append(
        shardtable.part_record(rel, {'size': size, 'crc32': f'{k:08x}'}, crcs, places, shapes))
  files, shards = shardtable.merge_records(records, expect=count)
  step_dir = root / layout.step_dirname(1)
  (step_dir / layout.STATE_DIR).mkdir(parents=True)
  files[layout.RUN_STATE] = {'size': 2, 'crc32': f'{manifest.crc32(b"{}"):08x}'}
  (step_dir / layout.RUN_STATE).write_bytes(b'{}')
  written = shardtable.write(step_dir / shardtable.SHARDS, shards)
  table = [{'name': f'w{i:03d}', 'shape': [4, 8], 'dtype': 'float32', 'spec': None}
           for i in range(leaves)]
  meta = {
      'storage': 'safetensors', 'state_files': sorted(r for r in files if r != layout.RUN_STATE),
      shardtable.KEY: shardtable.SHARDS
  }
  raw = manifest.sealed_json(manifest.build(1, {**files, shardtable.SHARDS: written}, table, meta))
  atomic.write_file_durably(step_dir / layout.MANIFEST, raw)
  target = {f'w{i:03d}': _Leaf((4, 8), _Replicated(count)) for i in range(leaves)}
  return files, target


def _part(k: int) -> str:
  return f'{layout.STATE_DIR}/{statefile.file_name(k)}'


def _lost_host(count: int) -> list[list[str]]:
  """What each process holds intact with one replica each (its own part and the one before
  it on the ring), but process 1, whose disk was wiped."""
  intact = [[_part(k), _part((k - 1) % count)] + OWN for k in range(count)]
  intact[1] = []
  return intact


def test_a_part_several_processes_lack_goes_to_all_of_them_at_once_from_its_owner(tmp_path):
  """Data parallel, host 1 lost: every process needs every part, and holds two. Each part goes
  from its owner (process 1's from its replica on process 2) to all that lack it together, in
  one collective per window (`spreads.spread`), not one round per receiver; each process reads
  the two it holds from its own disk."""
  files, target = _checkpoint(tmp_path, 6, leaves=12)
  plan = peerplan.build(tmp_path, 1, _lost_host(6), target, 6, False, 1)
  moves = peerplan.moves_of(plan)
  holders = [{s, (s + 1) % 6} - {1} for s in range(6)]  # part s: its owner and the next, but 1
  assert sorted(moves.spreads) == [(_part(s), 2 if s == 1 else s,
                                    [k
                                     for k in range(6)
                                     if k not in holders[s]], None)
                                   for s in range(6)]
  assert not moves.pairs and not moves.subsets and not moves.reads
  assert [files[_part(k)]['size'] for k in range(6)] == [320] * 6  # 2 leaves each
  assert plan['held'] == [640, 0, 640, 640, 640, 640]  # its own part and its replica
  assert peerplan.members(plan['meta_to']) == [1]
  assert sorted(plan['files']) == [_part(k) for k in range(6)]


def test_a_part_one_process_lacks_goes_to_it_point_to_point(tmp_path):
  _, target = _checkpoint(tmp_path, 2, leaves=4)
  plan = peerplan.build(tmp_path, 1, _lost_host(2), target, 2, False, 1)
  moves = peerplan.moves_of(plan)
  assert sorted(moves.pairs) == [(_part(0), 0, 1), (_part(1), 0, 1)] and not moves.spreads


def test_the_plan_of_a_data_parallel_restore_grows_with_the_processes_not_their_pairs(tmp_path):
  """Every process needs every part: a plan that listed each part's receivers (and each
  process's parts) grew as N², 16x from 16 processes to 64; it grows 4x."""
  size = {}
  for count in (16, 64):
    _, target = _checkpoint(tmp_path / str(count), count, leaves=64)
    plan = peerplan.build(tmp_path / str(count), 1, _lost_host(count), target, count, False, 1)
    size[count] = len(json.dumps(plan))
    moves = peerplan.moves_of(plan)
    # Parts 0 and 1 each have one holder left, the rest two: what was listed pair by pair.
    assert sum(len(ks) for *_, ks, _ in moves.spreads) == 2 * (count - 1) + (count - 2)**2
  assert size[64] / size[16] < 6, size


def test_the_remote_fills_in_a_part_no_process_holds_read_by_one_that_needs_it(tmp_path):
  _, target = _checkpoint(tmp_path, 4, leaves=8)
  intact = [[] for _ in range(4)]  # every disk wiped but process 0's own files
  intact[0] = list(OWN)
  assert peerplan.build(tmp_path, 1, intact, target, 4, False, 0) is None
  plan = peerplan.build(tmp_path, 1, intact, target, 4, True, 0)
  moves = peerplan.moves_of(plan)
  assert moves.reads == {_part(k): k for k in range(4)}  # each its own, once in the job
  assert sorted(moves.spreads) == [
      (_part(s), s, [k for k in range(4) if k != s], None) for s in range(4)
  ]
  assert peerplan.members(plan['meta_to']) == [1, 2, 3] and plan['held'] == [0] * 4


@pytest.mark.parametrize('seed', range(5))
def test_spans_hold_the_same_processes(seed):
  rng = random.Random(seed)
  ks = rng.sample(range(200), rng.randrange(0, 200))
  runs = peerplan.spans(ks)
  assert peerplan.members(runs) == sorted(ks)
  assert all(a[1] < b[0] for a, b in zip(runs, runs[1:]))  # never two runs that touch
  assert peerplan.spans(range(1000)) == [[0, 1000]]
