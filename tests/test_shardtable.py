"""`shards.json`: the shard table of a checkpoint written by several processes, beside its manifest.

Process 0 copies each process's shard rows into it without parsing them; a reader takes it only
at the size and CRC-32 the sealed manifest says, and checks every row before using it (a name in
it becomes a path, a box an offset). Manifests from before it (format 1) list the shards in their
tensor rows and read as they did.
"""

import json

import numpy as np
import pytest

from jaxckpt.checkpoint import CheckpointError, layout, manifest, shardtable

SHAPES = {'w': [4, 3], 'b': [3]}


def records() -> list[str]:
  """Two processes' part records: each holds half of `w`'s rows; process 1 holds all of `b`."""
  out = []
  for k in range(2):
    rel = f'state/process_{k}.safetensors'
    places = {f'w[{2 * k}:{2 * k + 2},0:3]': {'array': 'w', 'start': [2 * k, 0]}}
    shapes = {f'w[{2 * k}:{2 * k + 2},0:3]': (2, 3)}
    if k == 1:
      places['b'], shapes['b'] = {'array': 'b', 'start': [0]}, (3,)
    crcs = {t: f'{k:08x}' for t in places}
    out.append(
        shardtable.part_record(rel, {'size': 100 + k, 'crc32': f'aa{k:06x}'}, crcs, places, shapes))
  return out


def checkpoint(tmp_path, body: bytes | None = None):
  """(step_dir, manifest) of a sealed two-process manifest whose shards.json is `body`."""
  files, parts = shardtable.merge_records(records(), expect=2)
  shards = shardtable.table_bytes(parts)
  step_dir = tmp_path / layout.step_dirname(1)
  step_dir.mkdir(parents=True)
  (step_dir / shardtable.SHARDS).write_bytes(shards if body is None else body)
  meta = {'state_files': sorted(files), shardtable.KEY: shardtable.SHARDS}
  files[shardtable.SHARDS] = shardtable.entry(shards if body is None else body)
  tensors = [{'name': n, 'shape': s, 'dtype': 'float32', 'spec': None} for n, s in SHAPES.items()]
  raw = manifest.sealed_json(manifest.build(1, files, tensors, meta))
  (step_dir / layout.MANIFEST).write_bytes(raw)
  return step_dir, manifest.parse(step_dir, raw)


def test_process_0_copies_the_rows_and_parses_only_each_records_first_line(tmp_path):
  files, parts = shardtable.merge_records(records(), expect=2)
  shards = shardtable.table_bytes(parts)
  assert files == {
      'state/process_0.safetensors': {'size': 100, 'crc32': 'aa000000'},
      'state/process_1.safetensors': {'size': 101, 'crc32': 'aa000001'}
  }
  table = json.loads(shards)
  assert table['format'] == 'jaxckpt.shards'
  assert [[s['tensor'] for s in part] for part in table['parts']] == \
      [['w[0:2,0:3]'], ['w[2:4,0:3]', 'b']]
  # The rows are the records' own bytes: what a process posted is what the table holds.
  assert all(r.split('\n', 1)[1].encode() in shards for r in records())
  # Written a process's rows at a time, durably, with the size and CRC-32 of those bytes.
  assert shardtable.write(tmp_path / 'shards.json', parts) == shardtable.entry(shards)
  assert (tmp_path / 'shards.json').read_bytes() == shards
  assert [p.name for p in tmp_path.iterdir()] == ['shards.json']


def test_a_reader_gets_every_arrays_shards_from_the_file_the_manifest_seals(tmp_path):
  step_dir, meta = checkpoint(tmp_path)
  assert meta['format_version'] == 3 and all('shards' not in r for r in meta['tensors'])
  got = shardtable.shard_table(step_dir, meta, None)
  assert [(s['file'], s['start'], s['shape']) for s in got['w']] == [
      ('state/process_0.safetensors', [0, 0], [2, 3]),
      ('state/process_1.safetensors', [2, 0], [2, 3]),
  ]
  assert [s['tensor'] for s in got['b']] == ['b'] and 'array' not in got['b'][0]
  assert manifest.audit(step_dir, meta, checksums=False, absent_ok=meta['state_files'])[1] == []


def test_a_shard_table_that_is_not_what_the_manifest_says_is_refused(tmp_path):
  step_dir, meta = checkpoint(tmp_path)
  body = bytearray((step_dir / shardtable.SHARDS).read_bytes())
  body[-10] ^= 1
  (step_dir / shardtable.SHARDS).write_bytes(bytes(body))
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, meta, None)
  assert e.value.code == 'E-CKPT-003' and 'shards.json' in e.value.what
  (step_dir / shardtable.SHARDS).unlink()
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, meta, None)
  assert e.value.code == 'E-CKPT-012' and 'shards.json' in e.value.what


@pytest.mark.parametrize(
    'row, why',
    [
        ({'file': '../../etc/passwd'}, 'a path outside the checkpoint'),
        ({'file': 'state/process_7.safetensors'}, 'a file the checkpoint does not list'),
        ({'start': [3, 0]}, 'a box past the end of its array'),
        ({'start': [-1, 0]}, 'a negative start'),
        ({'shape': [2]}, 'a box of the wrong rank'),
        ({'shape': [2.0, 3]}, 'a count that is not a whole number'),
        ({'array': 'nothing'}, 'an array the manifest does not list'),
        ({'tensor': 5}, 'a tensor name that is not a string'),
        ({'crc32': None}, 'a shard without its CRC-32: its bytes would go unchecked'),
    ],
)
def test_a_sealed_shard_table_with_a_bad_row_is_refused_in_one_line(tmp_path, row, why):
  """Whoever can write the checkpoint can write a shards.json and seal a manifest over it: a
  row is used only once it is sound."""
  parts = [[{
      'array': 'w', 'file': 'state/process_0.safetensors', 'tensor': 'w[0:2,0:3]', 'start': [0, 0],
      'shape': [2, 3], 'crc32': '00000000', **row
  }]]
  body = json.dumps({'format': 'jaxckpt.shards', 'parts': parts}).encode()
  step_dir, meta = checkpoint(tmp_path, body)
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, meta, None)
  assert e.value.code == 'E-CKPT-012' and 'malformed shard row' in e.value.what, why
  assert '\n' not in e.value.what


@pytest.mark.parametrize('body', [b'[1, 2]', b'not json', b'{"format": "jaxckpt.shards"}'])
def test_a_file_that_is_no_shard_table_is_refused(tmp_path, body):
  step_dir, meta = checkpoint(tmp_path, body)
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, meta, None)
  assert e.value.code == 'E-CKPT-012' and 'shards.json' in e.value.what


def test_a_manifest_naming_another_file_as_its_shard_table_is_refused(tmp_path):
  step_dir, meta = checkpoint(tmp_path)
  for name in ('run_state.json', '../shards.json', ['x']):
    with pytest.raises(CheckpointError) as e:
      shardtable.shard_table(step_dir, {**meta, shardtable.KEY: name}, None)
    assert e.value.code == 'E-CKPT-012', name


def test_a_format_1_manifest_with_shards_in_its_rows_reads_as_before(tmp_path):
  parts = [json.loads(r.split('\n', 1)[1]) for r in records()]
  tensors = []
  for name, shape in SHAPES.items():
    shards = [
        {k: v for k, v in s.items() if k != 'array'} for p in parts for s in p if s['array'] == name
    ]
    tensors.append({'name': name, 'shape': shape, 'dtype': 'float32', 'shards': shards})
  files, _ = shardtable.merge_records(records(), expect=2)
  meta = manifest.build(1, files, tensors, {'state_files': sorted(files)})
  assert meta['format_version'] == 1
  got = shardtable.shard_table(tmp_path, meta, None)
  assert [s['start'] for s in got['w']] == [[0, 0], [2, 0]]
  assert int(np.prod(got['b'][0]['shape'])) == 3
  bad = [{**tensors[0], 'shards': [{**tensors[0]['shards'][0], 'file': '/abs'}]}, tensors[1]]
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(tmp_path, {**meta, 'tensors': bad}, None)
  assert e.value.code == 'E-CKPT-012'


def test_verify_checks_every_row_and_a_size_only_look_parses_none(tmp_path):
  """`jaxckpt verify` (every byte read) judges the rows too; `latest` and `inspect` (sizes
  only) never parse the table, which is what keeps them fast at a thousand processes."""
  parts = [[{
      'array': 'w', 'file': '../outside', 'tensor': 'w', 'start': [0, 0], 'shape': [4, 3],
      'crc32': '00000000'
  }]]
  body = json.dumps({'format': 'jaxckpt.shards', 'parts': parts}).encode()
  step_dir, meta = checkpoint(tmp_path, body)
  absent = meta['state_files']
  _, problems = manifest.audit(step_dir, checksums=True, absent_ok=absent)
  assert len(problems) == 1 and 'malformed shard row' in problems[0], problems
  assert manifest.audit(step_dir, checksums=False, absent_ok=absent)[1] == []


def test_rows_that_repeat_or_leave_out_part_of_an_array_are_refused(tmp_path):
  """Each shard is written once in the job: an array's rows add up to it, or the table lies."""
  row = {
      'array': 'b', 'file': 'state/process_1.safetensors', 'tensor': 'b', 'start': [0],
      'shape': [3], 'crc32': '00000001'
  }
  for rows in ([row, row], [{**row, 'shape': [2]}]):
    body = json.dumps({'format': 'jaxckpt.shards', 'parts': [rows]}).encode()
    step_dir, meta = checkpoint(tmp_path / str(len(rows)), body)
    with pytest.raises(CheckpointError) as e:
      shardtable.shard_table(step_dir, meta, None)
    assert e.value.code == 'E-CKPT-012' and 'do not add up' in e.value.what, rows


def test_a_malformed_tensor_table_is_one_line_not_a_traceback(tmp_path):
  step_dir, meta = checkpoint(tmp_path)
  for tensors in ('x', [5], [{'name': 'w', 'shape': 'ab'}], [{'shape': [4, 3]}]):
    with pytest.raises(CheckpointError) as e:
      shardtable.shard_table(step_dir, {**meta, 'tensors': tensors}, None)
    assert e.value.code == 'E-CKPT-012' and 'tensor table' in e.value.what, tensors
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, {**meta, 'files': ['shards.json']}, None)
  assert e.value.code == 'E-CKPT-012'


def test_a_store_that_answers_with_fewer_records_than_processes_commits_nothing():
  with pytest.raises(CheckpointError) as e:
    shardtable.merge_records(records()[:1], expect=2)
  assert e.value.code == 'E-DIST-002' and '1 of 2 part records' in e.value.what
