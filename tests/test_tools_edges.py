"""The edges of `jaxckpt plot`, `pivot` and `evaluate`: a path that is a file, a directory, missing
or read-only, a config that does not load, a second pivot, damaged checkpoints. Each refusal is
one line with its code and the right exit status, and leaves the run's files as they were."""

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import REPO, call_cli, events_of, flip_a_data_byte, jaxckpt_cli

from jaxckpt.checkpoint import layout

PNG = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(scope='module')
def run(trainer, tmp_path_factory) -> Path:
  """A stopped tiny run with checkpoints at steps 10 and 20. Read it only: a test that changes a
  run works on a copy (`copy_of`)."""
  workdir = tmp_path_factory.mktemp('edges') / 'run'
  r = trainer.train(workdir, '--config.train.steps=20', '--checkpoint_every=10',
                    '--config.train.log_every=10')
  assert r.returncode == 0, r.stderr
  return workdir


def copy_of(run: Path, tmp_path: Path) -> Path:
  return Path(shutil.copytree(run, tmp_path / 'run'))


def listing(root: Path) -> dict[str, bytes]:
  """Every file under `root` and its content."""
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}


def one_line(code, err: str, expected_code: str, exit_status: int = 2) -> str:
  assert code == exit_status, err
  assert 'Traceback' not in err
  assert err.startswith(f'jaxckpt: {expected_code}: ') and err.count('\n') == 1, err
  return err


# -------------------------------------------------------------------------------------- plot
@pytest.mark.parametrize('case', ['missing directory', 'under a file', 'jsonl', 'read-only'])
def test_plot_refuses_an_out_it_cannot_write(run, tmp_path, capsys, case):
  out = {
      'missing directory': tmp_path / 'nodir' / 'sub' / 'x.png',
      'under a file': run / 'loss.jsonl' / 'x.png',
      'jsonl': run / 'loss.jsonl',
      'read-only': Path('/sys/loss.png'),  # sysfs: no new file there, not even for root
  }[case]
  if case == 'read-only' and not Path('/sys').is_dir():
    pytest.skip('no /sys here')
  before, scratch = listing(run), sorted(os.listdir(tmp_path))
  code, stdout, err = call_cli(['plot', f'--workdir={run}', f'--out={out}'], capsys)
  line = one_line(code, err, 'E-PLOT-002')
  assert not stdout and str(out) in line
  if case == 'jsonl':
    assert '.png' in line and '.pdf' in line  # the suffixes it can write
  assert listing(run) == before and sorted(os.listdir(tmp_path)) == scratch


def test_plot_refuses_a_workdir_that_is_a_file(run, capsys):
  code, stdout, err = call_cli(['plot', f'--workdir={run / "loss.jsonl"}'], capsys)
  line = one_line(code, err, 'E-PLOT-001')
  assert not stdout and f'{run / "loss.jsonl"} is a file, not a run directory' in line


@pytest.mark.parametrize('out, written', [('myplot', 'myplot.png'), ('plots', 'plots/loss.png'),
                                          ('loss.svg', 'loss.svg')])
def test_plot_prints_the_path_it_wrote(run, tmp_path, capsys, out, written):
  (tmp_path / 'plots').mkdir()
  code, stdout, err = call_cli(['plot', f'--workdir={run}', f'--out={tmp_path / out}'], capsys)
  assert code == 0, err
  assert stdout == f'{tmp_path / written}\n'
  content = (tmp_path / written).read_bytes()
  assert content.startswith(PNG) if written.endswith('.png') else b'<svg' in content[:1000]
  assert sorted(os.listdir(tmp_path)) == sorted({'plots', written.split('/')[0]})


@pytest.mark.parametrize('content, drawn, said', [
    ({'20': {'heldout_loss': 4.6, 'path': 'x'}, '10': {'heldout_loss': 5.1}}, {10: 5.1, 20: 4.6
                                                                              }, ''),
    ({'x': {'heldout_loss': 4.6}}, {}, 'not the {"<step>"'),
    ({'10': {'heldout_loss': 'NaN'}}, {}, 'not finite'),
    ([1, 2], {}, 'not the {"<step>"'),
])
def test_plot_draws_what_jaxckpt_evaluate_wrote(run, tmp_path, capsys, content, drawn, said):
  from jaxckpt.records import plot
  workdir = copy_of(run, tmp_path)
  (workdir / 'evaluated.json').write_text(json.dumps(content))
  assert plot.evaluated_losses(workdir) == drawn
  capsys.readouterr()
  code, stdout, err = call_cli(['plot', f'--workdir={workdir}'], capsys)
  assert code == 0 and stdout == f'{workdir / "loss.png"}\n', err
  if said:  # a file that is not one is said, and the plot drawn all the same
    assert err.startswith(f'jaxckpt: not drawing {workdir / "evaluated.json"}: ') and said in err
  else:
    assert err == ''


def _records(workdir: Path, losses: bytes, events: bytes = b'') -> Path:
  """A hand-made run: steps 1-4 of segment 0 as the trainer writes them, then `losses`, and the
  events `events`."""
  workdir.mkdir()
  rows = ''.join(
      json.dumps({'step': s, 'segment': 0, 'loss': 5.0 - s / 10}) + '\n' for s in range(1, 5))
  (workdir / 'loss.jsonl').write_bytes(rows.encode() + losses)
  if events:
    (workdir / 'events.jsonl').write_bytes(events)
  return workdir


FOREIGN_LOSSES = {
    'step a string': b'{"step": "5", "segment": 0, "loss": 1.0}\n',
    'step a float': b'{"step": 2.5, "segment": 0, "loss": 1.0}\n',
    'step a bool': b'{"step": true, "segment": 1, "loss": 1.0}\n',  # would stand for step 1
    'step None': b'{"step": null, "segment": 0, "loss": 1.0}\n',
    'segment a list': b'{"step": 5, "segment": [0], "loss": 1.0}\n',
    'segment a string': b'{"step": 2, "segment": "1", "loss": 1.0}\n',
    'loss a string': b'{"step": 5, "segment": 0, "loss": "low"}\n',
    'not UTF-8': b'\x89PNG\r\n\x1a\n\xff\xfe{"step": 5, "segment": 0, "loss": "\xe9"}\n',
}
FOREIGN_EVENTS = {
    'events not UTF-8': b'\xff\xfe\x00\x80\n{"event": "resumed", "step": 3, "x": "\xe9"}\n',
    'event steps that are no steps': b'{"event": "resumed", "step": "3"}\n'
                                     b'{"event": "pivot", "step": [1], "phase": 1}\n'
                                     b'{"event": "eval", "step": null, "heldout_loss": 4.0}\n',
    'eval without its loss': b'{"event": "eval", "step": 2}\n'
                             b'{"event": "eval", "step": 3, "heldout_loss": "4"}\n',
}


@pytest.mark.parametrize('case', [*FOREIGN_LOSSES, *FOREIGN_EVENTS])
def test_plot_passes_over_rows_jaxckpt_does_not_write(tmp_path, capsys, case):
  from jaxckpt.records import plot
  workdir = _records(tmp_path / 'run', FOREIGN_LOSSES.get(case, b''), FOREIGN_EVENTS.get(case, b''))
  code, stdout, err = call_cli(['plot', f'--workdir={workdir}'], capsys)
  assert 'Traceback' not in err
  assert code == 0 and stdout == f'{workdir / "loss.png"}\n' and err == '', err
  assert (workdir / 'loss.png').read_bytes().startswith(PNG)
  history, events = plot.read_records(workdir)  # what was drawn: the rows jaxckpt wrote
  assert {step: row['loss'] for step, row in history.items()} == {1: 4.9, 2: 4.8, 3: 4.7, 4: 4.6}
  assert all(type(e['step']) is int for e in events)


@pytest.mark.parametrize('name', ['loss.jsonl', 'events.jsonl'])
@pytest.mark.parametrize('case, says', [
    ('directory', 'is a directory, not a file'),
    ('symlink loop', 'cannot be read: Too many levels of symbolic links'),
    pytest.param('pipe', 'is a pipe or a device, not a file', marks=pytest.mark.timeout(30)),
    ('no permission', 'cannot be read: Permission denied'),
])
def test_plot_refuses_a_records_file_it_cannot_read(tmp_path, capsys, name, case, says):
  workdir = _records(tmp_path / 'run', b'', b'{"event": "resumed", "step": 2}\n')
  path = workdir / name
  path.unlink()
  if case == 'directory':
    path.mkdir()
  elif case == 'symlink loop':
    path.symlink_to(path)
  elif case == 'pipe':
    os.mkfifo(path)  # no writer: reading it would wait forever
  else:
    if os.geteuid() == 0:
      pytest.skip('root reads any file')
    path.write_text('{}\n')
    path.chmod(0)
  code, stdout, err = call_cli(['plot', f'--workdir={workdir}'], capsys)
  line = one_line(code, err, 'E-PLOT-001')
  assert not stdout and f'{path} {says}' in line and 'point --workdir at another run' in line
  assert not (workdir / 'loss.png').exists()


# ------------------------------------------------------------------------------------- pivot
def test_a_second_pivot_in_a_row_is_refused_and_records_nothing(run, tmp_path, capsys):
  workdir = copy_of(run, tmp_path)
  code, stdout, err = call_cli(['pivot', f'--workdir={workdir}'], capsys)
  assert code == 0 and 'archived samples.json, bandit.json to archive/phase-0/' in stdout, err
  before = listing(workdir)
  code, stdout, err = call_cli(['pivot', f'--workdir={workdir}'], capsys)
  line = one_line(code, err, 'E-PIVOT-001')
  assert not stdout and 'nothing to pivot' in line
  assert os.listdir(workdir / 'archive') == ['phase-0']
  assert [e['phase'] for e in events_of(workdir, 'pivot')] == [1]
  assert listing(workdir) == before


# ---------------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize('case, says', [('missing', 'no such file'),
                                        ('directory', 'is a directory'),
                                        ('syntax error', 'SyntaxError')])
@pytest.mark.parametrize('follow', [[], ['--follow']])
def test_evaluate_refuses_a_config_that_does_not_load(run, tmp_path, capsys, case, says, follow):
  config = {
      'missing': tmp_path / 'nope.py',
      'directory': REPO / 'configs',
      'syntax error': tmp_path / 'broken.py',
  }[case]
  (tmp_path / 'broken.py').write_text('def get_config(:\n')
  workdir = run if not follow else tmp_path / 'not-yet'  # --follow would create it
  code, stdout, err = call_cli(['evaluate', f'--workdir={workdir}', f'--config={config}', *follow],
                               capsys)
  line = one_line(code, err, 'E-USAGE-001')
  assert not stdout and f'--config={config}' in line and says in line
  assert not (run / 'evaluated.json').exists() and not (tmp_path / 'not-yet').exists()


@pytest.mark.parametrize('follow', [[], ['--follow']])
def test_evaluate_says_a_workdir_that_is_a_file_is_one(run, capsys, follow):
  before = (run / 'loss.jsonl').read_bytes()
  code, stdout, err = call_cli(['evaluate', f'--workdir={run / "loss.jsonl"}', *follow], capsys)
  line = one_line(code, err, 'E-EVAL-003')
  assert not stdout and f'{run / "loss.jsonl"} is a file, not a run directory' in line
  assert (run / 'loss.jsonl').read_bytes() == before


def _damage(workdir: Path, *steps: int) -> None:
  for step in steps:
    flip_a_data_byte(workdir / 'checkpoints' / layout.step_dirname(step))


def test_evaluate_fails_when_no_checkpoint_could_be_evaluated(run, tmp_path, compile_cache):
  workdir = copy_of(run, tmp_path)
  _damage(workdir, 10, 20)
  r = jaxckpt_cli('evaluate', f'--workdir={workdir}', cache=compile_cache, timeout=300)
  assert r.returncode == 1, r.stdout + r.stderr
  lines = r.stderr.strip().splitlines()
  assert 'Traceback' not in r.stderr
  assert [l.split(': ')[1] for l in lines if ': not evaluated: ' in l] == ['step 10', 'step 20']
  assert lines[-1].startswith('jaxckpt: E-EVAL-006: 2 of 2 committed checkpoint(s) could not be '
                              'evaluated (steps 10, 20)'), lines[-1]
  assert not (workdir / 'evaluated.json').exists()


def test_evaluate_fails_when_some_checkpoints_could_not_be_evaluated(run, tmp_path, compile_cache):
  workdir = copy_of(run, tmp_path)
  _damage(workdir, 10)
  for _ in range(2):  # still damaged the second time: still a failure, 20 not evaluated again
    r = jaxckpt_cli('evaluate', f'--workdir={workdir}', cache=compile_cache, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        'jaxckpt: E-EVAL-006: 1 of 2 committed checkpoint(s) could not be evaluated (step 10)')
    assert list(json.loads((workdir / 'evaluated.json').read_text())) == ['20']
  assert 'step 20: heldout_loss' not in r.stdout


@pytest.mark.parametrize('command', ['plot', 'pivot'])
def test_an_empty_workdir_is_refused_not_the_current_directory(run, capsys, monkeypatch, command):
  monkeypatch.chdir(run)  # `jaxckpt pivot --workdir=$RUN` with RUN unset, inside a run
  before = sorted(os.listdir(run))
  code, stdout, err = call_cli([command, '--workdir='], capsys)
  assert code == 2 and not stdout and 'E-USAGE-001' in err and '--workdir is empty' in err
  assert sorted(os.listdir(run)) == before  # nothing archived, nothing drawn
