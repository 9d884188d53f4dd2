"""Phase-lifetime satellites and the pivot, in-process."""

import json

import pytest

from configs import tiny
from jaxckpt.checkpoint import atomic
from jaxckpt.errors import ConfigError
from jaxckpt.records import phases
from jaxckpt.records import workdir as workdir_lib
from jaxckpt.records.runlog import RunLog
from jaxckpt.train import config as config_lib


@pytest.mark.parametrize('keep, rounds', [(0, []), (2, [3, 4])])
def test_samples_keep_counts_rounds_and_zero_keeps_none(tmp_path, keep, rounds):
  for step in (1, 2, 3, 4):
    phases.write_samples(tmp_path, 0, step, [f'text {step}'], keep)
  written = json.loads((tmp_path / workdir_lib.SAMPLES).read_text())
  assert [r['step'] for r in written['rounds']] == rounds


def test_a_negative_samples_keep_is_a_config_error():
  config = tiny.get_config()
  config.samples.keep = -1
  with pytest.raises(ConfigError, match='E-CONFIG-001: samples.keep=-1'):
    config_lib.validate_config(config)


def test_pivot_makes_the_archive_durable_before_moving_files_into_it(tmp_path, monkeypatch):
  (tmp_path / 'checkpoints').mkdir()
  RunLog(tmp_path)
  for name in (workdir_lib.SAMPLES, workdir_lib.BANDIT):
    (tmp_path / name).write_text('{}')
  order = []
  real_fsync, real_replace = atomic.fsync_dir, phases.os.replace
  monkeypatch.setattr(atomic, 'fsync_dir', lambda p: (order.append(
      ('fsync', p.name)), real_fsync(p)))
  monkeypatch.setattr(phases.os, 'replace', lambda a, b: (order.append(
      ('move', a.name)), real_replace(a, b)))
  assert phases.pivot(tmp_path) == (1, [workdir_lib.SAMPLES, workdir_lib.BANDIT])
  first_move = order.index(('move', workdir_lib.SAMPLES))
  assert ('fsync', workdir_lib.ARCHIVE) in order[:first_move]  # the entry of phase-0 in archive/
  assert ('fsync', tmp_path.name) in order[:first_move]  # the entry of archive/ in the workdir


@pytest.mark.parametrize('moved',
                         [[], [workdir_lib.SAMPLES], [workdir_lib.SAMPLES, workdir_lib.BANDIT]])
def test_a_pivot_cut_short_is_finished_by_the_next(tmp_path, moved):
  """Killed after it made the archive or moved files, before it recorded its event: the phase
  did not change, and pivoting again finishes it instead of refusing."""
  (tmp_path / 'checkpoints').mkdir()
  RunLog(tmp_path)
  for name in (workdir_lib.SAMPLES, workdir_lib.BANDIT):
    (tmp_path / name).write_text(json.dumps({'name': name}))
  dest = tmp_path / workdir_lib.ARCHIVE / 'phase-0'
  dest.mkdir(parents=True)
  for name in moved:
    (tmp_path / name).replace(dest / name)
  assert phases.current_phase(tmp_path) == 0
  assert phases.pivot(tmp_path) == (1, [workdir_lib.SAMPLES, workdir_lib.BANDIT])
  assert phases.current_phase(tmp_path) == 1
  for name in (workdir_lib.SAMPLES, workdir_lib.BANDIT):
    assert json.loads((dest / name).read_text()) == {'name': name}
    assert not (tmp_path / name).exists()


def test_an_archive_holding_anything_else_is_not_taken_for_a_pivot_cut_short(tmp_path):
  (tmp_path / 'checkpoints').mkdir()
  (tmp_path / workdir_lib.BANDIT).write_text('{}')
  dest = tmp_path / workdir_lib.ARCHIVE / 'phase-0'
  dest.mkdir(parents=True)
  (dest / 'notes.txt').write_text('mine')
  with pytest.raises(phases.UsageError, match='E-PIVOT-002'):
    phases.pivot(tmp_path)
  assert (tmp_path / workdir_lib.BANDIT).exists()
