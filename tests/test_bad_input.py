"""Bad input to `python -m jaxckpt.main`, one table: each case is one line
`jaxckpt: E-...: what; fix` naming the input, exit 2, no traceback, and an existing run's
checkpoints untouched. A new case is a new row."""

from pathlib import Path

import pytest
from conftest import committed_steps

RUN = ('--config.train.steps=10', '--checkpoint_every=5')

# (id, flags, code, what the line must name). `{inputs}` is a folder of bad files (see `inputs`);
# a case runs against the finished run's workdir unless it passes its own --workdir.
CASES = [
    ('config missing', ['--config={inputs}/missing.py'], 'E-CONFIG-007', 'missing.py'),
    ('config a directory', ['--config={inputs}/a_dir'], 'E-CONFIG-007', 'a_dir'),
    ('config syntax error', ['--config={inputs}/syntax_error.py'], 'E-CONFIG-007',
     'syntax_error.py'),
    ('config without get_config', ['--config={inputs}/no_get_config.py'], 'E-CONFIG-007',
     'no_get_config.py'),
    ('config get_config raises', ['--config={inputs}/raises.py'], 'E-CONFIG-007', 'raises.py'),
    ('unknown config field', ['--config.train.nonexistent=1'], 'E-CONFIG-008', 'train.nonexistent'),
    ('unknown config section', ['--config.nosection.x=1'], 'E-CONFIG-008', 'nosection'),
    ('workdir cannot be created', ['--workdir=/proc/jaxckpt/run'], 'E-USAGE-005',
     '/proc/jaxckpt/run'),
    ('workdir a file', ['--workdir={inputs}/a_file'], 'E-USAGE-005', 'a_file'),
    ('stray argument', ['stray'], 'E-USAGE-004', 'stray'),
    ('unknown flag', ['--no_such_flag=1'], 'E-USAGE-001', 'no_such_flag'),
    ('bad checkpoint mode', ['--checkpoint_mode=sometimes'], 'E-USAGE-001', 'sometimes'),
    ('missing flagfile', ['--flagfile={inputs}/no_flagfile'], 'E-USAGE-001', 'no_flagfile'),
    ('lease of no time', ['--remote_lease_secs=0'], 'E-CONFIG-004', 'remote_lease_secs=0'),
    ('a request rate of no requests', ['--remote_rate=0'], 'E-CONFIG-004', "remote_rate='0'"),
    ('negative stop grace', ['--stop_grace_secs=-1'], 'E-CONFIG-004', 'stop_grace_secs=-1'),
    ('negative steps in flight', ['--config.train.max_steps_in_flight=-1'], 'E-CONFIG-001',
     'train.max_steps_in_flight=-1'),
    ('a data source that is no path', ['--config.data.sources.main=5'], 'E-CONFIG-001',
     'data.sources.main=(5,)'),
    ('coordinator address without a port',
     ['--coordinator_address=127.0.0.1', '--num_processes=2',
      '--process_id=0'], 'E-DIST-004', "--coordinator_address='127.0.0.1' is not HOST:PORT"),
    ('coordinator port out of range',
     ['--coordinator_address=127.0.0.1:99999', '--num_processes=2',
      '--process_id=0'], 'E-DIST-004', '127.0.0.1:99999'),
    ('init timeout of no time', [
        '--coordinator_address=127.0.0.1:1', '--num_processes=1', '--process_id=0',
        '--init_timeout_secs=0'
    ], 'E-CONFIG-004', 'init_timeout_secs=0'),
    ('step timeout of no time', ['--step_timeout_secs=0'], 'E-CONFIG-004', 'step_timeout_secs=0'),
]


@pytest.fixture(scope='module')
def finished_run(trainer, tmp_path_factory) -> Path:
  workdir = tmp_path_factory.mktemp('finished')
  r = trainer.train(workdir, *RUN)
  assert r.returncode == 0, r.stderr
  assert committed_steps(workdir) == [5, 10]
  return workdir


@pytest.fixture(scope='module')
def inputs(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp('inputs')
  (root / 'a_dir').mkdir()
  (root / 'a_file').write_text('not a directory\n')
  (root / 'syntax_error.py').write_text('def get_config(:\n  pass\n')
  (root / 'no_get_config.py').write_text('seed = 1\n')
  (root / 'raises.py').write_text('def get_config():\n  return 1 / 0\n')
  return root


def snapshot(workdir: Path) -> dict[str, tuple[bytes, int]]:
  """Bytes and mtime of every file under checkpoints/."""
  return {
      str(p.relative_to(workdir)): (p.read_bytes(), p.stat().st_mtime_ns)
      for p in sorted((workdir / 'checkpoints').rglob('*'))
      if p.is_file()
  }


@pytest.mark.parametrize('flags, code, names', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(trainer, finished_run, inputs, flags,
                                                          code, names):
  before = snapshot(finished_run)
  r = trainer.train(finished_run, *RUN, *(f.format(inputs=inputs) for f in flags))
  assert r.returncode == 2, r.stderr
  assert 'Traceback' not in r.stderr, r.stderr
  lines = r.stderr.strip().splitlines()
  assert lines[-1].startswith(f'jaxckpt: {code}: ') and names in lines[-1], lines[-1]
  assert [line for line in lines if line.startswith('jaxckpt:')] == [lines[-1]]
  assert snapshot(finished_run) == before


def test_an_unknown_field_lists_the_section_fields(trainer, finished_run):
  r = trainer.train(finished_run, *RUN, '--config.train.nonexistent=1')
  line = r.stderr.strip().splitlines()[-1]
  assert 'batch_size, ' in line and ', steps, ' in line, line
