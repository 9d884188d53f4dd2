"""The state file end to end: any tool reads a run's checkpoint, the first format still works, and
a state file whose header lies is passed over like any damaged checkpoint."""

import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
from conftest import (REPO, TINY, assert_same_bytes, checkpoint_arrays, committed_steps, events_of,
                      jaxckpt_cli, read_arrays, state_file)
from jax.sharding import SingleDeviceSharding

from jaxckpt.checkpoint import CheckpointManager, manifest

FIXTURE = REPO / 'tests' / 'fixtures' / 'format1' / 'step_00000004'
# The flags the fixture was written with (tests/fixtures/format1/README.md).
FORMAT1_FLAGS = ('--config.model.n_layer=1', '--config.model.n_embd=16', '--config.model.n_head=2',
                 '--config.model.block_size=16', '--config.train.batch_size=8',
                 '--config.train.steps=6', '--checkpoint_every=2', '--config.samples.every=0',
                 '--config.export.every=0', '--keep=0')


def restored(step_dir):
  """Every tensor of a checkpoint as `CheckpointManager.restore` returns it, on one device."""
  device = SingleDeviceSharding(jax.devices()[0])
  target = {
      t['name']: jax.ShapeDtypeStruct(tuple(t['shape']), np.dtype(t['dtype']), sharding=device)
      for t in manifest.read(step_dir)['tensors']
  }
  state, _ = CheckpointManager(step_dir.parent, writer=False).restore(step_dir, target)
  return {name: np.asarray(x) for name, x in state.items()}


@pytest.fixture(scope='module')
def tiny_run(trainer, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('tiny')
  r = trainer.train(workdir, '--config.train.steps=20', '--checkpoint_every=10')
  assert r.returncode == 0, r.stderr
  return workdir


def test_safetensors_readers_get_exactly_what_restore_returns(tiny_run):
  step_dir = tiny_run / 'checkpoints' / 'step_00000020'
  path = state_file(step_dir)
  assert path.name == 'process_0.safetensors'
  ours = restored(step_dir)
  from_numpy = safetensors.numpy.load_file(path)
  from_torch = {n: t.numpy() for n, t in safetensors.torch.load_file(path).items()}
  assert_same_bytes(from_numpy, ours)
  assert_same_bytes(from_torch, ours)
  kinds = {n.split('/')[0] for n in ours
          } | {p for n in ours for p in n.split('/') if p in ('mu', 'nu', 'count')}
  assert {'params', 'opt_state', 'mu', 'nu', 'count'} <= kinds  # weights, Adam m and v, counts


def test_a_state_file_whose_header_lies_is_passed_over(trainer, tiny_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(tiny_run, workdir)
  path = state_file(workdir / 'checkpoints' / 'step_00000020')
  data = bytearray(path.read_bytes())
  data[8 + 20] ^= 0x04  # a bit of the JSON header
  path.write_bytes(bytes(data))
  r = trainer.train(workdir, '--config.train.steps=30', '--checkpoint_every=10')
  assert r.returncode == 0, r.stderr
  warning = [line for line in r.stderr.splitlines() if 'passing over' in line]
  assert len(warning) == 1 and 'step_00000020' in warning[0], r.stderr
  assert [e['step'] for e in events_of(workdir, 'resumed')] == [10]
  assert jaxckpt_cli('verify', str(workdir)).returncode == 0  # step 20 was written again


@pytest.fixture(scope='module')
def format1(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('format1')
  shutil.copytree(FIXTURE, workdir / 'checkpoints' / FIXTURE.name)
  return workdir / 'checkpoints' / FIXTURE.name


def test_the_first_format_restores_verifies_inspects_and_exports(format1, tmp_path):
  assert (format1 / 'state' / 'arrays.bin').is_file()
  assert_same_bytes(restored(format1), read_arrays(format1))  # read_arrays: numpy + index.json
  verify = jaxckpt_cli('verify', str(format1.parent.parent))
  assert verify.returncode == 0 and f'OK {format1}' in verify.stdout, verify.stdout + verify.stderr
  inspect = jaxckpt_cli('inspect', str(format1))
  assert inspect.returncode == 0 and 'step        4' in inspect.stdout, inspect.stderr
  out = tmp_path / 'export'
  export = jaxckpt_cli('export', str(format1), '--format=safetensors', f'--out={out}')
  assert export.returncode == 0, export.stderr
  weights = safetensors.numpy.load_file(out / 'model.safetensors')
  arrays = read_arrays(format1)
  for name, x in weights.items():
    assert x.tobytes() == arrays['params/' + name.replace('.', '/')].tobytes(), name


def safetensors_copy(step_dir, root):
  """`step_dir`'s state, run state and identity, written again by today's CheckpointManager (the
  safetensors state file): a checkpoint that differs from it in format alone."""
  m = manifest.read(step_dir)
  core = {
      'format', 'format_version', 'step', 'committed_at', 'tensors', 'files', 'storage',
      'retention', manifest.SEAL
  }
  run_state = json.loads((step_dir / 'run_state.json').read_text())
  mgr = CheckpointManager(root)
  mgr.save(
      m['step'],
      restored(step_dir), {k: v for k, v in run_state.items() if k != 'step'},
      metadata={k: v for k, v in m.items() if k not in core})
  mgr.close()
  return root / step_dir.name


def test_a_run_continues_from_the_first_format_bit_exactly(trainer, format1, tmp_path):
  """Resumed from the fixture (written before the format changed), the run reaches step 6 with
  the same bytes as one resumed from the same state in today's format. (Not against a run from
  scratch: the fixture's first steps were computed on another machine, and XLA's CPU code, and
  so the last bits of a float, differ from one CPU to another.)"""
  continued, straight = tmp_path / 'continued', tmp_path / 'straight'
  r = trainer.train(continued, f'--config={TINY}', *FORMAT1_FLAGS, f'--resume={format1}')
  assert r.returncode == 0, r.stderr
  today = safetensors_copy(format1, tmp_path / 'today')
  assert state_file(today).suffix == '.safetensors'
  assert_same_bytes(restored(today), read_arrays(format1))  # read_arrays: numpy + index.json
  r = trainer.train(straight, f'--config={TINY}', *FORMAT1_FLAGS, f'--resume={today}')
  assert r.returncode == 0, r.stderr
  assert committed_steps(continued) == committed_steps(straight) == [6]
  assert state_file(continued / 'checkpoints' / 'step_00000006').suffix == '.safetensors'
  assert_same_bytes(checkpoint_arrays(continued, 6), checkpoint_arrays(straight, 6))
