"""A newcomer's edges: what `jaxckpt` and the trainer say with too little or wrong input, and what
the pages say the commands print.

- `jaxckpt` alone is usage on stderr, exit 2; `--help` is a user's page, exit 0; `python -m
  jaxckpt` is the same command.
- `jaxckpt evaluate` on a directory that is not a run is refused before any lock is taken.
- The trainer's `--help` with a config that does not load says why, exit 2; a start without
  `--config` or `--workdir` names the flag with an example.
- docs/tools.md shows what `jaxckpt evaluate` prints for the page's own run; docs/training.md's
  flag table lists every flag `--help` lists, and docs/preemption.md names flags that exist.
- A loss gone NaN is one warning of ours, not one tensorboardX line per value per step.
"""

import json
import logging
import math
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, call_cli, jaxckpt_cli, subprocess_env

from jaxckpt import cli
from jaxckpt.records import tensorboard
from jaxckpt.records.workdir import LOSSES

DOCS = REPO / 'docs'


def trainer_cli(*flags: str, cwd, cache) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'jaxckpt.main', *flags],
                        cwd=cwd,
                        capture_output=True,
                        text=True,
                        timeout=120,
                        env=subprocess_env(cache))


def one_line(stderr: str, code: str) -> str:
  assert 'Traceback' not in stderr, stderr
  [line] = stderr.strip().splitlines()
  assert line.startswith(f'jaxckpt: {code}: '), line
  return line


# ------------------------------------------------------------------------------ jaxckpt alone
def test_jaxckpt_help_is_a_users_page(capsys):
  code, out, err = call_cli(['--help'], capsys)
  assert code == 0 and err == ''
  assert 'jaxckpt <command> --help' in out
  assert '--newest' in out and '--no-checksums' in out
  for name in cli.COMMANDS:  # one line each
    assert len([l for l in out.splitlines() if l.startswith(f'  {name} ')]) == 1, name
  for internal in ('_command.py', 'main(argv)', 'remote_args'):
    assert internal not in out


def test_bare_jaxckpt_is_usage_on_stderr_and_exit_2(capsys):
  code, out, err = call_cli([], capsys)
  assert code == 2 and out == ''
  assert err.startswith('usage: jaxckpt <command>') and 'jaxckpt <command> --help' in err


def test_python_m_jaxckpt_runs_the_command_without_jax():
  r = subprocess.run([sys.executable, '-X', 'importtime', '-m', 'jaxckpt', '--help'],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     timeout=60)
  assert r.returncode == 0, r.stderr
  assert r.stdout == cli.USAGE
  imported = [l.rsplit('|', 1)[-1].strip() for l in r.stderr.splitlines() if '|' in l]
  assert 'jax' not in imported and 'numpy' not in imported
  r = subprocess.run([sys.executable, '-m', 'jaxckpt', 'nope'],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     timeout=60)
  assert r.returncode == 2
  one_line(r.stderr, 'E-USAGE-002')


# ------------------------------------------------------------------- jaxckpt evaluate: not a run
@pytest.mark.parametrize('holds', [(), ('LOCK',)], ids=['empty', 'lock only'])
def test_evaluate_refuses_a_directory_that_is_not_a_run(tmp_path, capsys, holds):
  for name in holds:
    (tmp_path / name).write_text('')
  code, out, err = call_cli(['evaluate', f'--workdir={tmp_path}'], capsys)
  assert code == 2 and out == ''
  line = one_line(err, 'E-EVAL-003')
  assert 'checkpoints/' in line and '--follow' in line
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(holds)  # no evaluated.json.lock


def test_evaluate_follow_waits_in_a_directory_that_is_not_a_run_yet(tmp_path, capsys, monkeypatch):
  from jaxckpt import evaluate
  follow = evaluate.Evaluator.follow

  def stop_at_the_first_wait(self, poll_secs):

    def stop(_):
      raise KeyboardInterrupt

    return follow(self, poll_secs, sleep=stop)

  monkeypatch.setattr(evaluate.Evaluator, 'follow', stop_at_the_first_wait)
  code, out, err = call_cli(['evaluate', f'--workdir={tmp_path}', '--follow'], capsys)
  assert code == 130, err
  assert out.startswith(f'waiting for new checkpoints in {tmp_path / "checkpoints"} (every 2 s)')


# ------------------------------------------------------------------- the command's flags' help
def help_of(command: str, capsys) -> str:
  code, out, _ = call_cli([command, '--help'], capsys)
  assert code == 0
  return ' '.join(out.split())


def test_every_flag_of_plot_and_evaluate_says_what_it_is(capsys):
  plot = help_of('plot', capsys)
  assert re.search(r'--workdir WORKDIR the run directory', plot), plot
  assert '--poll_secs POLL_SECS seconds between looks' in help_of('evaluate', capsys)
  assert 'default: 2)' in help_of('evaluate', capsys)


# -------------------------------------------------------------------------------- the trainer
@pytest.mark.parametrize('config', ['nope.py', 'broken.py'])
def test_trainer_help_with_a_config_that_does_not_load_says_why(tmp_path, compile_cache, config):
  (tmp_path / 'broken.py').write_text('def get_config(:\n')
  r = trainer_cli('--help', f'--config={config}', cwd=tmp_path, cache=compile_cache)
  assert r.returncode == 2
  assert '--checkpoint_every=N|auto' in r.stdout and 'Fields of' not in r.stdout
  line = one_line(r.stderr, 'E-CONFIG-007')
  assert f'--config={config}: ' in line
  assert ('no such file' if config == 'nope.py' else 'at line 1') in line


@pytest.mark.parametrize('flags, missing, example', [
    ((), '--config and --workdir are required', '--config=configs/tiny.py --workdir=runs/tiny'),
    ((f'--config={TINY}',), '--workdir is required', '--workdir=runs/tiny'),
    (('--workdir=runs/x',), '--config is required', '--config=configs/tiny.py'),
])
def test_a_start_without_config_or_workdir_names_it_with_an_example(tmp_path, compile_cache, flags,
                                                                    missing, example):
  r = trainer_cli(*flags, cwd=tmp_path, cache=compile_cache)
  assert r.returncode == 2
  line = one_line(r.stderr, 'E-USAGE-001')
  assert line.startswith(f'jaxckpt: E-USAGE-001: {missing}; '), line
  assert f'e.g. {example} ' in line and 'None' not in line
  assert not (tmp_path / 'runs').exists()


def trainer_flags_listed(tmp_path, cache) -> set[str]:
  r = trainer_cli('--help', cwd=tmp_path, cache=cache)
  assert r.returncode == 0, r.stderr
  return set(re.findall(r'^  --(?:\[no\])?(\w+)', r.stdout, re.M)) - {'config'}


def table_flags(page: Path) -> set[str]:
  """The flags named in the first column of the page's tables."""
  return {
      name for row in re.findall(r'^\| (`--.*?) \|', page.read_text(), re.M)
      for name in re.findall(r'`--(\w+)`', row)
  }


def test_the_training_page_lists_every_trainer_flag(tmp_path, compile_cache):
  listed = trainer_flags_listed(tmp_path, compile_cache)
  assert {'export_every', 'replicas'} <= listed
  assert listed - table_flags(DOCS / 'training.md') == set()


def test_the_preemption_page_names_flags_by_their_names(tmp_path, compile_cache):
  named = table_flags(DOCS / 'preemption.md')
  assert 'heartbeat_timeout_secs' in named
  assert named - trainer_flags_listed(tmp_path, compile_cache) == set()


# ------------------------------------------------------------- docs/tools.md: jaxckpt evaluate
@pytest.fixture(scope='module')
def tools_run(trainer, tmp_path_factory) -> Path:
  """The run docs/tools.md works on, made by the page's own command."""
  page = (DOCS / 'tools.md').read_text()
  assert ('python -m jaxckpt.main --config=configs/tiny.py --workdir=runs/tiny '
          '--config.train.steps=40 \\\n    --checkpoint_every=20') in page
  workdir = tmp_path_factory.mktemp('tools') / 'runs' / 'tiny'
  r = trainer.train(workdir, '--config.train.steps=40', '--checkpoint_every=20')
  assert r.returncode == 0, r.stderr[-3000:]
  return workdir


def shown_output(page: str, command: str) -> list[str]:
  """The lines of the ```text block right after the ```bash block that is `command`."""
  m = re.search(rf'```bash\n{re.escape(command)}\n```\n\n```text\n(.*?)```', page, re.S)
  assert m, command
  return m.group(1).splitlines()


def test_the_tools_page_shows_what_evaluate_prints(tools_run, compile_cache, tmp_path):
  workdir = tmp_path / 'runs' / 'tiny'
  shutil.copytree(tools_run / 'checkpoints', workdir / 'checkpoints')
  r = jaxckpt_cli('evaluate', f'--workdir={workdir}', cache=compile_cache)
  assert r.returncode == 0, r.stderr
  shown = shown_output((DOCS / 'tools.md').read_text(), 'jaxckpt evaluate --workdir=runs/tiny')
  printed = r.stdout.splitlines()
  assert len(printed) == len(shown), (printed, shown)
  for want, got in zip(shown, printed):
    assert re.fullmatch(re.escape(want).replace(r'\.\.\.', '.*'), got), (want, got)


def damage_a_tensor(step_dir: Path, prefix: str) -> str:
  """Flip one bit of the first tensor whose name starts with `prefix`; returns its name."""
  path = step_dir / 'state' / 'process_0.safetensors'
  data = bytearray(path.read_bytes())
  size = struct.unpack('<Q', data[:8])[0]
  header = json.loads(data[8:8 + size])
  name = min(k for k in header if k.startswith(prefix))
  data[8 + size + header[name]['data_offsets'][0]] ^= 0x10
  path.write_bytes(bytes(data))
  return name


def test_evaluate_checks_the_weights_it_reads_not_the_optimizer_state(tools_run, compile_cache,
                                                                      tmp_path):
  shutil.copytree(tools_run / 'checkpoints', tmp_path / 'checkpoints')
  damage_a_tensor(tmp_path / 'checkpoints' / 'step_00000020', 'opt_state/')
  damage_a_tensor(tmp_path / 'checkpoints' / 'step_00000040', 'params/')
  r = jaxckpt_cli('evaluate', f'--workdir={tmp_path}', cache=compile_cache)
  assert r.returncode == 1, r.stderr
  assert re.search(r'^step 20: heldout_loss ', r.stdout, re.M), r.stdout  # not seen
  assert 'jaxckpt: step 40: not evaluated: E-CKPT-003: ' in r.stderr
  assert 'checksum mismatch (params/' in r.stderr
  # What the page says: the weights are checked, the optimizer state is not read.
  section = (DOCS / 'tools.md').read_text().split('## `jaxckpt evaluate`')[1].split('\n## ')[0]
  flat = ' '.join(section.split())
  assert 'checks the bytes it reads: the manifest and the weights, not the optimizer state' in flat


# ------------------------------------------------------------------------ a loss gone NaN
def test_non_finite_scalars_are_one_warning_and_written_as_they_are(tmp_path, caplog):
  scalars = tensorboard.Scalars(tmp_path, segment=0, first_step=0, tokens_per_step=8)
  rows = [{'step': s, 'loss': math.nan, 'lr': 1e-3, 'grad_norm': math.inf, 'time': 1000.0 + s}
          for s in range(1, 6)]
  with caplog.at_level(logging.WARNING):
    scalars.records(LOSSES, rows[:3])
    scalars.records(LOSSES, rows[3:])
  scalars.close()
  assert not [r for r in caplog.records if r.name.startswith('tensorboardX')]
  [warning] = [r.getMessage() for r in caplog.records if 'not finite' in r.getMessage()]
  assert warning.startswith('train/loss is nan at step 1: ')
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(
      str(tmp_path), size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  assert [e.step for e in acc.Scalars('train/loss')] == [1, 2, 3, 4, 5]
  assert all(math.isnan(e.value) for e in acc.Scalars('train/loss'))
  assert all(math.isinf(e.value) for e in acc.Scalars('train/grad_norm'))


def test_a_run_whose_loss_goes_nan_logs_no_flood(trainer, tmp_path):
  """docs/training.md's absurd learning rate, without the finite guard: the loss goes NaN."""
  r = trainer.train(tmp_path, '--config.train.steps=4', '--config.train.lr=1e38',
                    '--config.train.grad_clip=0', '--config.train.warmup_steps=1',
                    '--checkpoint_every=0', '--export_every=0', '--config.samples.every=0',
                    '--config.train.log_every=1')
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'NaN or Inf found' not in r.stderr
  assert r.stderr.count('that are not finite are not warned of') == 1, r.stderr[-3000:]
  losses = [json.loads(line)['loss'] for line in (tmp_path / LOSSES).read_text().splitlines()]
  assert math.isnan(losses[-1])  # loss.jsonl records it as it did


@pytest.mark.parametrize('value', ['nan', 'inf', '1e300', '0', '-1'])
def test_evaluate_refuses_a_poll_interval_that_is_not_one(tmp_path, capsys, value):
  code, _, err = call_cli(['evaluate', f'--workdir={tmp_path}', '--follow', f'--poll_secs={value}'],
                          capsys)
  assert code == 2 and err.count('\n') == 1 and 'Traceback' not in err, err
  assert '--poll_secs=' in err and 'at most 3600' in err, err


@pytest.mark.parametrize(
    'out, why',
    [
        ('nodir/sub/ev.json', 'does not exist'),
        ('afile/ev.json', 'is not a directory'),
        ('adir', 'is a directory'),  # adir/evaluated.json: a directory
    ])
def test_evaluate_of_a_url_checks_out_before_it_downloads(tmp_path, capsys, out, why):
  (tmp_path / 'afile').write_text('')
  (tmp_path / 'adir' / 'evaluated.json').mkdir(parents=True)
  url = f'file://{tmp_path}/bucket/run'  # no run there: nothing is read before --out is checked
  code, stdout, err = call_cli(['evaluate', f'--workdir={url}', f'--out={tmp_path / out}'], capsys)
  assert code == 2 and not stdout, err
  assert err.startswith(f'jaxckpt: E-EVAL-007: --out={tmp_path}/') and why in err, err
  assert err.count('\n') == 1, err
