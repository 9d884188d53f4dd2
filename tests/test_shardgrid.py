"""`shards.json` as a grid (version 2): each process posts its cells in binary, process 0 files
them into one table, and a reader finds a box's cells by arithmetic instead of scanning rows.

The damaged cases are sealed by the manifest as they are: whoever can write the checkpoint can
write any table, so a reader checks what it reads before a name becomes a path or a number an
index.
"""

import base64
import json

import numpy as np
import pytest

from jaxckpt.checkpoint import CheckpointError, layout, manifest, shardgrid, shardtable

SHAPES = {'w': [4, 3], 'b': [3], 'step': []}
GRID = shardgrid.Grid([('w', [4, 3], [2, 1]), ('b', [3], [1]), ('step', [], [])])


def places_of(k: int) -> dict:
  """Process k's shards: half of `w`'s rows each; process 1 also `b`, process 0 `step`."""
  out = {f'w[{2 * k}:{2 * k + 2},0:3]': {'array': 'w', 'start': [2 * k, 0]}}
  out.update({'b': {'array': 'b', 'start': [0]}} if k else {'step': {'array': 'step', 'start': []}})
  return out


def records(grid=GRID) -> list[str]:
  out = []
  for k in range(2):
    places = places_of(k)
    crcs = {t: f'{0xc0 + k:08x}' for t in places}
    out.append(
        shardtable.part_record(f'state/process_{k}.safetensors',
                               {'size': 10 + k, 'crc32': f'{k:08x}'}, crcs, places, {}, grid))
  return out


def checkpoint(tmp_path, body: bytes | None = None):
  """(step_dir, manifest) sealed over a `shards.json` of `body` (the merged records' by
  default)."""
  files, parts = shardtable.merge_records(records(), expect=2, grid=GRID)
  body = shardtable.table_bytes(parts) if body is None else body
  step_dir = tmp_path / layout.step_dirname(1)
  step_dir.mkdir(parents=True)
  (step_dir / shardtable.SHARDS).write_bytes(body)
  meta = {'state_files': sorted(files), shardtable.KEY: shardtable.SHARDS}
  files[shardtable.SHARDS] = shardtable.entry(body)
  tensors = [{'name': n, 'shape': s, 'dtype': 'float32', 'spec': None} for n, s in SHAPES.items()]
  raw = manifest.sealed_json(manifest.build(1, files, tensors, meta))
  (step_dir / layout.MANIFEST).write_bytes(raw)
  return step_dir, manifest.parse(step_dir, raw)


def table(**change) -> bytes:
  """The merged table's JSON with `change` applied, as bytes."""
  _, parts = shardtable.merge_records(records(), expect=2, grid=GRID)
  return json.dumps({**json.loads(shardtable.table_bytes(parts)), **change}).encode()


def test_even_splits_are_grids_and_anything_else_is_not():
  boxes = [((0, 2), (0, 3)), ((2, 4), (0, 3))]
  assert shardgrid.parts_of(boxes, [4, 3]) == [2, 1]
  assert shardgrid.parts_of([((0, 3),), ((3, 5),)], [5]) == [2]  # ceil: the last part shorter
  assert shardgrid.parts_of([()], []) == []
  assert shardgrid.parts_of([((0, 0),)], [0]) == [1]
  assert shardgrid.parts_of([((0, 1),), ((1, 4),)], [4]) is None  # uneven
  assert shardgrid.parts_of([((0, 2), (0, 3))], [4, 3]) is None  # a part missing
  assert shardgrid.parts_of([((0, 2), (0, 2)), ((2, 4), (2, 3))], [4, 3]) is None  # not a product


def test_process_0_files_every_cell_and_a_reader_gets_the_rows_back(tmp_path):
  step_dir, meta = checkpoint(tmp_path)
  assert meta['format_version'] == 3
  body = (step_dir / shardtable.SHARDS).read_bytes()
  assert json.loads(body)['version'] == 2  # still JSON: the cells are base64 in it
  got = shardtable.shard_table(step_dir, meta, None)
  assert got['w'] == [
      {
          'file': 'state/process_0.safetensors', 'tensor': 'w[0:2,0:3]', 'start': [0, 0],
          'shape': [2, 3], 'crc32': '000000c0'
      },
      {
          'file': 'state/process_1.safetensors', 'tensor': 'w[2:4,0:3]', 'start': [2, 0],
          'shape': [2, 3], 'crc32': '000000c1'
      },
  ]
  assert got['b'] == [{
      'file': 'state/process_1.safetensors', 'tensor': 'b', 'start': [0], 'shape': [3],
      'crc32': '000000c1'
  }]
  assert [r['tensor'] for r in got['step']] == ['step']
  # A box finds just the cells it overlaps: rows 1-2 of w touch both, row 3 one.
  assert [r['start'] for r in got.overlapping('w', ((1, 3), (0, 3)))] == [[0, 0], [2, 0]]
  assert [r['start'] for r in got.overlapping('w', ((3, 4), (1, 2)))] == [[2, 0]]
  assert got.overlapping('w', ((2, 2), (0, 3))) == [] and got.overlapping('nothing', ()) == []
  # The same bytes from the same records: each host that commits its own part writes them.
  _, again = shardtable.merge_records(records(), expect=2, grid=GRID)
  assert shardtable.table_bytes(again) == body
  assert manifest.audit(step_dir, meta, checksums=True, absent_ok=meta['state_files'])[1] == []


def test_records_that_miss_or_repeat_a_cell_commit_nothing():
  first, second = records()
  mine = first.partition('\n')[2]
  cells = lambda *pairs: base64.b64encode(np.array(pairs, '<u4').tobytes()).decode()
  for posts, why in (
      ([mine, ''], 'no times'),  # process 1 posted none of its cells
      ([mine, mine], 'more than once'),
      ([mine, 'not base64!'], 'not base64'),
      ([mine, base64.b64encode(b'abc').decode()], 'not whole cells'),
      ([mine, cells(9, 0)], 'beyond'),
  ):
    with pytest.raises(CheckpointError) as e:
      shardgrid.merge(GRID, posts)
    assert e.value.code == 'E-DIST-002' and why in e.value.what, why
  head = json.loads(second.partition('\n')[0])
  other = shardgrid.Grid([('b', [3], [1]), ('w', [4, 3], [2, 1]), ('step', [], [])])
  rows = shardtable.part_record('state/process_0.safetensors', {'size': 1, 'crc32': '0'},
                                {'b': '00000000'}, {'b': {'array': 'b', 'start': [0]}}, {'b': (3,)})
  for bad in (
      json.dumps({**head, 'cells': 1}) + '\n' + second.partition('\n')[2],  # says 1, posts 2
      records(other)[1],  # the same cells, numbered in another leaf order
      rows,  # JSON rows
  ):
    with pytest.raises(CheckpointError) as e:
      shardtable.merge_records([first, bad], expect=2, grid=GRID)
    assert e.value.code == 'E-DIST-002' and 'another grid' in e.value.what, bad


def test_a_target_of_another_shape_finds_only_the_cells_the_array_has(tmp_path):
  step_dir, meta = checkpoint(tmp_path)
  got = shardtable.shard_table(step_dir, meta, None)
  assert 'w' in got and 'x' not in got
  assert [r['start'] for r in got.overlapping('w', ((0, 8), (0, 3)))] == [[0, 0], [2, 0]]
  assert got.overlapping('w', ((4, 8), (0, 3))) == [] and got.overlapping('w', ((0, 4),)) == []
  assert got.overlapping('b', ((0, 3), (0, 1))) == []


@pytest.mark.parametrize(
    'change, why',
    [
        ({'grid': [['w', [2, 1]], ['b', [1]]]}, 'fewer cells than the bytes hold'),
        ({'grid': [['w', [3, 1]], ['b', [1]], ['step', []]]}, 'an uneven split'),
        ({'grid': [['w', [2]], ['b', [1]], ['step', []]]}, 'the wrong rank'),
        ({'grid': [['w', [2, 1]], ['w', [2, 1]], ['step', []]]}, 'an array twice'),
        ({'grid': [['x', [1]], ['b', [1]], ['step', []]]}, 'an array the manifest does not list'),
        ({'grid': [['w', [2.0, 1]], ['b', [1]], ['step', []]]}, 'a count that is no int'),
        ({'grid': {'w': [2, 1]}}, 'not a list'),
        ({'files': ['../../etc/passwd', 'state/process_1.safetensors']}, 'a path outside'),
        ({'files': ['state/process_0.safetensors', 'state/process_7.safetensors']}, 'unlisted'),
        ({'files': ['state/process_0.safetensors']}, 'a process with no file'),
        ({'cells': 'AAAA'}, 'too few cells'),
        ({'cells': '&&&&'}, 'not base64'),
        ({'cells': 7}, 'not a string'),
    ],
)
def test_a_sealed_grid_that_does_not_add_up_is_refused_in_one_line(tmp_path, change, why):
  step_dir, meta = checkpoint(tmp_path, table(**change))
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, meta, None)
  assert e.value.code == 'E-CKPT-012' and 'shards.json' in e.value.what, why
  assert '\n' not in e.value.what
  _, problems = manifest.audit(step_dir, checksums=True, absent_ok=meta['state_files'])
  assert len(problems) == 1, problems  # `jaxckpt verify` says so too
