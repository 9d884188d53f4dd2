"""What a checkpoint's manifest and shard table say is checked before it is used: real
checkpoints written by the library, then damaged (or re-sealed over a change, as a hostile or
faulty writer could), are refused in one line with a stable code, never restored wrong and never
a traceback.

- Shard rows must tile their array: rows that overlap, their sizes adding up all the same, would
  leave part of it unread (E-CKPT-012), from shards.json or a format-1 manifest's tensor rows.
- A manifest field of the wrong type (format_version "3", a tensor row without its name, a size
  that is a string) is E-CKPT-004 naming the field, for every reader of the manifest; a field
  only `jaxckpt inspect` shows is named in a warning and left out.
- JSON nested too deep to parse is malformed JSON (E-CKPT-004, E-CKPT-012), not a RecursionError.
- `jaxckpt verify URL --no-checksums` is refused (exit 2): a remote checkpoint is read whole.
"""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import call_cli

from jaxckpt.checkpoint import (CheckpointError, CheckpointManager, discovery, formats, jobcommit,
                                layout, manifest, multihost, shardtable, statefile)
from jaxckpt.checkpoint.remote import Store, objects

X = np.array([7, 7, 9, 9], np.float32)
DEEP = b'[' * 100_000 + b']' * 100_000


def two_writers(root: Path, boxes: list[tuple[int, int]], *, in_manifest: bool = False) -> Path:
  """Checkpoint step 1 of `x` (`X`), as two processes commit it: process k wrote the shard
  `boxes[k]` ([start, stop)) of it into its own state file. The shard rows are in shards.json,
  or (`in_manifest`) in the tensor rows of a format-1 manifest."""
  tmp = root / 'writing'
  records = []
  for k, (a, b) in enumerate(boxes):
    tensor, name = f'x[{a}:{b}]', statefile.file_name(k)
    places = {tensor: {'array': 'x', 'start': [a], 'global_shape': [4]}}
    written, crcs = statefile.write(
        tmp / layout.STATE_DIR, {tensor: X[a:b]},
        name=name,
        metadata=multihost.header_metadata(places))
    records.append(
        shardtable.part_record(f'{layout.STATE_DIR}/{name}', written[name], crcs, places,
                               {tensor: (b - a,)}))
  files, parts = shardtable.merge_records(records, expect=2)
  tensors = [{'name': 'x', 'shape': [4], 'dtype': 'float32', 'spec': None}]
  meta = {'storage': 'safetensors'}
  if in_manifest:
    tensors[0]['shards'] = [
        {k: v for k, v in s.items() if k != 'array'} for p in parts for s in json.loads(p)
    ]
    meta['state_files'] = sorted(files)
  else:
    files[shardtable.SHARDS] = shardtable.write(tmp / shardtable.SHARDS, parts)
    meta = jobcommit.listing(meta, files, 'safetensors', True)
  step_dir = root / layout.step_dirname(1)
  manifest.commit(tmp, step_dir, 1, files, tensors, meta, b'{"step": 1}\n')
  return step_dir


def restore_x(step_dir: Path) -> np.ndarray:
  target = {
      'x':
          jax.ShapeDtypeStruct((4,),
                               np.float32,
                               sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  }
  state, _ = CheckpointManager(step_dir.parent, writer=False).restore(step_dir, target)
  return np.asarray(state['x'])


@pytest.mark.parametrize('in_manifest', [False, True], ids=['shards.json', 'format-1 rows'])
def test_shard_rows_that_overlap_are_refused_not_restored(tmp_path, capsys, in_manifest):
  good = two_writers(tmp_path / 'good', [(0, 2), (2, 4)], in_manifest=in_manifest)
  assert restore_x(good).tobytes() == X.tobytes()
  assert call_cli(['verify', str(good)], capsys)[0] == 0
  # Both processes say they wrote x[0:2]: two rows of 2 elements, as many as x has; x[2:4] is in
  # no file.
  bad = two_writers(tmp_path / 'bad', [(0, 2), (0, 2)], in_manifest=in_manifest)
  for read in (restore_x, formats.read_host_arrays):
    with pytest.raises(CheckpointError) as e:
      read(bad)
    assert e.value.code == 'E-CKPT-012', e.value.line()
    assert 'shard rows of x' in e.value.what and 'overlap' in e.value.what
    assert len(e.value.line().splitlines()) == 1
  code, out, err = call_cli(['verify', str(bad)], capsys)
  assert code == 1 and not err, err
  assert out.startswith(f'FAIL {bad}: the shard rows of x do not add up'), out


def rows_table(tmp_path: Path, boxes: list[tuple[list[int], list[int]]]) -> tuple[Path, dict]:
  """A sealed manifest for an array `w` of shape [5, 7] whose shards.json (JSON rows, in the
  first process's file) holds `boxes` ((start, extent) each)."""
  rows = [{
      'array': 'w', 'file': 'state/process_0.safetensors', 'tensor': f'w{k}', 'start': start,
      'shape': extent, 'crc32': '00000000'
  } for k, (start, extent) in enumerate(boxes)]
  body = json.dumps({'format': shardtable.FORMAT, 'parts': [rows]}).encode()
  step_dir = tmp_path / layout.step_dirname(1)
  step_dir.mkdir(parents=True)
  (step_dir / shardtable.SHARDS).write_bytes(body)
  files = {
      'state/process_0.safetensors': {'size': 1, 'crc32': '00000000'},
      shardtable.SHARDS: shardtable.entry(body)
  }
  meta = {'state_files': ['state/process_0.safetensors'], shardtable.KEY: shardtable.SHARDS}
  tensors = [{'name': 'w', 'shape': [5, 7], 'dtype': 'float32', 'spec': None}]
  raw = manifest.sealed_json(manifest.build(1, files, tensors, meta))
  (step_dir / layout.MANIFEST).write_bytes(raw)
  return step_dir, manifest.parse(step_dir, raw)


def grid(rows: list[int], cols: list[int]) -> list[tuple[list[int], list[int]]]:
  """The boxes of a split of [5, 7] at the row and column edges given (0 and the end implied)."""
  rs, cs = [0, *rows, 5], [0, *cols, 7]
  return [([a, c], [b - a, d - c]) for a, b in zip(rs, rs[1:]) for c, d in zip(cs, cs[1:])]


@pytest.mark.parametrize(
    'change, why',
    [
        (lambda g: g[:-1] + [([3, 3], [2, 2])], 'the last box moved onto its neighbour'),
        (lambda g: g[:-1] + [g[2]], 'a box of the same size as the last twice, the last not'),
    ],
)
def test_a_shard_table_whose_rows_do_not_tile_their_array_is_refused(tmp_path, change, why):
  """Rows of any split (uneven, as a table of JSON rows holds) pass when they tile the array;
  the same number of elements otherwise placed is refused."""
  boxes = grid([2, 3], [1, 5])  # uneven in both dimensions
  step_dir, meta = rows_table(tmp_path / 'good', boxes)
  assert len(shardtable.shard_table(step_dir, meta, None)['w']) == 9
  step_dir, meta = rows_table(tmp_path / 'bad', change(boxes))
  with pytest.raises(CheckpointError) as e:
    shardtable.shard_table(step_dir, meta, None)
  assert e.value.code == 'E-CKPT-012' and 'shard rows of w' in e.value.what, why


def test_ten_thousand_rows_are_checked_without_comparing_every_pair():
  """10,000 rows of one array (a 100 x 100 split): a pairwise check would be 50 million
  comparisons; the sweep looks at each row a few times."""
  boxes = [([r, c], [1, 1]) for r in range(100) for c in range(100)]
  assert shardtable.tiles(boxes, [100, 100])
  assert not shardtable.tiles(boxes[:-1] + [([99, 98], [1, 1])], [100, 100])
  assert not shardtable.tiles(boxes[:-1], [100, 100])
  assert shardtable.tiles([([], [])], []) and not shardtable.tiles([([], []), ([], [])], [])


# ---------------------------------------------------------------------------- manifests
@pytest.fixture(scope='module')
def saved(tmp_path_factory) -> Path:
  """A checkpoints directory with steps 1 and 2 saved by the library, with what a trainer adds
  to its manifest (knobs, metrics...)."""
  root = tmp_path_factory.mktemp('saved') / 'checkpoints'
  metadata = {
      'metrics': {'heldout_loss': 2.5}, 'knobs': {'train.lr': {'value': 0.1, 'source': 'flag'}},
      'sources': {'jaxckpt/main.py': 'ab' * 32}, 'counters': {'step': 2}
  }
  with CheckpointManager(root) as mgr:
    for step in (1, 2):
      mgr.save(
          step, {'w': jnp.arange(6.0).reshape(2, 3), 'b': jnp.zeros(3)}, {'step': step},
          metadata=metadata)
  return root


def edited(saved: Path, tmp_path: Path, change, *, seal: bool = True) -> Path:
  """A copy of `saved`, its step 2 manifest changed by `change(m)` and (`seal`) sealed again."""
  root = tmp_path / 'checkpoints'
  shutil.copytree(saved, root)
  step_dir = root / layout.step_dirname(2)
  m = json.loads((step_dir / layout.MANIFEST).read_bytes())
  change(m)
  raw = manifest.sealed_json(m) if seal else json.dumps(m, indent=1).encode()
  (step_dir / layout.MANIFEST).write_bytes(raw)
  return step_dir


def _set(**fields):
  return lambda m: m.update(fields)


def _tensor(**fields):
  return lambda m: m['tensors'][0].update(fields)


def _file(**fields):
  return lambda m: next(iter(m['files'].values())).update(fields)


BAD_FIELDS = [
    ('format_version a string', _set(format_version='3'), 'format_version'),
    ('format_version null', _set(format_version=None), 'format_version'),
    ('step a string', _set(step='2'), 'step'),
    ('step true', _set(step=True), 'step'),
    ('committed_at a string', _set(committed_at='yesterday'), 'committed_at'),
    ('tensors an object', _set(tensors={'w': [2, 3]}), 'tensors'),
    ('a tensor row without its name', lambda m: m['tensors'][0].pop('name'), 'tensors[0]'),
    ('a shape of strings', _tensor(shape=['2', '3']), 'tensors[0]'),
    ('a dtype that is a number', _tensor(dtype=5), 'tensors[0]'),
    ('files a list', _set(files=['run_state.json']), 'files'),
    ('a size that is a string', _file(size='12'), 'files['),
    ('a crc32 that is a number', _file(crc32=5), 'files['),
    ('storage a list', _set(storage=['safetensors']), 'storage'),
]


@pytest.mark.parametrize(
    'change, field', [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_a_manifest_field_of_the_wrong_type_is_refused_in_one_line(saved, tmp_path, capsys, change,
                                                                   field):
  step_dir = edited(saved, tmp_path, change)  # sealed again: only the types are wrong
  with pytest.raises(CheckpointError) as e:
    manifest.read(step_dir)
  assert e.value.code == 'E-CKPT-004' and f'manifest.json: {field}' in e.value.what, e.value.what
  assert len(e.value.line().splitlines()) == 1
  # A resume passes over it to the step before, saying why.
  path, skipped = discovery.latest_intact(step_dir.parent)
  assert path == step_dir.parent / layout.step_dirname(1)
  assert skipped == [(step_dir, e.value.what.removeprefix(f'{step_dir}: '))]
  for argv in (['inspect', str(step_dir)], ['inspect', str(step_dir), '--json']):
    code, out, err = call_cli(argv, capsys)
    assert code == 1 and not out and err.startswith('jaxckpt: E-CKPT-004: '), err
    assert err.count('\n') == 1 and field in err
  code, out, err = call_cli(['verify', str(step_dir)], capsys)
  assert code == 1 and not err
  assert out.splitlines() == [f'FAIL {step_dir}: {e.value.what.removeprefix(f"{step_dir}: ")}']


def test_a_wrong_type_in_an_edited_manifest_says_its_seal_fails_too(saved, tmp_path, capsys):
  step_dir = edited(saved, tmp_path, _set(step='2'), seal=False)
  with pytest.raises(CheckpointError) as e:
    manifest.read(step_dir)
  assert e.value.code == 'E-CKPT-004' and 'step is "2"' in e.value.what
  assert 'manifest.json: checksum mismatch' in e.value.what
  code, out, _ = call_cli(['verify', str(step_dir)], capsys)
  assert code == 1 and 'checksum mismatch' in out


SHOWN_ONLY = [
    ('metrics', {'heldout_loss': 'low'}),
    ('knobs', {'train.lr': 0.1}),
    ('sources', ['jaxckpt/main.py']),
    ('parameters', [{'shape': [2, 3]}]),
    ('init_from', 'hf://gpt2'),
    ('optimizer', {'w': 'mu'}),
    ('committed_at', 1e300),
]


@pytest.mark.parametrize('field, value', SHOWN_ONLY, ids=[c[0] for c in SHOWN_ONLY])
def test_inspect_shows_a_manifest_whose_displayed_field_is_malformed(saved, tmp_path, capsys, field,
                                                                     value):
  step_dir = edited(saved, tmp_path, _set(**{field: value}))
  code, out, err = call_cli(['inspect', str(step_dir)], capsys)
  assert code == 0 and not err, err
  lines = out.splitlines()
  warning = f'WARNING: manifest.json: its {field} field is not what jaxckpt writes: not shown'
  assert lines[0] == lines[-1] == warning, out
  assert lines[1] == f'checkpoint  {step_dir}' and 'tensors (2, 36 bytes)' in out
  code, out, _ = call_cli(['inspect', str(step_dir), '--json'], capsys)
  d = json.loads(out)
  assert code == 0 and d['malformed'] == [field] and d[field] == value
  assert d['manifest_seal'] == 'ok'


def test_a_manifest_nested_too_deep_is_malformed_not_a_crash(saved, tmp_path, capsys):
  step_dir = edited(saved, tmp_path, lambda m: None)
  (step_dir / layout.MANIFEST).write_bytes(DEEP)
  with pytest.raises(CheckpointError) as e:
    manifest.read(step_dir)
  assert e.value.code == 'E-CKPT-004' and 'nested too deep' in e.value.what
  path, skipped = discovery.latest_intact(step_dir.parent)
  assert path == step_dir.parent / layout.step_dirname(1) and skipped[0][0] == step_dir
  code, out, err = call_cli(['inspect', str(step_dir)], capsys)
  assert code == 1 and err.startswith('jaxckpt: E-CKPT-004: ') and err.count('\n') == 1
  code, out, err = call_cli(['verify', str(step_dir)], capsys)
  assert code == 1 and out.startswith(f'FAIL {step_dir}: ') and 'Traceback' not in err


def test_a_shard_table_nested_too_deep_is_malformed_not_a_crash(tmp_path):
  step_dir = two_writers(tmp_path, [(0, 2), (2, 4)])
  m = manifest.read(step_dir)
  (step_dir / shardtable.SHARDS).write_bytes(DEEP)
  m['files'][shardtable.SHARDS] = shardtable.entry(DEEP)
  (step_dir / layout.MANIFEST).write_bytes(manifest.sealed_json(m))
  with pytest.raises(CheckpointError) as e:
    formats.read_host_arrays(step_dir)
  assert e.value.code == 'E-CKPT-012' and 'shards.json: not JSON' in e.value.what


# ------------------------------------------------------------------------------- verify
def test_verify_names_the_checkpoint_once(saved, tmp_path, capsys):
  step_dir = edited(saved, tmp_path, lambda m: m['files'].update(
      {'../../outside': {'size': 1, 'crc32': '00000000'}}))  # sealed: a hostile writer's
  code, out, _ = call_cli(['verify', str(step_dir)], capsys)
  assert code == 1 and out.splitlines() == [
      f"FAIL {step_dir}: manifest names a file outside the checkpoint: '../../outside': "
      'a name that leaves its directory (an empty, . or .. part)'
  ]


def test_verify_refuses_sizes_only_for_a_remote_checkpoint(saved, tmp_path, capsys):
  (tmp_path / 'bucket').mkdir()
  url = f'file://{tmp_path}/bucket/run'
  objects.upload(Store(url), saved / layout.step_dirname(1), {})
  code, out, err = call_cli(['verify', url, '--no-checksums'], capsys)
  assert code == 2 and not out
  assert err.startswith('jaxckpt: E-USAGE-001: ') and '--no-checksums' in err
  assert err.count('\n') == 1
  code, out, _ = call_cli(['verify', url], capsys)  # every byte read
  assert code == 0 and out.splitlines() == [f'OK {url}/checkpoints/step_00000001']
