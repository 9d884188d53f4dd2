"""A failed background save is never silent, whatever the cadence: heard at the next step
boundary (a log line and a `save_failed` event), retried at the next cadence point, and a failed
retry stops the run with E-CKPT-001 naming the last good checkpoint, which stays intact.

The workdir is a real tmpfs too small for the run's checkpoints (`--keep=0` keeps them all): it
fills up mid-run and the kernel answers ENOSPC, as a full disk does.
"""

import signal
import subprocess
from pathlib import Path

import pytest
from conftest import committed_steps, events_of, mounted_tmpfs, wait_for

from jaxckpt.checkpoint import manifest
from jaxckpt.records.runlog import read_status

# The tiny config's checkpoint is 1.66 MB: 6 MB holds three of them and the records, not four.
DISK_KB = 6 * 1024
QUIET = ('--keep=0', '--config.samples.every=0', '--export_every=0')


@pytest.fixture
def small_disk(tmp_path):
  """A fresh tmpfs of `DISK_KB`, unmounted afterwards."""
  with mounted_tmpfs(tmp_path / 'disk', f'{DISK_KB}k') as disk:
    yield disk


def assert_stopped_at_the_retry(workdir: Path, r: subprocess.CompletedProcess, total: int):
  out = r.stdout + r.stderr
  assert r.returncode == 1, out
  good = committed_steps(workdir)
  assert len(good) == 3, good  # the disk held three
  failed = events_of(workdir, 'save_failed')
  assert len(failed) == 2, failed  # the first failure, then its retry's
  first, retry = failed
  # Heard at once: at a step boundary before the retry's save, not at the end of the run.
  assert first['step'] < first['heard_at'] < retry['step'] < total
  assert not first['retry'] and retry['retry'] and first['last_good'] == good[-1]
  assert 'No space left on device' in first['error']
  # The log said so while the run went on (before the retry), and the run's last line says why
  # it stopped and which checkpoint to continue from.
  logged = [
      i for i, line in enumerate(out.splitlines()) if f'checkpoint step {first["step"]} '
      'failed: E-CKPT-001' in line and 'the next checkpoint retries it' in line
  ]
  assert logged, out
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxckpt: E-CKPT-001: ') and 'No space left on device' in last, last
  assert f'the last good checkpoint is step {good[-1]} (' in last, last
  assert 'Traceback' not in out
  status = read_status(workdir)
  assert status['state'] == 'failed' and 'E-CKPT-001' in status['error']
  assert events_of(workdir, 'failed')[-1]['error'].startswith('CheckpointError: E-CKPT-001')
  step_dir = workdir / 'checkpoints' / f'step_{good[-1]:08d}'
  assert manifest.audit(step_dir, checksums=True)[1] == []  # intact, every CRC checked
  assert not [p for p in (workdir / 'checkpoints').iterdir() if '.tmp-' in p.name]


@pytest.mark.parametrize('mode', ['async', 'sync'])
def test_fixed_cadence_a_full_disk_is_heard_at_once_retried_then_stops(trainer, small_disk, mode):
  workdir = small_disk / 'run'
  r = trainer.train(workdir, '--checkpoint_every=20', '--config.train.steps=200',
                    '--config.train.log_every=10', f'--checkpoint_mode={mode}', *QUIET)
  assert_stopped_at_the_retry(workdir, r, 200)
  assert [e['step'] for e in events_of(workdir, 'save_failed')] == [80, 100]


def test_auto_cadence_a_full_disk_is_retried_then_stops(trainer, small_disk):
  workdir = small_disk / 'run'
  r = trainer.train(workdir, '--checkpoint_every=auto', '--checkpoint_mtbi=30s',
                    '--config.train.steps=1500', '--config.train.log_every=100', *QUIET)
  # Before, auto never saved again after a failure (durable = commits >= saves) and the error
  # came out at the last step: here the retry is an automatic save, mid-run.
  assert_stopped_at_the_retry(workdir, r, 1500)


def test_a_failed_save_retried_once_the_disk_has_room_goes_on(trainer, small_disk):
  workdir = small_disk / 'run'
  # Room for one checkpoint and the records: the second does not fit until the filler goes.
  filler = small_disk / 'filler'
  filler.write_bytes(b'\0' * (DISK_KB * 1024 - 2_600_000))
  proc = trainer.start(workdir, '--checkpoint_every=0', '--config.train.steps=100000',
                       '--config.train.log_every=20', *QUIET)
  try:
    wait_for(lambda: status_step(workdir) > 0, proc)
    proc.send_signal(signal.SIGUSR1)  # a checkpoint now: it fits
    wait_for(lambda: len(events_of_or_none(workdir, 'checkpoint')) == 1, proc)
    proc.send_signal(signal.SIGUSR1)  # the next one does not
    wait_for(lambda: events_of_or_none(workdir, 'save_failed'), proc)  # heard while running
    filler.unlink()
    proc.send_signal(signal.SIGUSR1)  # the next save, the retry: there is room now
    wait_for(lambda: len(events_of_or_none(workdir, 'checkpoint')) == 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert 'E-CKPT-001: checkpoint step' not in out  # the run did not stop for the failure
  status = read_status(workdir)
  assert status['state'] == 'interrupted'
  failed = events_of(workdir, 'save_failed')
  assert len(failed) == 1 and not failed[0]['retry']
  saved = [e['step'] for e in events_of(workdir, 'checkpoint')]
  # The first, the retry, and the stop's own (unless the stop came at the retry's step).
  assert len(saved) in (2, 3) and saved[0] < failed[0]['step'] < saved[1] <= saved[-1]
  assert committed_steps(workdir) == sorted(set(saved)) and status['step'] == saved[-1]
  for step in saved:
    step_dir = workdir / 'checkpoints' / f'step_{step:08d}'
    assert manifest.audit(step_dir, checksums=True)[1] == []


def events_of_or_none(workdir, name='started'):
  return events_of(workdir, name) if (workdir / 'events.jsonl').exists() else []


def status_step(workdir) -> int:
  try:
    return int(read_status(workdir).get('step') or 0)
  except (OSError, ValueError):
    return 0
