"""TensorBoard event files (WORKDIR/tensorboard/), read back with TensorBoard's own reader.

- They hold loss.jsonl's values, float32 as written, for every step, across a resume that rolls
  back past steps it had logged (TensorBoard shows the replayed steps, once each).
- `--config.train.tensorboard=false` writes none.
- A disk that fills up under them is one WARNING line; the run trains to its end.
"""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

QUIET = ('--keep=0', '--checkpoint_every=4', '--config.train.log_every=5',
         '--config.train.eval_every=4', '--export_every=0', '--config.samples.every=0')
# No checkpoints or evaluations but the last step's: only the loss rows matter here.
LIGHT = ('--export_every=0', '--config.samples.every=0', '--config.train.log_every=5')
WARNING = 'TensorBoard event files in'


def read_events(logdir: Path) -> dict[str, list]:
  """{tag: [ScalarEvent(wall_time, step, value), ...]} as TensorBoard shows them."""
  acc = event_accumulator.EventAccumulator(
      str(logdir), size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return {tag: acc.Scalars(tag) for tag in acc.Tags()['scalars']}


def newest(rows: list[dict], key: str = 'segment') -> dict[int, dict]:
  """{step: row} keeping, per step, the row the latest start wrote."""
  best = {}
  for row in rows:
    if row['step'] not in best or row[key] >= best[row['step']][key]:
      best[row['step']] = row
  return best


def jsonl(path: Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def assert_matches(events: list, rows: dict[int, dict], field: str) -> None:
  assert [e.step for e in events] == sorted(rows), field  # each step once, in order
  for e in events:
    want = np.float32(rows[e.step][field])
    assert np.float32(e.value).tobytes() == want.tobytes(), (field, e.step, e.value, want)
    assert e.wall_time == rows[e.step]['time']


def test_events_hold_the_loss_history_across_a_rollback(trainer, tmp_path):
  workdir = tmp_path / 'run'
  cosine = '--config.train.warmup_steps=2'  # past warmup the schedule depends on train.steps
  r = trainer.train(workdir, '--config.train.steps=12', cosine, *QUIET)
  assert r.returncode == 0, r.stderr
  # Resumed from step 8 with more steps: 9..12 are trained again (under a longer schedule, so
  # with other values), then 13..16.
  older = next((workdir / 'checkpoints').glob('step_*8'))
  r = trainer.train(workdir, '--config.train.steps=16', cosine, f'--resume={older}', *QUIET)
  assert r.returncode == 0, r.stderr
  assert WARNING not in r.stderr

  files = sorted((workdir / 'tensorboard').iterdir())
  assert len(files) == 2 and all('tfevents' in f.name for f in files), files
  losses = jsonl(workdir / 'loss.jsonl')
  assert {r['segment'] for r in losses if r['step'] == 10} == {0, 1}  # replayed
  history = newest(losses)
  assert sorted(history) == list(range(1, 17))
  replaced = [r for r in losses if r['segment'] == 0 and r['step'] == 12][0]
  assert replaced['lr'] != history[12]['lr']  # the shown value is the replayed one
  events = read_events(workdir / 'tensorboard')
  for tag, field in (('train/loss', 'loss'), ('train/lr', 'lr'), ('train/grad_norm', 'grad_norm')):
    assert_matches(events[tag], history, field)

  # The starts' events.jsonl rows, the newest per step, with their start's index as a segment.
  records, start = [], -1
  for e in jsonl(workdir / 'events.jsonl'):
    start += e['event'] == 'started'
    records.append({**e, 'segment': start})
  evals = newest([e for e in records if e['event'] == 'eval'])
  assert sorted(evals) == [4, 8, 12, 16]
  assert_matches(events['eval/heldout_loss'], evals, 'heldout_loss')
  commits = newest([e for e in records if e['event'] == 'checkpoint'])
  assert sorted(commits) == [4, 8, 12, 16]
  for field in ('seconds_blocked', 'seconds_to_commit', 'bytes'):
    assert_matches(events[f'checkpoint/{field}'], commits, field)
  speeds = events['train/tokens_per_sec']
  assert speeds and all(e.value > 0 and 1 <= e.step <= 16 for e in speeds), speeds


def test_off_writes_no_event_file(trainer, tmp_path):
  workdir = tmp_path / 'run'
  r = trainer.train(workdir, '--config.train.steps=3', '--config.train.tensorboard=false', *LIGHT)
  assert r.returncode == 0, r.stderr
  assert len(jsonl(workdir / 'loss.jsonl')) == 3
  assert not (workdir / 'tensorboard').exists()
  assert not [p for p in workdir.rglob('*') if 'tfevents' in p.name]


@pytest.fixture
def full_disk_logdir(tmp_path):
  """WORKDIR/tensorboard on a real tmpfs of one page: the event file outgrows it mid-run."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  logdir = tmp_path / 'run' / 'tensorboard'
  logdir.mkdir(parents=True)
  subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=4k', 'tmpfs', str(logdir)], check=True)
  try:
    yield logdir
  finally:
    subprocess.run(['umount', '-l', str(logdir)], check=False)


def test_a_full_disk_stops_the_events_not_the_run(trainer, full_disk_logdir):
  workdir = full_disk_logdir.parent
  r = trainer.train(workdir, '--config.train.steps=40', *LIGHT)
  assert r.returncode == 0, r.stderr
  warnings = [line for line in r.stderr.splitlines() if WARNING in line]
  assert len(warnings) == 1 and warnings[0].startswith('W'), r.stderr
  assert 'No space left on device' in warnings[0]
  assert json.loads((workdir / 'status.json').read_text())['state'] == 'finished'
  history = newest(jsonl(workdir / 'loss.jsonl'))
  assert sorted(history) == list(range(1, 41))
  # What reached the disk reads back: the first steps, as loss.jsonl holds them.
  shown = read_events(full_disk_logdir)['train/loss']
  assert 0 < len(shown) < 40
  assert_matches(shown, {s: history[s] for s in range(1, len(shown) + 1)}, 'loss')
