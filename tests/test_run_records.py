"""One writer per workdir, the finite guard, satellites with lifetimes, pivot and plot."""

import json
import os
import signal
import socket

import pytest
from conftest import TWO_SOURCES, committed_steps, events_of, jaxckpt_cli, wait_for

from jaxckpt.errors import UsageError
from jaxckpt.records.runlog import read_loss_history, read_status
from jaxckpt.records.workdir import WorkdirLock


def test_a_second_writer_is_refused_naming_the_holder(trainer, tmp_path):
  proc = trainer.start(tmp_path, '--config.train.steps=3000', '--checkpoint_every=0')
  try:
    wait_for(lambda: (tmp_path / 'loss.jsonl').exists(), proc)
    second = trainer.train(tmp_path, '--config.train.steps=3000')
    assert second.returncode == 2, second.stderr
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith('jaxckpt: E-LOCK-001: ')
    assert f'pid {proc.pid}' in line and socket.gethostname() in line
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
  assert proc.returncode == 143


def test_a_lock_left_by_a_dead_process_is_taken_over(trainer, tmp_path):
  dead = {'pid': 999_999, 'host': socket.gethostname(), 'started_at': 1.0}
  (tmp_path / 'LOCK').write_text(json.dumps(dead))
  r = trainer.train(tmp_path, '--config.train.steps=10')
  assert r.returncode == 0, r.stderr
  taken = events_of(tmp_path, 'lock_taken_over')
  assert [e['previous']['pid'] for e in taken] == [999_999]
  # The run's last line says where it ended, and that the checkpoint of that step is committed.
  last = [line for line in r.stderr.splitlines() if 'loop.py' in line][-1]
  assert last.endswith(f'finished at step 10: {tmp_path}/checkpoints/step_00000010 is committed')


def test_lock_in_process(tmp_path):
  with WorkdirLock(tmp_path):
    with pytest.raises(UsageError, match=f'E-LOCK-001.*pid {os.getpid()}'):
      WorkdirLock(tmp_path).acquire()
  with WorkdirLock(tmp_path) as again:  # released on exit
    assert again.previous_holder is None


def test_finite_guard_stops_before_committing_and_a_resume_replays(trainer, tmp_path):
  # Train to step 20 of a 40-step run (SIGTERM-free: a shorter run with the same cadence).
  ok = trainer.train(tmp_path, '--config.train.steps=20', '--checkpoint_every=10', '--keep=0')
  assert ok.returncode == 0, ok.stderr
  exploding = trainer.train(tmp_path, '--config.train.steps=40', '--checkpoint_every=10',
                            '--keep=0', '--config.train.lr=1e30', '--guard_finite')
  assert exploding.returncode == 1
  line = exploding.stderr.strip().splitlines()[-1]
  assert line.startswith('jaxckpt: step 30: the proposed parameter ')
  assert line.endswith(' values that are not finite; nothing was committed')
  assert 'Traceback' not in exploding.stderr
  assert committed_steps(tmp_path) == [10, 20]
  assert read_status(tmp_path)['state'] == 'failed'
  healthy = trainer.train(tmp_path, '--config.train.steps=40', '--checkpoint_every=10', '--keep=0',
                          '--guard_finite')
  assert healthy.returncode == 0, healthy.stderr
  assert committed_steps(tmp_path) == [10, 20, 30, 40]
  assert [e['step'] for e in events_of(tmp_path, 'resumed')] == [20, 20]


def test_pivot_and_zombie_arm(trainer, tmp_path):
  extra = tmp_path / 'extra.txt'
  extra.write_text('the quick brown fox jumps over the lazy dog. ' * 400)
  workdir = tmp_path / 'run'
  both = (f'--config={TWO_SOURCES}', f'--config.data.sources.extra=("{extra}",)',
          '--checkpoint_every=10', '--keep=0', '--config.train.log_every=10')
  r = trainer.train(workdir, *both, '--config.train.steps=40')
  assert r.returncode == 0, r.stderr
  mirror = json.loads((workdir / 'bandit.json').read_text())
  assert sorted(mirror['arms']) == ['extra', 'main'] and sum(mirror['pulls']) == 40
  assert all(p > 0 for p in mirror['pulls'])

  # The `extra` source leaves the config: its arm is dropped on resume, never sampled again.
  flags = ('--checkpoint_every=10', '--keep=0', '--config.train.log_every=10')
  r = trainer.train(workdir, *flags, '--config.train.steps=60')
  assert r.returncode == 0, r.stderr
  assert [e['arms'] for e in events_of(workdir, 'bandit_arms_dropped')] == [['extra']]
  assert 'dropped bandit arm(s) whose data source is no longer configured: extra' in r.stderr
  mirror = json.loads((workdir / 'bandit.json').read_text())
  assert mirror['arms'] == ['main'] and mirror['phase_steps'] == 60

  # A pivot archives the phase's satellites; the next start has a fresh bandit, same history.
  pivot = jaxckpt_cli('pivot', f'--workdir={workdir}')
  assert pivot.returncode == 0, pivot.stderr
  archive = workdir / 'archive' / 'phase-0'
  assert sorted(os.listdir(archive)) == ['bandit.json', 'samples.json']
  assert not (workdir / 'bandit.json').exists() and not (workdir / 'samples.json').exists()
  r = trainer.train(workdir, *both, '--config.train.steps=80')
  assert r.returncode == 0, r.stderr
  assert [e['phase'] for e in events_of(workdir, 'pivot')] == [1]
  assert [e['phase'] for e in events_of(workdir, 'bandit_reset')] == [1]
  mirror = json.loads((workdir / 'bandit.json').read_text())
  assert mirror['phase'] == 1 and mirror['phase_steps'] == 20 and sum(mirror['pulls']) == 20
  assert json.loads((workdir / 'samples.json').read_text())['phase'] == 1
  assert sorted(read_loss_history(workdir)) == list(range(1, 81))
  assert [e['step'] for e in events_of(workdir, 'resumed')] == [40, 60]

  plot = jaxckpt_cli('plot', f'--workdir={workdir}')
  assert plot.returncode == 0, plot.stderr
  assert (workdir / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_a_save_that_fails_while_the_run_stops_for_another_error_is_reported(
    tmp_path, monkeypatch, caplog):
  """The loop fails (here: sampling raises) while the checkpoint before it is still being
  written and fails too: the loop's error is raised, and the save's is logged and recorded."""
  import logging
  import threading

  from conftest import tiny_config

  from jaxckpt.checkpoint import statefile
  from jaxckpt.train import loop as train

  sampled = threading.Event()

  def disk_gone(*args, **kwargs):  # still in flight when the loop fails: it waits for that
    sampled.wait(60)
    raise OSError(5, 'Input/output error')

  real_samples = train.generate_samples

  def samples(trainer, params, step):
    if step == 20:
      sampled.set()
      raise RuntimeError('sampling failed')
    return real_samples(trainer, params, step)

  monkeypatch.setattr(statefile, 'write', disk_gone)
  monkeypatch.setattr(train, 'generate_samples', samples)
  config = tiny_config(**{'train.steps': 30, 'checkpoint.every': 10, 'checkpoint.mode': 'async'})
  caplog.set_level(logging.ERROR)
  with pytest.raises(RuntimeError, match='sampling failed'):
    train.train_and_evaluate(config, tmp_path)
  failed = events_of(tmp_path, 'save_failed')
  assert len(failed) == 1 and 'E-CKPT-001' in failed[0]['error'], failed
  assert 'the checkpoint in flight failed too' in caplog.text
  assert read_status(tmp_path)['state'] == 'failed' and committed_steps(tmp_path) == []


def test_keep_best_keeps_the_checkpoints_with_the_lowest_heldout_loss(trainer, tmp_path):
  r = trainer.train(tmp_path, '--config.train.steps=60', '--checkpoint_every=10', '--keep=1',
                    '--keep_best=2', '--config.train.eval_every=20')
  assert r.returncode == 0, r.stderr
  heldout = {e['step']: e['heldout_loss'] for e in events_of(tmp_path, 'eval')}
  assert sorted(heldout) == [20, 40, 60]
  best = sorted(heldout, key=heldout.get)[:2]
  assert committed_steps(tmp_path) == sorted({60, *best})  # the newest, and the best two
  inspect = jaxckpt_cli('inspect', str(tmp_path / 'checkpoints' / f'step_{best[0]:08d}'))
  assert f'metrics     heldout_loss {heldout[best[0]]:.6g}' in inspect.stdout, inspect.stdout


def test_a_start_that_locked_a_removed_workdir_takes_the_one_there_now(tmp_path, monkeypatch):
  """A refused start removes the workdir it made, while a second start has opened its LOCK and
  not yet locked it: the second then holds a lock on a file no longer there, and must take the
  LOCK there now, or a third start would get in beside it."""
  import threading

  from jaxckpt.records import workdir as wd
  run = tmp_path / 'run'
  first = wd.WorkdirLock(run).acquire()  # made the workdir; refused before it wrote anything
  opened, go, real = threading.Event(), threading.Event(), wd.fcntl.flock

  def flock(fd, op):  # the second start's lock comes a moment after its open
    if threading.current_thread().name == 'second' and op != wd.fcntl.LOCK_UN:
      opened.set()
      go.wait(timeout=30)
    return real(fd, op)

  monkeypatch.setattr(wd.fcntl, 'flock', flock)
  got = {}
  second = threading.Thread(
      target=lambda: got.update(lock=wd.WorkdirLock(run).acquire()), name='second')
  second.start()
  assert opened.wait(timeout=30)
  first.release()  # removes LOCK and the workdir it made
  go.set()
  second.join(timeout=30)
  assert (run / 'LOCK').is_file()  # the second start's, made again
  with pytest.raises(UsageError, match='E-LOCK-001'):
    wd.WorkdirLock(run).acquire()
  got['lock'].release()
