"""`jaxckpt inspect` and `jaxckpt verify` on real checkpoints, and the corruption matrix."""

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from conftest import REPO, call_cli, subprocess_env

from jaxckpt.checkpoint import CheckpointManager, discovery, layout, manifest
from jaxckpt.checkpoint.tree import avals, named_leaves, tensor_table
from jaxckpt.cli import inspect_command
from jaxckpt.errors import ArgumentError, CheckpointError
from jaxckpt.model import gpt as model_lib
from jaxckpt.records import identity, provenance
from jaxckpt.train import state as trainer_lib

STEP_10, STEP_20 = layout.step_dirname(10), layout.step_dirname(20)


@pytest.fixture(scope='module')
def finished_run(trainer, tmp_path_factory):
  """A real tiny run with checkpoints at steps 10 and 20."""
  workdir = tmp_path_factory.mktemp('inspect-run')
  r = trainer.train(workdir, '--config.train.steps=20', '--checkpoint_every=10', '--keep=0')
  assert r.returncode == 0, r.stderr
  return workdir


@pytest.fixture(scope='module')
def pristine(finished_run, tmp_path_factory):
  """A copy of the run's checkpoints, exactly as the trainer wrote them (manifests sealed)."""
  workdir = tmp_path_factory.mktemp('pristine') / 'run'
  shutil.copytree(finished_run / 'checkpoints', workdir / 'checkpoints')
  return workdir


def test_the_writer_seals_every_manifest(pristine):
  """No test re-seals what the trainer wrote: a writer that stopped sealing fails here."""
  for step_dir in layout.committed_steps(pristine / 'checkpoints').values():
    raw = (step_dir / layout.MANIFEST).read_bytes()
    m = manifest.parse(step_dir, raw)
    assert manifest.SEAL in m and manifest.check_seal(raw, m) is None
    assert raw == manifest.sealed_json(m)


def tamper(step_dir: Path) -> str:
  """Change manifest.json's bytes but not what they say (one more space), as a stray edit
  would; returns the seal problem `jaxckpt verify` reports for it."""
  path = step_dir / layout.MANIFEST
  raw = path.read_bytes()
  path.write_bytes(raw.replace(b'"step": ', b'"step":  ', 1))
  m = manifest.parse(step_dir, path.read_bytes())
  assert m == manifest.parse(step_dir, raw)
  problem = manifest.check_seal(path.read_bytes(), m)
  assert problem and 'checksum mismatch' in problem
  return problem


# ------------------------------------------------------------------------------- inspect
def test_inspect_prints_identity_and_every_tensor(finished_run, capsys):
  step_dir = finished_run / 'checkpoints' / STEP_20
  code, out, _ = call_cli(['inspect', str(step_dir)], capsys)
  assert code == 0
  m = manifest.read(step_dir)
  assert f'checkpoint  {step_dir}' in out and 'step        20  (finished' in out
  assert 'devices 1' in out and 'jax ' + jax.__version__ in out
  assert 'train.steps' in out and 'checkpoint.every' in out
  for t in m['tensors']:  # every tensor: name, dtype, shape, spec
    line = next(l for l in out.splitlines() if l.split()[:1] == [t['name']])
    assert t['dtype'] in line and inspect_command._shape(t['shape']) in line and str(
        t['spec']) in line
  if 'parameters' in m:  # once the trainer records identities
    assert 'offset' in out and 'h.0.attn.c_attn.kernel' in out and 'sha256' in out


def test_inspect_json(finished_run, capsys):
  step_dir = finished_run / 'checkpoints' / STEP_10
  code, out, _ = call_cli(['inspect', str(step_dir), '--json'], capsys)
  assert code == 0
  d = json.loads(out)
  m = manifest.read(step_dir)
  assert d['path'] == str(step_dir) and d['step'] == 10 and d['finished'] is False
  assert [t['name'] for t in d['tensors']] == [t['name'] for t in m['tensors']]
  for t in d['tensors']:
    assert {'name', 'dtype', 'shape', 'spec', 'trainable'} <= set(t)
    if not t['name'].startswith('params/'):
      assert t['trainable'] is False
  assert d['config'] == m['config'] and d['versions'] == m['versions']


@pytest.fixture(scope='module')
def andrea_120m(tmp_path_factory):
  """A manifest for the andrea_120m config, built from shapes alone (jax.eval_shape)."""
  config = provenance.load_config_file(REPO / 'configs' / 'andrea_120m.py')
  trainer = trainer_lib.build_trainer(config)
  state = trainer.abstract_state()
  meta = identity.build(
      config=config,
      params=state.params,
      opt_state=state.opt_state,
      partition_specs=trainer.state_shardings.params,
      mesh_shape=dict(trainer.mesh.shape),
      devices=8,
      trainable=identity.trainable_fn(['wpe.*']),
      knobs=provenance.knob_table(config),
      sources=provenance.source_hashes(None),
      counters={'step': 50_000, 'tokens_seen': 50_000 * 32 * 1024},
      finished=True)
  step_dir = tmp_path_factory.mktemp('andrea_120m') / layout.step_dirname(50_000)
  step_dir.mkdir()
  m = manifest.build(50_000, {}, tensor_table(avals(named_leaves(state))), meta)
  (step_dir / layout.MANIFEST).write_bytes(manifest.sealed_json(m))
  return config, step_dir


def test_inspect_andrea_120m_loads_nothing_heavy(andrea_120m, compile_cache):
  config, step_dir = andrea_120m
  probe = ('import sys, time\n'
           't = time.perf_counter()\n'
           'from jaxckpt import cli\n'
           f'cli.main(["inspect", {str(step_dir)!r}])\n'
           f'cli.main(["inspect", {str(step_dir)!r}, "--json"])\n'
           'heavy = [m for m in ("jax", "jaxlib", "flax", "orbax", "optax", "numpy", "tensorstore")'
           ' if m in sys.modules]\n'
           'print("HEAVY", heavy, "SECONDS", time.perf_counter() - t, file=sys.stderr)\n')
  t0 = time.perf_counter()
  r = subprocess.run([sys.executable, '-c', probe],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     env=subprocess_env(compile_cache),
                     timeout=60)
  wall = time.perf_counter() - t0
  assert r.returncode == 0, r.stderr
  assert 'HEAVY [] ' in r.stderr, r.stderr
  print(f'inspect andrea_120m: {wall:.2f} s wall with interpreter start; {r.stderr.split()[-1]} '
        's in-process for both forms')
  text, js = r.stdout.split('\n{\n', 1)
  assert '121,316,064 elements' in text
  d = json.loads('{\n' + js)
  names = model_lib.parameter_names(config.model)
  assert [p['path'] for p in d['parameters']] == names
  offset = 0  # offsets are those of the flat .bin: cumulative element counts in canonical order
  for p in d['parameters']:
    assert p['offset'] == offset
    offset += math.prod(p['shape'])
  assert offset == model_lib.count_params(config.model) == 121_316_064
  by_name = {t['name']: t for t in d['tensors']}
  assert by_name['params/wpe/embedding']['trainable'] is False
  assert by_name['params/wte/embedding']['trainable'] is True
  assert by_name['params/wte/embedding']['spec'] == "('model', None)"
  assert d['optimizer']['h.11.mlp.c_fc.kernel'] == ['1/0/mu', '1/0/nu']


@pytest.mark.parametrize('make, words', [
    (lambda root: root / 'nowhere', 'does not exist'),
    (lambda root: root / 'step_00000005', 'no manifest.json'),
    (lambda root: root / 'step_00000005.tmp-0123abcd', 'temporary or half-deleted'),
    (lambda root: root / 'manifest.json', 'is a file'),
])
def test_inspect_refuses_what_is_not_a_checkpoint(make, words, tmp_path, capsys):
  path = make(tmp_path)
  if path.name != 'nowhere':
    if path.name == 'manifest.json':
      path = tmp_path / 'x.txt'
      path.write_text('')
    else:
      path.mkdir()
      (path / 'state').mkdir()
  code, out, err = call_cli(['inspect', str(path)], capsys)
  assert code == 2 and not out
  assert err.startswith('jaxckpt: E-CKPT-010: ') and words in err and err.count('\n') == 1


def test_inspect_a_run_directory_shows_its_newest_committed_checkpoint(finished_run, capsys):
  newest = finished_run / 'checkpoints' / STEP_20
  for run in (finished_run, finished_run / 'checkpoints'):
    code, out, err = call_cli(['inspect', str(run)], capsys)
    assert code == 0 and out.startswith(f'checkpoint  {newest}\n'), err
    assert err == (f'jaxckpt: {run} holds checkpoints: inspecting the newest committed one, '
                   f'{newest}\n')
  code, out, _ = call_cli(['inspect', str(finished_run), '--json'], capsys)
  assert code == 0 and json.loads(out)['path'] == str(newest)


def test_inspect_warns_when_the_manifest_does_not_match_its_seal(pristine, tmp_path, capsys):
  step_dir = tmp_path / STEP_10
  shutil.copytree(pristine / 'checkpoints' / STEP_10, step_dir)
  code, out, _ = call_cli(['inspect', str(step_dir)], capsys)
  assert code == 0 and 'WARNING' not in out
  assert json.loads(call_cli(['inspect', str(step_dir), '--json'],
                             capsys)[1])['manifest_seal'] == 'ok'

  problem = tamper(step_dir)
  code, out, err = call_cli(['inspect', str(step_dir)], capsys)
  lines = out.splitlines()
  # Exit 0 (inspect shows; verify judges), the warning first and last so no scroll hides it.
  assert code == 0 and not err
  assert lines[0] == lines[-1] and lines[0].startswith(f'WARNING: {problem}: ')
  assert lines[0].startswith('WARNING: manifest.json: checksum mismatch (crc32 ')
  assert lines[1] == f'checkpoint  {step_dir}'
  code, out, _ = call_cli(['inspect', str(step_dir), '--json'], capsys)
  d = json.loads(out)
  assert code == 0 and d['manifest_seal'] == 'mismatch' and d['warnings'] == [problem]
  assert d['step'] == 10  # still everything the manifest says


def test_inspect_a_damaged_manifest(pristine, tmp_path, capsys):
  step_dir = tmp_path / STEP_10
  shutil.copytree(pristine / 'checkpoints' / STEP_10, step_dir)
  (step_dir / 'manifest.json').write_text('{"format": "jaxckpt.checkpo')
  code, _, err = call_cli(['inspect', str(step_dir)], capsys)
  assert code == 1 and err.startswith('jaxckpt: E-CKPT-004: ')


def test_bad_usage_is_one_line_exit_2(capsys):
  for argv in (['inspect'], ['inspect', 'a', '--jsn'], ['verify'], ['verify', 'a', 'b']):
    code, _, err = call_cli(argv, capsys)
    assert code == 2 and err.startswith('jaxckpt: E-USAGE-001: ') and err.count('\n') == 1


# -------------------------------------------------------------------------------- verify
def test_verify_an_intact_run_and_checkpoint(pristine, capsys):
  code, out, _ = call_cli(['verify', str(pristine)], capsys)
  assert code == 0
  assert out.splitlines() == [f'OK {pristine / "checkpoints" / s}' for s in (STEP_10, STEP_20)]
  code, out, _ = call_cli(
      ['verify', str(pristine / 'checkpoints' / STEP_20), '--no-checksums'], capsys)
  assert code == 0 and out.startswith('OK ') and 'sizes only' in out
  assert discovery.latest_intact(pristine / 'checkpoints') == (pristine / 'checkpoints' / STEP_20,
                                                               [])
  assert discovery.intact_or_raise(pristine / 'checkpoints' / STEP_10) == \
      pristine / 'checkpoints' / STEP_10


def _state_files(step_dir: Path) -> dict[str, str]:
  """The checkpoint's file of each kind: the safetensors state file (the default; its header is
  its metadata), the first format's arrays.bin and index.json, or orbax's files."""
  files = manifest.read(step_dir)['files']
  safetensors = [f for f in files if f.endswith('.safetensors')]
  if safetensors:
    data = metadata = safetensors[0]
  elif 'state/arrays.bin' in files:
    data, metadata = 'state/arrays.bin', 'state/index.json'
  else:
    data = max((f for f in files if f.startswith('state/') and '/d/' in f),
               key=lambda f: files[f]['size'])
    metadata = 'state/_METADATA'
  return {
      'manifest': layout.MANIFEST, 'run_state': layout.RUN_STATE, 'state data': data,
      'state metadata': metadata
  }


def _corrupt(path: Path, how: str, *, header: bool = False) -> None:
  """Damage a file; `header`: a safetensors file's header (its metadata) rather than its data."""
  if how == 'deleted':
    path.unlink()
    return
  data = bytearray(path.read_bytes())
  at = 8 + 40 if header else len(data) // 2  # inside the JSON header, or the middle of the file
  if how == 'truncated':
    data = data[:at]
  else:  # one bit flipped
    data[at] ^= 0x04
  path.write_bytes(bytes(data))


@pytest.mark.parametrize('how', ['truncated', 'bit flipped', 'deleted'])
@pytest.mark.parametrize('kind', ['manifest', 'run_state', 'state data', 'state metadata'])
def test_corruption_matrix(pristine, tmp_path, capsys, kind, how):
  workdir = tmp_path / 'run'
  shutil.copytree(pristine, workdir)
  root = workdir / 'checkpoints'
  newest, previous = root / STEP_20, root / STEP_10
  rel = _state_files(newest)[kind]
  _corrupt(newest / rel, how, header=kind == 'state metadata' and rel.endswith('.safetensors'))

  code, out, err = call_cli(['verify', str(newest)], capsys)
  assert code == 1 and not err, err
  assert out.startswith(f'FAIL {newest}: ')
  if kind == 'manifest':
    assert 'manifest.json' in out
  else:
    assert f'{rel}: ' in out and {
        'truncated': 'size', 'bit flipped': 'checksum mismatch', 'deleted': 'missing'
    }[how] in out

  code, out, _ = call_cli(['verify', str(workdir)], capsys)
  assert f'OK {previous}' in out and str(newest) in out
  assert code == (0 if (kind, how) == ('manifest', 'deleted') else 1)  # see below
  if (kind, how) == ('manifest', 'deleted'):
    # Without its manifest the directory is not a checkpoint (it looks like an interrupted
    # save, which a live run also leaves for a moment): reported, not failed, in a run.
    assert f'SKIP {newest}: not committed' in out

  path, skipped = discovery.latest_intact(root)
  assert path == previous
  assert [p for p, _ in skipped] == [newest] and skipped[0][1]

  with pytest.raises(CheckpointError):
    discovery.intact_or_raise(newest)
  # A target that the intact checkpoint restores into: the refusal is about the damage.
  mgr = CheckpointManager(root, writer=False)
  target = restore_target(pristine / 'checkpoints' / STEP_20)
  mgr.restore(previous, target)
  with pytest.raises(CheckpointError) as e:
    mgr.restore(newest, target)
  unreadable = kind == 'manifest' and e.value.code == 'E-CKPT-004'  # no longer parses, or gone
  bad_header = kind == 'state metadata' and e.value.code == 'E-CKPT-012'  # the header lies
  assert e.value.code == 'E-CKPT-003' or unreadable or bad_header, e.value.line()
  assert Path(rel).name in e.value.what  # it names the damaged file


def restore_target(step_dir: Path) -> dict:
  """Every tensor of a checkpoint as a restore target, on one device."""
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return {
      t['name']: jax.ShapeDtypeStruct(tuple(t['shape']), t['dtype'], sharding=one)
      for t in manifest.read(step_dir)['tensors']
  }


def test_sizes_only_verification_misses_a_flipped_bit(pristine, tmp_path, capsys):
  step_dir = tmp_path / STEP_20
  shutil.copytree(pristine / 'checkpoints' / STEP_20, step_dir)
  _corrupt(step_dir / _state_files(step_dir)['state data'], 'bit flipped')
  assert call_cli(['verify', str(step_dir), '--no-checksums'], capsys)[0] == 0
  assert call_cli(['verify', str(step_dir)], capsys)[0] == 1
  assert discovery.latest_intact(tmp_path, checksums=False)[0] == step_dir
  assert discovery.latest_intact(tmp_path)[0] is None


def test_latest_intact_with_nothing_intact(pristine, tmp_path):
  root = tmp_path / 'checkpoints'
  shutil.copytree(pristine / 'checkpoints', root)
  for step in (STEP_10, STEP_20):
    _corrupt(root / step / layout.RUN_STATE, 'truncated')
  path, skipped = discovery.latest_intact(root)
  assert path is None and [p.name for p, _ in skipped] == [STEP_20, STEP_10]
  with pytest.raises(CheckpointError, match='E-RESUME-004: none of the 2 committed'):
    discovery.latest_intact_or_raise(root)  # never a fresh start over a damaged run
  assert discovery.latest_intact(tmp_path / 'empty') == (None, [])
  (tmp_path / 'crashed' / STEP_10 / 'state').mkdir(parents=True)  # before its first commit
  path, skipped = discovery.latest_intact_or_raise(tmp_path / 'crashed')
  assert path is None and 'not committed' in skipped[0][1]
  (tmp_path / 'file').write_text('')
  with pytest.raises(ArgumentError, match='E-RESUME-002'):
    discovery.latest_intact(tmp_path / 'file')


def test_a_manifest_naming_files_outside_is_reported_not_followed(pristine, tmp_path, capsys):
  step_dir = tmp_path / STEP_10
  shutil.copytree(pristine / 'checkpoints' / STEP_10, step_dir)
  m = manifest.read(step_dir)
  m['files']['../../outside'] = {'size': 1, 'crc32': '00000000'}
  (step_dir / layout.MANIFEST).write_text(json.dumps(m))  # edited: its seal no longer matches
  code, out, _ = call_cli(['verify', str(step_dir)], capsys)
  assert code == 1 and 'manifest.json: checksum mismatch' in out and 'outside the checkpoint' in out
  # Re-sealed, as a hostile writer could: the seal passes, and the path is still refused.
  (step_dir / layout.MANIFEST).write_bytes(manifest.sealed_json(m))
  code, out, _ = call_cli(['verify', str(step_dir)], capsys)
  assert code == 1 and out.splitlines() == [
      f"FAIL {step_dir}: manifest names a file outside the checkpoint: '../../outside': "
      'a name that leaves its directory (an empty, . or .. part)'
  ]


def test_the_manager_verifies_what_jaxckpt_verify_does(pristine, tmp_path, capsys):
  root = tmp_path / 'checkpoints'
  shutil.copytree(pristine / 'checkpoints', root)
  mgr = CheckpointManager(root, writer=False)
  assert mgr.verify(10) == mgr.verify(20) == []
  problem = tamper(root / STEP_10)  # a manifest changed after its commit; every file intact
  code, out, _ = call_cli(['verify', str(root / STEP_10)], capsys)
  assert code == 1 and out.splitlines() == [f'FAIL {root / STEP_10}: {problem}']
  assert mgr.verify(10) == discovery.problems(root / STEP_10) == [problem]
  assert mgr.verify(10, checksums=False) == [problem]  # the seal is checked even sizes-only


def test_verify_refuses_what_is_not_a_checkpoint_or_run(tmp_path, capsys):
  code, _, err = call_cli(['verify', str(tmp_path / 'nowhere')], capsys)
  assert code == 2 and 'E-CKPT-010' in err and 'does not exist' in err
  code, _, err = call_cli(['verify', str(tmp_path)], capsys)
  assert code == 2 and 'holds no checkpoint' in err
