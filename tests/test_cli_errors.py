"""Resume modes and bad input: one line naming the problem and the fix, exit 2, no traceback."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, committed_steps, events_of, flip_a_data_byte, jaxckpt_cli

from jaxckpt.checkpoint import discovery, layout, manifest

FLAGS = ('--config.train.steps=20', '--checkpoint_every=10')


@pytest.fixture(scope='module')
def finished_run(trainer, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('finished')
  r = trainer.train(workdir, *FLAGS)
  assert r.returncode == 0, r.stderr
  return workdir


def assert_refused(result, code: str) -> str:
  assert result.returncode == 2, result.stderr
  lines = result.stderr.strip().splitlines()
  assert 'Traceback' not in result.stderr
  assert lines[-1].startswith(f'jaxckpt: {code}: '), lines[-1]
  return lines[-1]


def test_resume_none_refuses_a_workdir_with_checkpoints(trainer, finished_run):
  line = assert_refused(trainer.train(finished_run, *FLAGS, '--resume=none'), 'E-RESUME-001')
  assert 'fork' in line and '--resume=latest' in line
  assert committed_steps(finished_run) == [10, 20]


def test_a_refused_start_leaves_the_run_s_records_as_they_were(trainer, finished_run):
  status = (finished_run / 'status.json').read_bytes()
  assert_refused(trainer.train(finished_run, *FLAGS, '--config.model.n_embd=32'), 'E-PARAM-002')
  assert (finished_run / 'status.json').read_bytes() == status  # still `finished`
  assert events_of(finished_run, 'failed') == []


def test_resume_mode_from_environment(trainer, finished_run):
  assert_refused(
      trainer.train(finished_run, *FLAGS, env={'JAXCKPT_RESUME': 'none'}), 'E-RESUME-001')


def test_resume_none_starts_fresh_in_an_empty_workdir(trainer, tmp_path):
  r = trainer.train(tmp_path, '--config.train.steps=10', '--resume=none')
  assert r.returncode == 0, r.stderr
  assert committed_steps(tmp_path) == [10]
  assert not events_of(tmp_path, 'resumed')


def test_resume_path_that_is_not_a_checkpoint(trainer, finished_run, tmp_path):
  line = assert_refused(
      trainer.train(tmp_path, *FLAGS, f'--resume={tmp_path}/nowhere'), 'E-RESUME-003')
  assert 'step_<n>' in line
  partial = tmp_path / 'step_00000010'
  shutil.copytree(finished_run / 'checkpoints' / 'step_00000010', partial)
  (partial / 'manifest.json').unlink()  # uncommitted: never a resume point
  assert_refused(trainer.train(tmp_path / 'w', *FLAGS, f'--resume={partial}'), 'E-RESUME-003')


def test_latest_passes_over_data_that_fails_its_checksum_while_loading(
    trainer, finished_run, tmp_path):
  """The checksum of the array data is checked while it is restored (one read, not a separate
  verification pass), and a mismatch there is passed over like any damaged checkpoint."""
  workdir = tmp_path / 'run'
  shutil.copytree(finished_run, workdir)
  flip_a_data_byte(workdir / 'checkpoints' / 'step_00000020')
  r = trainer.train(workdir, '--config.train.steps=30', '--checkpoint_every=10')
  assert r.returncode == 0, r.stderr
  warning = [line for line in r.stderr.splitlines() if 'passing over' in line]
  assert len(warning) == 1 and 'step_00000020' in warning[0] and 'checksum mismatch' in warning[0]
  resumed = events_of(workdir, 'resumed')
  assert [e['step'] for e in resumed] == [10]
  assert committed_steps(workdir) == [10, 20, 30]
  assert discovery.problems(workdir / 'checkpoints' / 'step_00000020') == []  # written again


def test_an_explicit_checkpoint_whose_data_is_damaged_is_refused(trainer, finished_run, tmp_path):
  damaged = tmp_path / 'step_00000020'
  shutil.copytree(finished_run / 'checkpoints' / 'step_00000020', damaged)
  flip_a_data_byte(damaged)
  r = trainer.train(tmp_path / 'w', *FLAGS, f'--resume={damaged}')
  assert r.returncode == 1, r.stderr
  assert 'Traceback' not in r.stderr
  line = r.stderr.strip().splitlines()[-1]
  assert line.startswith('jaxckpt: E-CKPT-003: ') and 'checksum mismatch' in line, line
  assert not (tmp_path / 'w' / 'checkpoints').exists() or not committed_steps(tmp_path / 'w')


def test_unlistable_checkpoint_location_is_an_error_not_a_fresh_start(trainer, tmp_path):
  (tmp_path / 'checkpoints').write_text('not a directory')
  line = assert_refused(trainer.train(tmp_path, *FLAGS), 'E-RESUME-002')
  assert 'cannot list' in line
  assert not (tmp_path / 'events.jsonl').exists()


@pytest.mark.parametrize('flag, code', [
    ('--checkpoint_mode=sometimes', 'E-USAGE-001'),
    ('--config.train.steps=0', 'E-CONFIG-001'),
    ('--config.model.n_head=3', 'E-CONFIG-001'),
    ('--keep=-1', 'E-CONFIG-004'),
    ('--config.data.sources.main=("/no/such/file.txt",)', 'E-DATA-001'),
])
def test_bad_input_is_one_line_and_exit_2(trainer, tmp_path, flag, code):
  assert_refused(trainer.train(tmp_path, flag), code)


def test_relative_workdir(trainer, tmp_path):
  """The README's quick start passes a relative --workdir."""
  r = trainer.train('runs/tiny', '--config.train.steps=10', '--checkpoint_every=5', cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert committed_steps(tmp_path / 'runs' / 'tiny') == [5, 10]
  assert (tmp_path / 'runs/tiny/exports/step_00000010/hf/config.json').is_file()
  export = jaxckpt_cli(
      'export',
      'runs/tiny/checkpoints/step_00000010',
      '--format=bin',
      '--out=x.bin',
      cwd=tmp_path,
      timeout=None)
  assert export.returncode == 0, export.stderr
  assert (tmp_path / 'x.bin').stat().st_size == 8 + 12 * 136_960


# `jaxckpt` commands on bad input, one table: (id, argv, stdout, exit status, the line's code).
# `{ckpt}` is a committed checkpoint, `{hostile}` one whose manifest names a file outside it and
# is re-sealed (as a hostile writer could), `{dir}` a directory and `{file}` a file that exist.
# stdout `closed`: a pipe whose reader has gone (`| head -3` once head exits); then nothing at
# all may be said (exit 141, as a shell reports `cat` killed by SIGPIPE).
CLI_CASES = [
    ('export bin onto a directory', ['export', '{ckpt}', '--format=bin',
                                     '--out={dir}'], 'pipe', 2, 'E-EXPORT-007'),
    ('export hf onto a file', ['export', '{ckpt}', '--format=hf',
                               '--out={file}'], 'pipe', 2, 'E-EXPORT-007'),
    ('inspect a manifest naming ../ files', ['inspect', '{hostile}'], 'pipe', 1, 'E-CKPT-005'),
    ('inspect --json to a reader that left', ['inspect', '{ckpt}', '--json'], 'closed', 141, None),
]


@pytest.fixture(scope='module')
def cli_inputs(finished_run, tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp('cli_inputs')
  ckpt = finished_run / 'checkpoints' / 'step_00000020'
  hostile = root / 'hostile' / ckpt.name
  shutil.copytree(ckpt, hostile)
  m = manifest.read(hostile)
  m['files']['../../outside'] = m['files'].pop('run_state.json')
  (hostile / layout.MANIFEST).write_bytes(manifest.sealed_json(m))
  (root / 'a_dir').mkdir()
  (root / 'a_dir' / 'kept.txt').write_text('mine\n')
  (root / 'a_file').write_text('mine\n')
  return {
      'ckpt': str(ckpt), 'hostile': str(hostile), 'dir': str(root / 'a_dir'),
      'file': str(root / 'a_file')
  }


def run_cli(argv: list[str], stdout: str) -> subprocess.CompletedProcess:
  if stdout == 'pipe':
    return jaxckpt_cli(*argv)
  read_end, write_end = os.pipe()
  os.close(read_end)  # the reader is gone before the first byte is written
  try:
    return subprocess.run([sys.executable, '-m', 'jaxckpt.cli', *argv],
                          cwd=REPO,
                          stdout=write_end,
                          stderr=subprocess.PIPE,
                          text=True,
                          timeout=120)
  finally:
    os.close(write_end)


@pytest.mark.parametrize(
    'argv, stdout, status, code', [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_a_command_on_bad_input_says_one_line(cli_inputs, argv, stdout, status, code):
  before = {p: Path(p).read_text() for p in (cli_inputs['file'], cli_inputs['dir'] + '/kept.txt')}
  r = run_cli([a.format(**cli_inputs) for a in argv], stdout)
  assert r.returncode == status, r.stderr
  assert 'Traceback' not in r.stderr, r.stderr
  if code is None:
    assert r.stderr == ''
  else:
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith(f'jaxckpt: {code}: '), lines[-1]
    assert [line for line in lines if line.startswith('jaxckpt:')] == [lines[-1]]
  assert {p: Path(p).read_text() for p in before} == before  # nothing replaced
