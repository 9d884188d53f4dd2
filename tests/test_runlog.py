import json

from jaxckpt.records.runlog import (LOSSES, RunLog, read_evals, read_jsonl, read_loss_history,
                                    read_status)


def test_a_line_cut_by_a_crash_costs_only_itself(tmp_path):
  log = RunLog(tmp_path)
  log.event('started')
  with open(tmp_path / 'events.jsonl', 'ab') as f:
    f.write(b'{"event":"checkpoint","st')  # the process died mid-write
  log.event('resumed')
  assert [e['event'] for e in read_jsonl(tmp_path / 'events.jsonl')] == ['started', 'resumed']


def test_segments_count_starts_and_the_newest_segment_wins(tmp_path):
  first = RunLog(tmp_path)
  first.event('started')
  first.losses([{'step': s, 'loss': 10.0 - s} for s in (1, 2, 3)])
  second = RunLog(tmp_path)
  assert second.segment == 1
  second.event('started')
  second.losses([{'step': s, 'loss': 100.0 + s} for s in (2, 3, 4)])
  history = read_loss_history(tmp_path)
  assert {s: r['loss'] for s, r in history.items()} == {1: 9.0, 2: 102.0, 3: 103.0, 4: 104.0}
  lines = (tmp_path / LOSSES).read_text().splitlines()
  assert len(lines) == 6  # nothing rewritten: both versions of steps 2 and 3 are there
  assert [json.loads(l)['segment'] for l in lines] == [0, 0, 0, 1, 1, 1]


def test_status_is_replaced_whole(tmp_path):
  log = RunLog(tmp_path)
  log.status(state='running', step=1)
  log.status(step=2)
  status = read_status(tmp_path)
  assert status['state'] == 'running' and status['step'] == 2 and 'pid' in status


def test_steps_a_later_start_went_back_past_are_not_the_history(tmp_path):
  """Logged to 40, resumed from the checkpoint of step 20 and stopped at 30: the history ends at
  30, as TensorBoard shows it; steps 31-40 belong to the abandoned attempt."""
  first = RunLog(tmp_path)
  first.event('started', step=0)
  first.losses([{'step': s, 'loss': 1.0} for s in range(1, 41)])
  first.event('eval', step=20, heldout_loss=5.0)
  first.event('eval', step=40, heldout_loss=4.0)
  second = RunLog(tmp_path)
  second.event('started', step=20)
  second.losses([{'step': s, 'loss': 2.0} for s in range(21, 31)])
  second.event('eval', step=30, heldout_loss=3.0)
  history = read_loss_history(tmp_path)
  assert max(history) == 30 and len(history) == 30
  assert {r['loss'] for s, r in history.items() if s > 20} == {2.0}
  assert read_evals(read_jsonl(tmp_path / 'events.jsonl')) == {20: 5.0, 30: 3.0}
  third = RunLog(tmp_path)  # a resume from 30 logs on: nothing of the second is dropped
  third.event('started', step=30)
  third.losses([{'step': 31, 'loss': 3.0}])
  assert max(read_loss_history(tmp_path)) == 31 and len(read_loss_history(tmp_path)) == 31


def test_a_start_that_passed_over_a_damaged_checkpoint_keeps_its_history(tmp_path):
  """Across processes a start says `started` again when it passes over a checkpoint one process
  found damaged: its segment starts at the last one, and none of its losses is dropped."""
  first = RunLog(tmp_path)
  first.event('started', step=0, segment=first.segment)
  first.losses([{'step': s, 'loss': 1.0} for s in range(1, 61)])
  second = RunLog(tmp_path)
  second.event('started', step=50, segment=second.segment)  # step 50's shard: damaged
  second.event('started', step=40, segment=second.segment)  # every process took 40 instead
  second.losses([{'step': s, 'loss': 2.0} for s in range(41, 71)])
  history = read_loss_history(tmp_path)
  assert list(history) == list(range(1, 71))
  assert {r['loss'] for s, r in history.items() if s > 40} == {2.0}
