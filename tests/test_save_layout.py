"""Which shards each process of a save writes (`multihost._owned`), and the save's grid
(`multihost._grid`), worked out by every process from the shardings alone: each shard written
once in the job, by a process that holds it, the bytes spread over the processes; and the job's
devices walked once per distinct layout, not once per leaf (a fully sharded 70B model on 1000
hosts of 8 devices has 23.7 million shards in 2,891 leaves of a few layouts).

No job of several processes runs here: the shardings are synthetic, laid out as jax's are
(equal when laid out alike)."""

import itertools

import pytest

from jaxckpt.checkpoint import multihost


class _Device:

  def __init__(self, process: int):
    self.process_index = process


class _Sharding:
  """An array split into `parts` along `axis` (None: one part), part j held by the j-th run of
  len(devices) / parts devices; `walks` counts the walks over the devices."""
  walks = 0

  def __init__(self, devices, axis, parts):
    self.devices, self.axis, self.parts = devices, axis, parts

  def __eq__(self, other):
    return (self.devices, self.axis, self.parts) == (other.devices, other.axis, other.parts)

  def __hash__(self):
    return hash((len(self.devices), self.axis, self.parts))

  def devices_indices_map(self, shape):
    _Sharding.walks += 1
    per = len(self.devices) // self.parts
    out = {}
    for j, d in enumerate(self.devices):
      k = j // per
      out[d] = tuple(
          slice(k * (n // self.parts), (k + 1) *
                (n // self.parts)) if a == self.axis else slice(None) for a, n in enumerate(shape))
    return out


@pytest.fixture(autouse=True)
def cold():
  for cached in (multihost._owned, multihost._grid, multihost.box_holders, multihost._held,
                 multihost._parts):
    cached.cache_clear()
  _Sharding.walks = 0


def _key(processes: int, per_process: int, leaves: int = 12) -> tuple:
  """Leaves of varied sizes in four layouts over `processes` x `per_process` devices: split over
  every device, replicated on every process, split in two (each half on half the processes),
  and a host value every process has."""
  devices = [_Device(k) for k in range(processes) for _ in range(per_process)]
  count = len(devices)
  out = []
  for i in range(leaves):
    rows = 8 * count * (1 + i % 3)
    sharding = [
        _Sharding(devices, 0, count),
        _Sharding(devices, None, 1),
        _Sharding(devices, 0, min(2, count)), None
    ][i % 4]
    out.append((f'w{i:02d}', (rows, 4), 4, sharding))
  return tuple(out)


def _boxes(key, processes):
  """{(leaf, box): its holders}: every distinct shard of the job."""
  out = {}
  for i, (_, shape, _, sharding) in enumerate(key):
    if sharding is None:
      out[i, tuple((0, n) for n in shape)] = set(range(processes))
      continue
    for box, holders in multihost.box_holders(sharding, shape):
      out[i, box] = set(holders)
  return out


def _nbytes(key, box_key):
  i, box = box_key
  rows = box[0][1] - box[0][0]
  return rows * (box[1][1] - box[1][0]) * key[i][2]


@pytest.mark.parametrize('processes,per_process', [(1, 1), (4, 2), (6, 1)])
def test_each_shard_is_written_once_in_the_job_by_a_process_that_holds_it(processes, per_process):
  key = _key(processes, per_process)
  everything = _boxes(key, processes)
  owned = [set(multihost._owned(key, processes, me)) for me in range(processes)]
  for a, b in itertools.combinations(owned, 2):
    assert not a & b  # no shard written twice
  assert set().union(*owned) == set(everything)  # none left out
  for me, mine in enumerate(owned):
    assert all(me in everything[b] for b in mine)  # each by one of its holders
  # The bytes spread: no process writes more than another by more than the largest shard.
  loads = [sum(_nbytes(key, b) for b in mine) for mine in owned]
  assert max(loads) - min(loads) <= max(_nbytes(key, b) for b in everything)


def test_the_devices_are_walked_once_per_layout_not_once_per_leaf():
  """48 leaves, 36 of them sharded in three ways at three shapes (each leaf with its own
  sharding object, equal to the others laid out alike, as jax makes them): the owners and the
  grid walk the devices 9 times, where they walked them twice per leaf (72 times)."""
  key = _key(16, 8, leaves=48)
  multihost._owned(key, 16, 3)
  grid = multihost._grid(key)
  layouts = {(s, shape) for _, shape, _, s in key if s is not None}
  assert len(layouts) == 9 and _Sharding.walks == 9
  assert grid is not None and [list(p) for _, _, p in grid.arrays[:4]] == [[128, 1], [1, 1], [2, 1],
                                                                           [1, 1]]
