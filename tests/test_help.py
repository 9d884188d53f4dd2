"""A newcomer's first commands: `--help`, a config from anywhere, the start-up lines, and input
refused before the workdir is touched; what a continuation or a multi-process run changes is
said, never silent."""

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, events_of

from jaxckpt.cli import trainer_flags
from jaxckpt.errors import ConfigError, UsageError
from jaxckpt.export import during_training
from jaxckpt.records import provenance
from jaxckpt.records.runlog import RunLog
from jaxckpt.train import resume as resume_lib


def outside_the_repo(tmp_path: Path) -> dict[str, str]:
  """An environment that finds jaxckpt (through a link) but not the repo's `configs` package:
  what a user has after `pip install`, in a directory of their own."""
  path = tmp_path / 'path'
  path.mkdir(exist_ok=True)
  if not (path / 'jaxckpt').exists():
    (path / 'jaxckpt').symlink_to(REPO / 'jaxckpt')
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  return {**env, 'PYTHONPATH': str(path), 'JAX_PLATFORMS': 'cpu'}


def trainer_at(tmp_path, *flags: str, env=None, timeout=120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'jaxckpt.main', *flags],
                        cwd=tmp_path,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                        env=env or outside_the_repo(tmp_path))


def test_help_lists_the_trainers_own_flags_with_their_defaults(tmp_path):
  r = trainer_at(tmp_path, '--help')
  assert r.returncode == 0, r.stderr
  out = r.stdout
  assert '--config=FILE' in out and '--config.<field>=VALUE' in out
  assert '--config.train.steps=500' in out  # the override form, with an example
  assert '--workdir=DIR' in out and 'required' in out
  assert '--checkpoint_every=N|auto' in out
  flat = ' '.join(out.split())  # as wrapped to the terminal's width
  assert 'Default: config.checkpoint.every (100 in configs/default.py)' in flat
  assert '--heartbeat_timeout_secs=SECS  (also --heartbeat_timeout_seconds' in out
  assert '--barrier_timeout_secs=SECS' in out and 'Default: 600.' in flat
  # Every flag listed says its default; absl's and JAX's own are left to --helpfull.
  entries = re.split(r'\n  --', out.split('The run:', 1)[1])[1:]
  listed = [re.match(r'(?:\[no\])?(\w+)', e)[1] for e in entries]
  assert set(trainer_flags.FLAG_FIELDS) < set(listed) and 'step_timeout_secs' in listed, listed
  assert all('Default: ' in ' '.join(e.split()) for e in entries), entries
  assert 'logtostderr' not in out and '--jax_' not in out and '--helpfull' in out


def test_helpfull_is_absls_whole_listing(tmp_path):
  r = trainer_at(tmp_path, '--helpfull')
  assert r.returncode == 0, r.stderr
  assert '--[no]logtostderr' in r.stdout and '--heartbeat_timeout_secs' in r.stdout
  assert "(default: the config's checkpoint.every)" in ' '.join(r.stdout.split())


def test_help_with_a_config_from_another_directory_lists_its_fields(tmp_path):
  r = trainer_at(tmp_path, '--help', f'--config={TINY}')
  assert r.returncode == 0, r.stderr
  assert f'Fields of {TINY}' in r.stdout and '  train.steps = 300' in r.stdout


@pytest.mark.parametrize('name', ['heartbeat_timeout_secs', 'heartbeat_timeout_seconds'])
def test_the_heartbeat_flag_and_its_former_name_both_set_it(tmp_path, name):
  code = ('import sys; from jaxckpt import main; from jaxckpt.cli import trainer_flags; '
          'trainer_flags.parse_flags_or_exit(sys.argv); '
          'print(main.FLAGS.heartbeat_timeout_secs)')
  r = subprocess.run(
      [sys.executable, '-c', code, f'--config={TINY}', '--workdir=w', f'--{name}=7.5'],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=60,
      env=outside_the_repo(tmp_path))
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == '7.5'


def test_a_run_from_another_directory_says_what_it_starts_at_once(tmp_path, compile_cache):
  """An absolute --config from a directory without `configs/`; the start-up lines come first,
  and `compiling the train step...` before the first step."""
  env = {
      **outside_the_repo(tmp_path), 'JAX_COMPILATION_CACHE_DIR': str(compile_cache),
      'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0'
  }
  workdir = tmp_path / 'run'
  r = trainer_at(
      tmp_path,
      f'--config={TINY}',
      f'--workdir={workdir}',
      '--config.train.steps=2',
      '--checkpoint_every=0',
      '--export_every=0',
      env=env,
      timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  lines = [l.split('] ', 1)[-1] for l in r.stderr.splitlines()]
  assert lines[0] == (f'config {TINY}, workdir {workdir}, one process, resume: the newest '
                      'committed checkpoint in the workdir, else a fresh start'), lines[:3]
  described = next(i for i, l in enumerate(lines) if ' parameters; mesh ' in l)
  assert re.fullmatch(
      r"136,960 parameters; mesh \{'data': 1, 'model': 1\} over 1 cpu device\(s\), "
      r'1 process\(es\); a fresh start', lines[described]), lines[described]
  compiling = lines.index('compiling the train step...')
  assert described < compiling < next(i for i, l in enumerate(lines) if l.startswith('step 2/2'))


@pytest.mark.parametrize('flags, code', [
    (('--resume=/nowhere/step_00000010',), 'E-RESUME-003'),
    (("--config.data.sources.main=('/nowhere/corpus.txt',)",), 'E-DATA-001'),
    (('--remote=ftp://host/prefix',), 'E-STORE-001'),
    (('--checkpoint_mtbi=1h',), 'E-USAGE-006'),
    (('--remote_every=4',), 'E-USAGE-006'),
])
def test_a_refused_run_leaves_no_workdir(trainer, tmp_path, flags, code):
  workdir = tmp_path / 'never'
  r = trainer.train(workdir, *flags)
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1].startswith(f'jaxckpt: {code}: '), r.stderr[-3000:]
  assert not workdir.exists()


def test_remote_only_flags_without_a_remote_say_so():
  from absl import flags as absl_flags
  values = absl_flags.FlagValues()
  for name in trainer_flags.REMOTE_ONLY:
    absl_flags.DEFINE_string(name, None, '', flag_values=values)
  values(['prog', '--remote_mtbi=3d', '--remote_lease=off'])
  config = provenance.load_config_file(TINY)
  with pytest.raises(UsageError) as e:
    trainer_flags.check_remote_only(values, config)
  assert e.value.code == 'E-USAGE-006' and \
      '--remote_mtbi and --remote_lease apply only with --remote' in e.value.line()
  config.checkpoint.remote = 's3://bucket/run'
  trainer_flags.check_remote_only(values, config)  # with a remote: what the flags are for


def test_auto_only_flags_without_auto_say_so():
  from absl import flags as absl_flags
  values = absl_flags.FlagValues()
  absl_flags.DEFINE_string('checkpoint_mtbi', None, '', flag_values=values)
  absl_flags.DEFINE_float('checkpoint_min_secs', None, '', flag_values=values)
  absl_flags.DEFINE_float('checkpoint_max_secs', None, '', flag_values=values)
  values(['prog', '--checkpoint_mtbi=2h'])
  config = provenance.load_config_file(TINY)
  with pytest.raises(UsageError) as e:
    trainer_flags.check_auto_only(values, config)
  assert e.value.code == 'E-USAGE-006' and '--checkpoint_every=auto' in e.value.line()
  for auto in ('auto', 'Auto', ' AUTO'):  # as `parse_every` reads it, the run's cadence is auto
    config.checkpoint.every = auto
    trainer_flags.check_auto_only(values, config)  # with auto: what the flag is for


def test_a_continuation_that_changes_the_schedule_is_warned_about(tmp_path, caplog):
  config = provenance.load_config_file(TINY)
  meta = {'config': config.to_dict()}  # what the checkpoint of step 300 recorded
  config.train.steps = 350
  runlog = RunLog(tmp_path)
  with caplog.at_level(logging.WARNING):
    resume_lib._report_schedule_change(runlog, meta, config, 300)
  [event] = events_of(tmp_path, 'schedule_changed')
  assert event['step'] == 300 and event['changes'] == {'steps': [300, 350]}
  assert event['lr_before'] == pytest.approx(1e-4, rel=1e-6) and event['lr_after'] > 1.5e-4
  [line] = [r.getMessage() for r in caplog.records if 'schedule changed' in r.getMessage()]
  assert 'train.steps 300 -> 350' in line and 'step 301 was 1.00e-04' in line
  # The same schedule, or a manifest whose numbers are not numbers: nothing.
  resume_lib._report_schedule_change(runlog, meta, provenance.load_config_file(TINY), 300)
  bad = json.loads(json.dumps(meta))
  bad['config']['train']['lr'] = 'fast'
  resume_lib._report_schedule_change(runlog, bad, config, 300)
  assert len(events_of(tmp_path, 'schedule_changed')) == 1


def test_exports_across_processes_are_off_and_say_so(tmp_path, caplog):
  config = provenance.load_config_file(TINY)
  with caplog.at_level(logging.INFO):
    exporter = during_training.Exporter(tmp_path / 'exports', config, RunLog(tmp_path), processes=2)
  [event] = events_of(tmp_path, 'exports_off')
  assert event['processes'] == 2 and event['every'] == config.export.every
  [line] = [r.getMessage() for r in caplog.records if 'exports during training' in r.getMessage()]
  assert 'across 2 processes' in line and f'`jaxckpt export {tmp_path}/checkpoints/' in line
  assert exporter.processes == 2


def test_a_bad_export_setting_has_its_own_code():
  config = provenance.load_config_file(TINY)
  config.export.formats = 'safetensors,onnx'
  with pytest.raises(ConfigError) as e:
    during_training.options_from_config(config)
  assert e.value.code == 'E-CONFIG-009'


def test_the_trainer_asks_a_gpu_for_deterministic_ops_unless_told_not_to():
  """A resume continues bit-identical on a GPU only with reductions that add in the same order
  every run: the trainer adds the flag to XLA_FLAGS before its backend starts, keeps an
  XLA_FLAGS that already says either way, and leaves it out with
  --config.train.deterministic=false."""
  from configs import default

  from jaxckpt.cli.trainer_flags import xla_flags
  assert default.get_config().train.deterministic is True
  assert xla_flags(True, '') == '--xla_gpu_deterministic_ops=true'
  assert xla_flags(True, '--xla_dump_to=/tmp/d') == \
      '--xla_dump_to=/tmp/d --xla_gpu_deterministic_ops=true'
  assert xla_flags(True, '--xla_gpu_deterministic_ops=false') == \
      '--xla_gpu_deterministic_ops=false'
  assert xla_flags(False, '--xla_dump_to=/tmp/d') == '--xla_dump_to=/tmp/d'
