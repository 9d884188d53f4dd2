"""Records that only grow (the loss history, the events) go to the remote by segment: each upload
sends what was appended since the last one (and the segments it merges), never the whole
record, and every commit rebuilds each record byte for byte. Against moto's S3 server and a
path."""

import json
import time

import jax.numpy as jnp
import pytest

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, RetentionPolicy, layout
from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.checkpoint.remote import Lease, Store, Uploader, objects
from jaxckpt.checkpoint.remote.segments import SEGMENTS, Appended, Segments

LINE = 100  # bytes appended to the record per checkpoint
STEPS = 16


@pytest.fixture(scope='module')
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp('local') / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    for step in range(1, STEPS + 1):
      mgr.save(step, {'w': jnp.full((64,), step, jnp.float32)}, {'step': step})
  return root


@pytest.fixture(params=['s3', 'path'])
def store(request, tmp_path):
  if request.param == 's3':
    return Store(request.getfixturevalue('s3_server').bucket(f'seg-{tmp_path.name}'))
  return Store(str(tmp_path / 'run'))


def _line(step: int, history: str = 'a') -> bytes:
  text = f'{{"step": {step}, "history": "{history}", "loss": {1 / step:.12f}}}'
  return (text + ' ' * (LINE - 1 - len(text)) + '\n').encode()


def _sizes(keys) -> int:
  """The bytes the segment keys hold, from their names (start-end-hash)."""
  return sum(int(b) - int(a) for a, b, _ in (k.rsplit('/', 1)[1].split('-') for k in keys))


def _grow_and_upload(store, checkpoints, record, segments) -> list[int]:
  """Steps 1..STEPS: a line appended to `record`, then the step's checkpoint uploaded with it
  (by `segments`); the bytes each upload wrote under records/."""
  sent = []
  for step in range(1, STEPS + 1):
    with open(record, 'ab') as f:
      f.write(_line(step))
    before = set(store.list(SEGMENTS + '/'))
    objects.upload(
        store,
        checkpoints / layout.step_dirname(step), {'loss.jsonl': Appended.of(record)},
        segments=segments)
    sent.append(_sizes(set(store.list(SEGMENTS + '/')) - before))
  return sent


def test_each_upload_sends_what_was_appended_and_every_commit_rebuilds_the_record(
    store, checkpoints, tmp_path):
  record = tmp_path / 'loss.jsonl'
  sent = _grow_and_upload(store, checkpoints, record, Segments())
  # A binary counter: upload k sends LINE x 2^(trailing zeros of k), and its commit names one
  # segment per set bit of k. The whole record each time would be LINE x k.
  assert sent == [LINE * (k & -k) for k in range(1, STEPS + 1)]
  assert sum(sent) < sum(LINE * k for k in range(1, STEPS + 1)) / 2  # 48 lines against 136
  whole = record.read_bytes()
  for step in (1, 7, 11, STEPS):
    meta = objects.inspect(store, step)[2]
    assert len(meta['records']['loss.jsonl']['segments']) == bin(step).count('1')
    _, records = objects.download(store, step, tmp_path / f'fresh-{step}')
    assert records == {'loss.jsonl': whole[:LINE * step]}


def test_no_upload_sends_more_than_the_longest_segment(store, checkpoints, tmp_path):
  record = tmp_path / 'loss.jsonl'
  sent = _grow_and_upload(store, checkpoints, record, Segments(segment_bytes=4 * LINE))
  assert sent == [LINE * min(k & -k, 4) for k in range(1, STEPS + 1)]  # 4 lines at most
  meta = objects.inspect(store, STEPS)[2]
  assert [b - a for a, b, _, _ in meta['records']['loss.jsonl']['segments']] == [4 * LINE] * 4
  _, records = objects.download(store, STEPS, tmp_path / 'fresh')
  assert records == {'loss.jsonl': record.read_bytes()}


def test_a_restart_sends_only_what_is_new_and_retention_removes_unnamed_segments(
    store, checkpoints, tmp_path):
  record = tmp_path / 'loss.jsonl'

  def upload(uploader, step, history='a'):
    with open(record, 'ab') as f:
      f.write(_line(step, history))
    uploader.submit(step, checkpoints / layout.step_dirname(step),
                    {'loss.jsonl': Appended.of(record), 'status.json': b'{}'})
    assert uploader.wait(step, timeout=60), uploader.error

  first = Uploader(store, retention=RetentionPolicy(keep=2))
  for step in range(1, 7):
    upload(first, step)
  first.close()
  # A new writer (a restart) takes the newest commit's segments its own file still holds: it
  # sends the 7th line alone, not the 700 bytes of the record.
  before, events = set(store.list(SEGMENTS + '/')), []
  again = Uploader(
      store, retention=RetentionPolicy(keep=2), on_event=lambda n, **f: events.append((n, f)))
  upload(again, 7)
  new = set(store.list(SEGMENTS + '/')) - before
  assert _sizes(new) == LINE
  upload(again, 8)  # 4 + 2 + 1 + 1 lines: merged into one of 8, read from the local file
  assert _sizes(set(store.list(SEGMENTS + '/')) - before - new) == LINE * 8
  again.close()
  # Kept: steps 7 and 8. Every segment left is named by one of them, and both rebuild whole.
  assert sorted(objects.committed(store)) == [7, 8]
  named = {
      k for s in (7, 8)
      for k in _keys(objects.inspect(store, s)[2]['records']['loss.jsonl']['segments'])
  }
  assert set(store.list(SEGMENTS + '/')) == named
  assert any(n == 'remote_retention' and f['segments'] > 0 for n, f in events)
  whole = record.read_bytes()
  for step in (7, 8):
    _, records = objects.download(store, step, tmp_path / f'fresh-{step}')
    assert records['loss.jsonl'] == whole[:LINE * step]


def test_a_writer_knows_the_events_every_remote_commit_it_knows_holds(store, checkpoints, tmp_path):
  """`committed_size`: where `URL/run/events.jsonl` starts. After a replay (a restart from an
  older step), the abandoned future a fresh machine may still download holds fewer events than
  the replay's commit: the tail starts where both hold them."""
  record = tmp_path / 'events.jsonl'
  replayed = tmp_path / 'replayed'  # step 2 again, another commit of it: other weights
  with CheckpointManager(replayed, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    mgr.save(2, {'w': jnp.full((64,), 20, jnp.float32)}, {'step': 2})

  def upload(uploader, step, root=checkpoints):
    with open(record, 'ab') as f:
      f.write(_line(step))
    uploader.submit(step, root / layout.step_dirname(step), {'events.jsonl': Appended.of(record)})
    assert uploader.wait(step, timeout=60), uploader.error

  first = Uploader(store, retention=RetentionPolicy(keep=0))
  assert first.committed_size('events.jsonl') == 0  # no commit yet
  for step in range(1, 5):
    upload(first, step)
  assert first.committed_size('events.jsonl') == 4 * LINE
  first.close()
  again = Uploader(store, retention=RetentionPolicy(keep=0))  # a restart that replays from 2
  upload(again, 2, replayed)
  assert again.committed_size('events.jsonl') == 4 * LINE  # step 4's, not the replay's 5 lines
  assert max(objects.committed(store)) == 4
  _, records = objects.download(store, 4, tmp_path / 'fresh')
  assert len(records['events.jsonl']) == 4 * LINE
  again.close()


def _keys(rows):
  return [f'{SEGMENTS}/loss.jsonl/{a:015d}-{b:015d}-{h}' for a, b, h, _ in rows]


def test_a_replay_writes_other_keys_and_a_damaged_segment_is_never_taken(
    store, checkpoints, tmp_path):
  a, b, segments = tmp_path / 'a.jsonl', tmp_path / 'b.jsonl', Segments()
  a.write_bytes(b''.join(_line(s) for s in (1, 2, 3)))
  objects.upload(
      store,
      checkpoints / layout.step_dirname(3), {'loss.jsonl': Appended.of(a)},
      segments=segments)
  # Another history from step 1: the same offsets, other bytes, under other keys.
  b.write_bytes(_line(1) + b''.join(_line(s, 'b') for s in (2, 3, 4)))
  objects.upload(
      store,
      checkpoints / layout.step_dirname(4), {'loss.jsonl': Appended.of(b)},
      segments=segments)
  assert objects.download(store, 3, tmp_path / 'x')[1]['loss.jsonl'] == a.read_bytes()
  assert objects.download(store, 4, tmp_path / 'y')[1]['loss.jsonl'] == b.read_bytes()
  # A segment of step 4 replaced by other bytes of its size: the download refuses it.
  key = _keys(objects.inspect(store, 4)[2]['records']['loss.jsonl']['segments'])[-1]
  store.write(key, b'x' * len(store.read(key)))
  with pytest.raises(CheckpointError, match='E-STORE-012.*loss.jsonl: does not match'):
    objects.download(store, 4, tmp_path / 'z')
  assert not (tmp_path / 'z' / layout.step_dirname(4)).exists()
  # A missing one: the commit is not intact, and the older step is taken.
  store.delete(key)
  assert objects.latest_intact(store) == (3, [(4, f'{key}: missing')])
  # The same file cut short and rewritten in place (its inode unchanged): checked whole again,
  # never spliced onto what was sent of it before.
  with open(b, 'r+b') as f:
    f.truncate(LINE)
    f.seek(LINE)
    f.write(b''.join(_line(s, 'c') for s in (2, 3, 4, 5)))
  objects.upload(
      store,
      checkpoints / layout.step_dirname(5), {'loss.jsonl': Appended.of(b)},
      segments=segments)
  assert objects.download(store, 5, tmp_path / 'w')[1]['loss.jsonl'] == b.read_bytes()


def test_a_commit_whose_segments_do_not_add_up_is_not_intact(store, checkpoints, tmp_path):
  record = tmp_path / 'loss.jsonl'
  record.write_bytes(b''.join(_line(s) for s in (1, 2, 3)))
  objects.upload(store, checkpoints / layout.step_dirname(3), {'loss.jsonl': Appended.of(record)})
  meta_key = 'checkpoints/step_00000003/remote.json'
  meta = json.loads(store.read(meta_key))
  meta['records']['loss.jsonl']['segments'][0][0] = 1  # not from byte 0
  store.write(meta_key, json.dumps(meta).encode())
  problems = objects.inspect(store, 3)[3]
  assert problems and 'loss.jsonl: segment 0 is malformed or not right after byte 0' in problems[0]


def test_with_a_lease_unnamed_segments_go_a_lease_time_after_a_sweep_found_them(
    checkpoints, tmp_path):
  store, record = Store(str(tmp_path / 'run')), tmp_path / 'loss.jsonl'
  lease = Lease(store, ttl_secs=2.0)
  lease.acquire()
  lease.start()
  uploader = Uploader(store, retention=RetentionPolicy(keep=1), lease=lease)
  try:
    for step in range(1, 6):
      with open(record, 'ab') as f:
        f.write(_line(step))
      uploader.submit(step, checkpoints / layout.step_dirname(step),
                      {'loss.jsonl': Appended.of(record)})
      assert uploader.wait(step, timeout=60), uploader.error
      if step == 4:
        time.sleep(lease.ttl)  # what the sweeps up to step 4's found unnamed may go at step 5's
    # Kept: step 5 alone (4 + 1 lines), and only what it names is left.
    assert sorted(objects.committed(store)) == [5]
    named = set(_keys(objects.inspect(store, 5)[2]['records']['loss.jsonl']['segments']))
    assert len(named) == 2 and set(store.list(SEGMENTS + '/')) == named
  finally:
    uploader.close()
    lease.release()
