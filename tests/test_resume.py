"""End to end through `python -m jaxckpt.main`: a stopped run continues bit-exactly.

Each straight run trains the tiny config STEPS steps in one go; each interrupted run is stopped
(SIGKILL, or SIGTERM which checkpoints the step it stops at) right after the checkpoint of step k
commits, and then started again with the same command.
"""

import json
import shutil
import signal

import pytest
from conftest import (STRAIGHT_FLAGS, STRAIGHT_MESHES, STRAIGHT_STEPS, TWO_SOURCES,
                      assert_same_bytes, checkpoint_arrays, committed_steps, events_of,
                      flip_a_data_byte, jaxckpt_cli, losses, read_events, wait_for)

from jaxckpt.records.runlog import read_status

STEPS = STRAIGHT_STEPS
KILL_AFTER = 20
RUN_FLAGS = STRAIGHT_FLAGS  # (steps STEPS, a checkpoint every 10, log every 10, keep all)
MESHES = STRAIGHT_MESHES  # {1: default, 8: data 4 x model 2}


@pytest.fixture(scope='module')
def straight(straight_runs):
  """{devices: workdir of a run of RUN_FLAGS trained STEPS steps without stopping}: the session's
  (tests/test_elastic.py compares with the 8-device one too). Read only: copy one to change it."""
  return straight_runs


@pytest.mark.parametrize(
    'devices, stop',
    [
        pytest.param(1, signal.SIGKILL, marks=pytest.mark.slow),  # tests/test_chaos.py's, 4 times
        pytest.param(8, signal.SIGKILL, marks=pytest.mark.slow),
        pytest.param(1, signal.SIGTERM, marks=pytest.mark.slow),
        (8, signal.SIGTERM),
    ])  # the other three pairs: `-m slow`
def test_stopped_run_continued_by_the_same_command_is_bit_exact(trainer, straight, tmp_path,
                                                                devices, stop):
  proc = trainer.start(tmp_path, *RUN_FLAGS, *MESHES[devices], devices=devices)
  wait_for(lambda: KILL_AFTER in committed_steps(tmp_path), proc)
  proc.send_signal(stop)
  proc.wait()
  assert proc.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 128 + stop)
  survived = committed_steps(tmp_path)
  assert max(survived) < STEPS, 'the run finished before it could be killed'

  again = trainer.train(tmp_path, *RUN_FLAGS, *MESHES[devices], devices=devices)
  assert again.returncode == 0, again.stderr

  resumed = events_of(tmp_path, 'resumed')
  assert [e['step'] for e in resumed] == [max(survived)]
  assert_same_bytes(checkpoint_arrays(tmp_path, STEPS), checkpoint_arrays(straight[devices], STEPS))
  assert losses(tmp_path) == losses(straight[devices])
  assert sorted(losses(tmp_path)) == list(range(1, STEPS + 1))
  status = read_status(tmp_path)
  assert status['state'] == 'finished' and status['step'] == STEPS


def test_loss_history_keeps_replayed_steps_as_a_new_segment(trainer, straight, tmp_path):
  """Resuming an explicit older checkpoint replays steps; the history keeps both segments."""
  workdir = tmp_path / 'run'
  shutil.copytree(straight[1], workdir)
  r = trainer.train(workdir, *RUN_FLAGS, f'--resume={workdir}/checkpoints/step_00000040')
  assert r.returncode == 0, r.stderr
  rows = [json.loads(line) for line in (workdir / 'loss.jsonl').read_text().splitlines()]
  assert [row['step'] for row in rows] == list(range(1, STEPS + 1)) + list(range(41, STEPS + 1))
  assert {row['segment'] for row in rows[STEPS:]} == {1}
  # The replay rewrote the checkpoints of steps 50..80 over the first history's (each swapped in
  # atomically). Compared here: the last one, and each step's loss as the replay recorded it.
  assert_same_bytes(checkpoint_arrays(workdir, STEPS), checkpoint_arrays(straight[1], STEPS))
  assert losses(workdir) == losses(straight[1])


def test_debris_is_never_resumed_and_is_cleaned(trainer, straight, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(straight[1], workdir)
  ckpts = workdir / 'checkpoints'
  # A step directory whose manifest was never written, and a temporary directory.
  shutil.copytree(ckpts / 'step_00000080', ckpts / 'step_00000090')
  (ckpts / 'step_00000090' / 'manifest.json').unlink()
  shutil.copytree(ckpts / 'step_00000080', ckpts / 'step_00000100.tmp-0123456789ab')
  r = trainer.train(workdir, *RUN_FLAGS)
  assert r.returncode == 0, r.stderr
  assert [e['step'] for e in events_of(workdir, 'resumed')] == [STEPS]
  cleaned = events_of(workdir, 'cleaned')
  assert len(cleaned) == 1 and len(cleaned[0]['paths']) == 2
  assert sorted(p.name for p in ckpts.iterdir()) == [f'step_{s:08d}' for s in range(10, 81, 10)]


TWO_FLAGS = (f'--config={TWO_SOURCES}', '--config.train.steps=60', '--checkpoint_every=10',
             '--checkpoint_mode=async', '--config.train.log_every=10', '--keep=0')


def checkpoint_files(step_dir):
  """{relative path: bytes} of every file of a checkpoint but its manifest (which records when
  it was committed)."""
  return {
      str(p.relative_to(step_dir)): p.read_bytes()
      for p in sorted(step_dir.rglob('*'))
      if p.is_file() and p.name != 'manifest.json'
  }


def test_async_checkpoints_hold_the_run_state_of_their_own_step(trainer, tmp_path):
  """With two data sources the bandit's state changes every step; each async checkpoint holds
  the bandit of its own step, and a killed and resumed run ends with every file of its final
  checkpoint (run_state.json included) byte-identical to an uninterrupted run's."""
  straight = tmp_path / 'straight'
  r = trainer.train(straight, *TWO_FLAGS)
  assert r.returncode == 0, r.stderr
  for step in (10, 30, 60):
    run_state = json.loads(
        (straight / 'checkpoints' / f'step_{step:08d}' / 'run_state.json').read_text())
    assert sum(run_state['bandit']['pulls']) == step
    assert run_state['bandit']['phase_steps'] == step
    assert all(p > 0 for p in run_state['bandit']['pulls'])  # both sources were drawn

  killed = tmp_path / 'killed'
  proc = trainer.start(killed, *TWO_FLAGS)
  wait_for(lambda: 20 in committed_steps(killed), proc)
  proc.kill()
  proc.wait()
  assert max(committed_steps(killed)) < 60, 'the run finished before it could be killed'
  again = trainer.train(killed, *TWO_FLAGS)
  assert again.returncode == 0, again.stderr
  final = lambda workdir: checkpoint_files(workdir / 'checkpoints' / 'step_00000060')
  assert final(killed) == final(straight)
  assert losses(killed) == losses(straight)


def test_steps_replayed_past_damaged_checkpoints_are_checkpointed_again(
    trainer, straight, tmp_path):
  """`latest` passes over the damaged steps 70 and 80, continues from 60, and replaces both
  damaged checkpoints as it passes them: afterwards `jaxckpt verify` finds the run intact."""
  workdir = tmp_path / 'run'
  shutil.copytree(straight[1], workdir)
  for step in (70, 80):
    flip_a_data_byte(workdir / 'checkpoints' / f'step_{step:08d}')
  r = trainer.train('run', *RUN_FLAGS, cwd=tmp_path)  # a relative --workdir
  assert r.returncode == 0, r.stderr
  assert [e['step'] for e in events_of(workdir, 'resumed')] == [60]
  # Each damaged checkpoint is read once and said once, whatever way the workdir was spelled.
  assert r.stderr.count('passing over') == 2, r.stderr
  events = read_events(workdir)
  resumed_at = max(i for i, e in enumerate(events) if e['event'] == 'resumed')
  assert [e['step'] for e in events[resumed_at:] if e['event'] == 'checkpoint'] == [70, 80]
  verify = jaxckpt_cli('verify', str(workdir), timeout=None)
  assert verify.returncode == 0, verify.stdout + verify.stderr
  assert_same_bytes(checkpoint_arrays(workdir, STEPS), checkpoint_arrays(straight[1], STEPS))
  for step in (70, 80):
    name = f'step_{step:08d}'
    assert checkpoint_files(workdir / 'checkpoints' / name) == checkpoint_files(
        straight[1] / 'checkpoints' / name)
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == [
      f'step_{s:08d}' for s in range(10, 81, 10)
  ]
