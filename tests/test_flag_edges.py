"""Edge values of the trainer's flags and config fields: each is refused before anything runs,
with one line that names the flag the user set and a fix that is itself a valid value."""

import math

import ml_collections
import pytest
from conftest import tiny_config
from test_cli_errors import assert_refused

from jaxckpt.cli import trainer_flags
from jaxckpt.errors import ConfigError, UsageError
from jaxckpt.hosts import distributed, joining
from jaxckpt.model import sharding
from jaxckpt.train.config import checkpoint_options, validate_config

RUN = ('--config.train.steps=3',)


def _mesh(data, model):
  return ml_collections.ConfigDict({'data': data, 'model': model})


# ------------------------------------------------------------------------------------ the mesh
@pytest.mark.parametrize('data, model, named', [(0, 1, 'mesh.data=0'), (1, 0, 'mesh.model=0'),
                                                (-2, 1, 'mesh.data=-2'), (-1, -3, 'mesh.model=-3')])
def test_a_mesh_axis_that_is_no_device_count(data, model, named):
  with pytest.raises(ConfigError, match='E-CONFIG-002') as e:
    sharding.mesh_shape(_mesh(data, model), 1)
  line = str(e.value)
  assert named in line and 'positive' in line and '-1' in line, line
  assert 'mesh.data * mesh.model <=' not in line, line  # 0 * 1 <= 1 holds: not the fix


def test_a_mesh_axis_of_minus_one_that_does_not_divide_the_devices():
  with pytest.raises(ConfigError, match='E-CONFIG-002') as e:
    sharding.mesh_shape(_mesh(-1, 3), 8)
  line = str(e.value)
  assert 'mesh.model=3' in line and 'does not divide the 8 device(s)' in line, line
  assert 'a divisor of 8 (1, 2, 4, 8)' in line and '--config.mesh.model' in line, line
  with pytest.raises(ConfigError, match='E-CONFIG-002') as e:
    sharding.mesh_shape(_mesh(16, -1), 8)
  assert 'mesh.data=16' in str(e.value) and '--config.mesh.data' in str(e.value)


def test_meshes_that_fit():
  assert sharding.mesh_shape(_mesh(-1, 2), 8) == (4, 2)
  assert sharding.mesh_shape(_mesh(2, -1), 8) == (2, 4)
  assert sharding.mesh_shape(_mesh(2, 2), 8) == (2, 2)  # fewer than all: the first 4
  with pytest.raises(ConfigError, match=r'choose mesh.data \* mesh.model <= 8'):
    sharding.mesh_shape(_mesh(4, 4), 8)


# ------------------------------------------------------------------------- checkpoint options
@pytest.mark.parametrize('field, value, flag, valid', [
    ('keep', -1, '--keep', '0: all'),
    ('keep_every', -1, '--keep_every', '0: off'),
    ('keep_best', -1, '--keep_best', '0: off'),
    ('replicas', -1, '--replicas', '0: off'),
    ('secs', -1.0, '--checkpoint_secs', '0: off'),
    ('secs', math.nan, '--checkpoint_secs', '0: off'),
    ('secs', math.inf, '--checkpoint_secs', '0: off'),
    ('every', 'abc', '--checkpoint_every', 'auto'),
    ('every', -5, '--checkpoint_every', 'auto'),
    ('mode', 'sometimes', '--checkpoint_mode', 'auto, async or sync'),
    ('staging', 'gpu', '--checkpoint_staging', 'auto, host or device'),
    ('storage', 'tape', '--config.checkpoint.storage', 'auto, safetensors or orbax'),
])
def test_a_bad_checkpoint_option_names_its_flag(field, value, flag, valid):
  with pytest.raises(ConfigError, match='E-CONFIG-004') as e:
    checkpoint_options(tiny_config(**{f'checkpoint.{field}': value}))
  what, fix = e.value.what, e.value.fix
  assert what.startswith(f'{flag}='), what
  assert 'every_secs' not in what and 'every_steps' not in what, what
  assert f'set {flag}' in fix and valid in fix, fix
  others = {
      '--keep', '--keep_every', '--keep_best', '--replicas', '--checkpoint_secs',
      '--checkpoint_every', '--checkpoint_mode', '--checkpoint_staging'
  } - {flag}
  assert not [o for o in others if f'{o} ' in fix or f'{o},' in fix or f'{o}=' in fix], fix


def test_good_checkpoint_options_pass():
  options = checkpoint_options(
      tiny_config(**{'checkpoint.secs': 30, 'checkpoint.keep': 0, 'checkpoint.storage': 'raw'}))
  assert options.every_secs == 30 and options.keep == 0 and options.storage == 'safetensors'


# -------------------------------------------------------------------------------- train fields
def test_negative_warmup_is_refused():
  with pytest.raises(ConfigError, match='E-CONFIG-001') as e:
    validate_config(tiny_config(**{'train.warmup_steps': -1}))
  assert 'train.warmup_steps=-1' in str(e.value) and '--config.train.warmup_steps' in str(e.value)
  validate_config(tiny_config(**{'train.warmup_steps': 0}))


# --------------------------------------------------------------- one process's timeouts, job
@pytest.mark.parametrize('name, value', [('init_timeout_secs', 0.0),
                                         ('heartbeat_timeout_seconds', -1.0), ('timeout_secs', 0.0),
                                         ('init_timeout_secs', math.nan),
                                         ('timeout_secs', math.inf)])
def test_timeouts_are_checked_on_one_process_too(name, value):
  flag = {
      'heartbeat_timeout_seconds': 'heartbeat_timeout_secs', 'timeout_secs': 'barrier_timeout_secs'
  }.get(name, name)
  with pytest.raises(UsageError, match='E-CONFIG-004') as e:
    distributed.initialize(**{name: value})  # no job flags: one process, nothing joined
  assert f'--{flag}=' in str(e.value) and 'positive number of seconds' in str(e.value)
  assert distributed.current().count == 1


@pytest.mark.parametrize('address, count, index, names', [
    (None, 0, None, '--num_processes=0'),
    ('127.0.0.1:1', -2, 0, '--num_processes=-2'),
    ('127.0.0.1:1', 2, -1, '--process_id=-1'),
    ('127.0.0.1:1', 2, 2, '--process_id=2 is not below --num_processes=2'),
    (None, None, 5, '--process_id=5 without --coordinator_address and --num_processes'),
    (None, 2, 0, '--num_processes=2 --process_id=0 without --coordinator_address'),
    ('127.0.0.1:1', None, None, 'without --num_processes and --process_id'),
])
def test_job_flags_that_describe_no_job(monkeypatch, address, count, index, names):
  monkeypatch.setattr(joining, '_cluster_env', lambda: False)
  monkeypatch.delenv('JAX_COORDINATOR_ADDRESS', raising=False)
  with pytest.raises(UsageError, match='E-DIST-004') as e:
    joining.check_job(address, count, index)
  assert names in str(e.value), str(e.value)
  assert 'should be defined' not in str(e.value)


def test_job_flags_that_describe_a_job(monkeypatch):
  monkeypatch.setattr(joining, '_cluster_env', lambda: False)
  monkeypatch.delenv('JAX_COORDINATOR_ADDRESS', raising=False)
  joining.check_job('127.0.0.1:1', 2, 1)
  joining.check_job('127.0.0.1:1', 1, 0)
  monkeypatch.setenv('JAX_COORDINATOR_ADDRESS', '127.0.0.1:1')  # stands in for the flag
  joining.check_job(None, 2, 0)
  with pytest.raises(UsageError, match='JAX_COORDINATOR_ADDRESS=127.0.0.1:1 without --num_proc'):
    joining.check_job(None, None, None)
  monkeypatch.setattr(joining, '_cluster_env', lambda: True)  # JAX fills in the rest
  joining.check_job(None, None, 3)


# --------------------------------------------------- the trainer: one line, exit 2, no compile
@pytest.mark.parametrize('flag, code, names', [
    ('--config.mesh.data=0', 'E-CONFIG-002', 'mesh.data=0'),
    ('--keep=-1', 'E-CONFIG-004', '--keep=-1'),
    ('--checkpoint_secs=-1', 'E-CONFIG-004', '--checkpoint_secs=-1'),
    ('--checkpoint_secs=nan', 'E-CONFIG-004', '--checkpoint_secs=nan'),
    ('--config.checkpoint.every=abc', 'E-CONFIG-004', "--checkpoint_every='abc'"),
    ('--config.train.warmup_steps=-1', 'E-CONFIG-001', 'train.warmup_steps=-1'),
    ('--heartbeat_timeout_secs=-1', 'E-CONFIG-004', '--heartbeat_timeout_secs=-1'),
    ('--barrier_timeout_secs=0', 'E-CONFIG-004', '--barrier_timeout_secs=0'),
    ('--num_processes=0', 'E-DIST-004', '--num_processes=0'),
    ('--process_id=5', 'E-DIST-004', '--process_id=5 without'),
    ('--resume=', 'E-RESUME-005', '--resume is empty'),
])
def test_the_trainer_refuses_with_one_line(trainer, tmp_path, flag, code, names):
  r = trainer.train(tmp_path / 'w', *RUN, flag)
  line = assert_refused(r, code)
  assert names in line, line
  assert [x for x in r.stderr.splitlines() if x.startswith('jaxckpt:')] == [line]
  assert not (tmp_path / 'w' / 'checkpoints').exists()


def test_an_empty_resume_mode_is_never_latest(trainer, tmp_path):
  r = trainer.train(tmp_path / 'w', *RUN, env={'JAXCKPT_RESUME': ' '})
  assert 'JAXCKPT_RESUME is empty' in assert_refused(r, 'E-RESUME-005')
  assert not (tmp_path / 'w' / 'checkpoints').exists()
  assert trainer_flags.resume_mode(None, {}) == 'latest'
  assert trainer_flags.resume_mode(None, {'JAXCKPT_RESUME': 'none'}) == 'none'
  assert trainer_flags.resume_mode('latest', {'JAXCKPT_RESUME': ''}) == 'latest'  # the flag wins


def test_a_resume_point_from_the_environment_that_is_not_there_names_the_variable(tmp_path):
  with pytest.raises(UsageError, match='JAXCKPT_RESUME=bogus: no such file') as e:
    trainer_flags.resume_mode(None, {'JAXCKPT_RESUME': 'bogus'})
  assert e.value.code == 'E-RESUME-003'
  with pytest.raises(UsageError) as e:
    trainer_flags.resume_mode(None, {'JAXCKPT_RESUME': str(tmp_path / 'w.bin')})
  assert e.value.code == 'E-BIN-003'
  assert trainer_flags.resume_mode('bogus', {'JAXCKPT_RESUME': 'bogus'}) == 'bogus'  # the flag's
  assert trainer_flags.resume_mode(None, {'JAXCKPT_RESUME': str(tmp_path)}) == str(tmp_path)
