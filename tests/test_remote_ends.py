"""What the save cadence takes from the remote tier, at its edges: against moto's S3 server.

- On a process other than 0, a step is durable only once process 0 committed it remotely (its
  `remote.json` there, and its word in the job's key-value store), never when this process's own
  part is up: two `RemoteRun`s of one job, talking through a real coordination service.
- A stop signal that comes while the upload of an earlier checkpoint hangs: the step reached
  never gets up, yet the remote's events end with the `interrupted` record, and a fresh machine
  restored from the remote counts that start as the save cadence should.
"""

import contextlib
import dataclasses
import json
import signal
import threading
import urllib.parse
import zlib
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from condition_proxy import ConditionProxy
from conftest import free_port, read_events, tiny_config, wait_for

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions
from jaxckpt.checkpoint.remote import Store, objects
from jaxckpt.hosts import distributed
from jaxckpt.hosts.remote import RemoteRun
from jaxckpt.hosts.remote_start import RUN_EVENTS, tail
from jaxckpt.records.runlog import RunLog
from jaxckpt.train.save_cadence import read_history


# ------------------------------------------------- durable on a process other than 0
@dataclasses.dataclass(frozen=True)
class _Process(distributed.Cluster):
  """Process `index` of a job whose key-value store `kv` (a real client) is passed in, so that
  both processes of the job can live in this test's one process."""
  kv: Any = None

  def client(self):
    return self.kv


@contextlib.contextmanager
def _job(count: int):
  """A real `jax.distributed` coordination service on loopback and `count` connected clients."""
  from jax._src.lib import _jax
  address = f'127.0.0.1:{free_port()}'
  service = _jax.get_distributed_runtime_service(
      address, count, heartbeat_timeout=30, shutdown_timeout=5)
  clients = [
      _jax.get_distributed_runtime_client(address, k, init_timeout=30, heartbeat_timeout=30)
      for k in range(count)
  ]
  _all(c.connect for c in clients)  # each connect waits for the others
  try:
    yield clients
  finally:
    _all(c.shutdown for c in clients)
    service.shutdown()


def _all(calls) -> None:
  threads = [threading.Thread(target=call) for call in calls]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)


def test_on_process_1_a_step_is_durable_only_once_process_0_committed_it(s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  ckpt_dir = tmp_path / 'checkpoints'
  infos = []
  with CheckpointManager(
      ckpt_dir, CheckpointOptions(every_steps=1, keep=0), on_commit=infos.append) as mgr:
    for step in (1, 2):
      mgr.save(step, {'w': jnp.asarray(np.arange(4096, dtype=np.float32) * step)}, {'step': step})
  first, second = infos
  config = tiny_config(**{'checkpoint.remote': url})
  with _job(2) as kv:
    runs = [RemoteRun.open(config, tmp_path, _Process(k, 2, kv=kv[k])) for k in (0, 1)]
    try:
      for k, run in enumerate(runs):  # process 0 first: it names the attempt
        run.attach(RunLog(tmp_path / f'host{k}'), CheckpointOptions(keep=0), ckpt_dir)
      leader, other = runs
      saved = other.chain(lambda: True)  # what the cadence on process 1 waits for
      other.on_commit(first)  # process 1's part of step 1 goes up; process 0 has not sent it
      wait_for(lambda: other.uploader.durable(1), timeout=60)
      assert 1 not in objects.committed(store)  # no remote.json: step 1 is not there whole
      assert not other.durable(1) and not saved()

      leader.on_commit(first)  # process 0 sends its part, the records, and commits
      wait_for(lambda: other.durable(1), timeout=60)
      assert 1 in objects.committed(store) and objects.inspect(store, 1)[3] == []
      assert saved()

      other.on_commit(second)  # process 0's word on step 1 says nothing of step 2
      wait_for(lambda: other.uploader.durable(2), timeout=60)
      assert 2 not in objects.committed(store)
      assert not other.durable(2) and not saved()
    finally:
      for run in reversed(runs):
        run.close()


# ------------------------------------------- a stop while an earlier checkpoint's upload hangs
class _Proxy(ConditionProxy):
  """`ConditionProxy` that also lists the paths of the requests it holds, as they arrive."""

  def __init__(self, upstream: str):
    super().__init__(upstream)
    self.arrived: list[str] = []

  def _handle(self, request) -> None:
    path = urllib.parse.urlsplit(request.path).path
    with self._lock:
      if any(path.endswith(k) for k in self._held):
        self.arrived.append(path)
    super()._handle(request)


def _step_of(path: str) -> int:
  return int(path.split('/checkpoints/step_')[1][:8])


def test_a_stop_during_an_earlier_upload_leaves_the_remote_events_ending_with_it(
    trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  proxy = _Proxy(s3_server.endpoint)
  workdir = tmp_path / 'vm1'
  try:
    proc = trainer.start(
        workdir,
        '--config.train.steps=100000',
        '--checkpoint_every=10',
        '--keep=0',
        '--config.train.log_every=1',
        f'--remote={url}',
        '--stop_grace_secs=1',
        env={'AWS_ENDPOINT_URL': proxy.endpoint})
    wait_for(lambda: objects.committed(store), proc, timeout=120)  # one checkpoint is up
    proxy.hold('/state/process_0.safetensors')  # the store stops answering for state files
    wait_for(lambda: proxy.arrived, proc, timeout=120)  # a later checkpoint's upload hangs there
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    proxy.stop()
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  end = [e for e in read_events(workdir) if e['event'] == 'interrupted'][-1]
  remote = max(objects.committed(store))
  assert remote < _step_of(proxy.arrived[0]) <= end['step'], (remote, proxy.arrived, end)
  assert f'step {end["step"]} is committed locally only' in out, out[-3000:]
  # The newest remote checkpoint's own records were taken at its save, before the stop.
  _, records = objects.download(store, remote, tmp_path / 'download')
  assert b'"interrupted"' not in records['events.jsonl']

  fresh = tmp_path / 'vm2'  # a fresh machine restored from the remote
  run = RemoteRun(store, fresh, tiny_config(**{'checkpoint.remote': url}))
  run.sync_down(fresh / 'checkpoints')
  events = read_events(fresh)
  assert events[-1] == end, events[-3:]  # the remote's events end with the end record
  assert events == read_events(workdir)[:len(events)]  # the first machine's, as they were
  assert run.start_step == remote and run.fetched['later_events'] > 0
  # What the first machine's end sent: the events past its newest remote commit's, not all.
  sent = store.read(RUN_EVENTS)
  assert sent.startswith(b'{"format":"jaxckpt.events-tail"'), sent[:200]
  assert len(sent) < len((workdir / 'events.jsonl').read_bytes()) - len(records['events.jsonl'])
  history = read_history(events)
  started = [e for e in events if e['event'] == 'started'][-1]
  assert history.interruptions == 1  # SIGTERM: a preemption
  assert history.exposure_s == end['time'] - started['time']  # the start ran until its end


EVENTS = b'{"event":"started","time":1.0}\n{"event":"checkpoint","time":2.0,"step":1}\n'
END = b'{"event":"interrupted","time":3.0,"step":4,"signal":"SIGTERM"}\n'


def test_a_tail_names_where_it_starts_and_is_whole_without_one():
  assert tail(EVENTS, 0) == EVENTS and tail(EVENTS, 5) == EVENTS  # no commit; not a line's end
  assert tail(EVENTS, len(EVENTS) + 1) == EVENTS
  head, rest = tail(EVENTS + END, len(EVENTS)).split(b'\n', 1)
  assert json.loads(head) == {
      'format': 'jaxckpt.events-tail', 'start': len(EVENTS), 'crc32': f'{zlib.crc32(EVENTS):08x}'
  } and rest == END


@pytest.mark.parametrize(
    'written, taken',
    [
        (EVENTS + END, EVENTS + END),  # the same run's, to its end
        (EVENTS, EVENTS),  # nothing past the checkpoint's
        (b'{"event":"started","time":0.5}\n' + EVENTS[31:] + END, EVENTS),  # another history's
        (EVENTS + b'[1]\n', EVENTS),  # a line that is no record
        (EVENTS + b'{"time":3.0}\n', EVENTS),  # a record that names no event
        (EVENTS + END[:-1], EVENTS),  # cut short
        (None, EVENTS),  # none there
        (tail(EVENTS + END, len(EVENTS)), EVENTS + END),  # past the commit's bytes: joined
        (tail(EVENTS + END, 31), EVENTS + END),  # past fewer of them: joined where they start
        (tail(b'{"event":"started","time":0.5}\n' + EVENTS[31:] + END, 31), EVENTS),  # another's
        (tail(EVENTS + END + END, len(EVENTS + END)), EVENTS),  # past a newer commit's
        (tail(EVENTS + END, len(EVENTS)) + b'[1]\n', EVENTS),  # a tail with a line no record
    ],
    ids=[
        'continues', 'equal', 'another history', 'not a record', 'no event', 'cut', 'absent',
        'tail', 'longer tail', 'tail of another history', 'tail of a newer commit', 'bad tail'
    ])
def test_the_remote_events_are_taken_only_when_they_continue_the_checkpoint_s(
    s3_server, tmp_path, written, taken):
  """`URL/run/events.jsonl` is from the bucket: a fresh machine takes it in place of the
  downloaded checkpoint's events only when it continues them, byte for byte, with records."""
  url = s3_server.bucket()
  store = Store(url)
  with CheckpointManager(tmp_path / 'local', CheckpointOptions(every_steps=1, keep=0)) as mgr:
    mgr.save(1, {'w': jnp.zeros(16)}, {'step': 1})
  objects.upload(store, tmp_path / 'local' / 'step_00000001', {'events.jsonl': EVENTS})
  if written is not None:
    store.write(RUN_EVENTS, written)
  fresh = tmp_path / 'fresh'
  run = RemoteRun(store, fresh, tiny_config(**{'checkpoint.remote': url}))
  run.sync_down(fresh / 'checkpoints')
  assert run.start_step == 1
  assert (fresh / 'events.jsonl').read_bytes() == taken
