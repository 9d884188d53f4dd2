import json

from jaxckpt.records.runlog import LOSSES, RunLog, read_jsonl, read_loss_history, read_status


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
