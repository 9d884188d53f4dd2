"""What a bucket holds is never trusted, however it is wrong: against moto's S3 server and path
stores, with real uploads tampered with in the store.

- A store that keeps answering 503 at start is one line naming the URL and the fix, exit 2.
- JSON nested too deeply (a step's `remote.json`, the tail of `URL/run/events.jsonl`) is
  malformed, never a RecursionError: the step is passed over, the tail too; and the run's records
  are in the workdir before a downloaded checkpoint is published, so a start that fails between
  the two never leaves a checkpoint without its records.
- A manifest naming `x` and `x/y`, or a step other than its folder's (a step folder copied in the
  bucket), or a `remote.json` over its bound, is not intact: the next older step is taken.
- A manifest whose retention or metrics fields are malformed is kept, and retention goes on for
  the others.
- A lease whose times or TTL are not sane, or that is over its bound, is damaged: taken over once
  it stayed unchanged for a TTL, refused when something keeps rewriting it; never a traceback,
  never a wait as long as the bucket says.
- Process 0 names a process that has not begun its part of a step.
"""

import contextlib
import json
import os
import threading
import time
import zlib

import jax.numpy as jnp
import pytest
from condition_proxy import ConditionProxy
from conftest import free_port, tiny_config

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, RetentionPolicy, layout
from jaxckpt.checkpoint import manifest as manifests
from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.checkpoint.remote import Store, objects
from jaxckpt.checkpoint.remote.lease import Lease, LeaseError
from jaxckpt.checkpoint.remote import parts as parts_lib
from jaxckpt.checkpoint.remote.parts import Parts, Superseded
from jaxckpt.checkpoint.remote.store import Retries
from jaxckpt.checkpoint.remote.uploader import Uploader
from jaxckpt.errors import UsageError, exit_code
from jaxckpt.hosts.remote import RemoteRun
from jaxckpt.hosts.remote_access import check_access
from jaxckpt.hosts.remote_start import RUN_EVENTS

EVENTS = b'{"event":"started","time":1.0}\n{"event":"checkpoint","time":2.0,"step":1}\n'
LOSS = b'{"step": 1, "loss": 2.5}\n' * 40
DEEP = b'[' * 100_000


@pytest.fixture(scope='module')
def local(tmp_path_factory):
  """Committed local checkpoints of steps 1..4."""
  root = tmp_path_factory.mktemp('local') / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    for step in (1, 2, 3, 4):
      mgr.save(step, {'w': jnp.arange(1000.0) * step}, {'step': step})
  return root


def _upload(store: Store, local, *steps: int) -> None:
  for step in steps:
    objects.upload(store, local / layout.step_dirname(step),
                   {'events.jsonl': EVENTS, 'loss.jsonl': LOSS})


def _meta_key(step: int) -> str:
  return f'{objects.step_prefix(step)}remote.json'


def _reseal(store: Store, step: int, change) -> None:
  """Step `step`'s remote manifest changed by `change(manifest, attempt's key prefix)` and sealed
  again, its commit saying its new size and CRC-32: a manifest whose seal and commit hold."""
  meta = json.loads(store.read(_meta_key(step)))
  data = f'{objects.step_prefix(step)}{meta["attempt"]}/'
  m = json.loads(store.read(data + layout.MANIFEST))
  change(m, data)
  raw = manifests.sealed_json(m)
  store.write(data + layout.MANIFEST, raw)
  meta['manifest'] = {'size': len(raw), 'crc32': f'{zlib.crc32(raw):08x}'}
  store.write(_meta_key(step), json.dumps(meta).encode())


def _fresh_start(store: Store, workdir) -> RemoteRun:
  run = RemoteRun(store, workdir, tiny_config(**{'checkpoint.remote': store.url}))
  run.sync_down(workdir / 'checkpoints')
  return run


# ----------------------------------------------------------------------- a store slowing down
def test_a_store_that_keeps_saying_slow_down_at_start_is_one_line(s3_server):
  proxy = ConditionProxy(s3_server.endpoint)
  saved = os.environ['AWS_ENDPOINT_URL']
  try:
    os.environ['AWS_ENDPOINT_URL'] = proxy.endpoint
    store = Store(s3_server.bucket(), retries=Retries(slow_first=0.1, slow_max=0.3, slow_secs=1.5))
    store.list()  # opened now, at the proxy
    proxy.slow_down = lambda method, path: True
    with pytest.raises(UsageError) as e:
      check_access(store, conditions=True)
  finally:
    os.environ['AWS_ENDPOINT_URL'] = saved
    proxy.stop()
  line = e.value.line()
  assert e.value.code == 'E-STORE-015' and exit_code(e.value) == 2, line
  assert f'--remote={store.url}: ' in line and '--remote_rate' in line, line
  assert '\n' not in line


# ------------------------------------------------------------------------ JSON nested too deeply
def test_a_commit_nested_too_deeply_is_passed_over(local, tmp_path):
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1, 2)
  store.write(_meta_key(2), DEEP)
  problems = objects.inspect(store, 2)[3]
  assert problems and problems[0].startswith('remote.json: '), problems
  assert objects.latest_intact(store)[0] == 1
  run = _fresh_start(store, tmp_path / 'fresh')
  assert run.start_step == 1
  assert (tmp_path / 'fresh' / 'checkpoints' / layout.step_dirname(1)).is_dir()


def test_an_events_tail_nested_too_deeply_is_passed_over(local, tmp_path):
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1)
  store.write(RUN_EVENTS, EVENTS + DEEP + b'\n')
  fresh = tmp_path / 'fresh'
  run = _fresh_start(store, fresh)
  assert run.start_step == 1 and run.fetched['later_events'] == 0
  assert (fresh / 'events.jsonl').read_bytes() == EVENTS  # the checkpoint's own
  assert (fresh / 'loss.jsonl').read_bytes() == LOSS


def test_a_start_that_cannot_write_the_records_leaves_the_checkpoint_to_the_next(local, tmp_path):
  """The records go into the workdir before the checkpoint is published: a start that fails in
  between has published nothing, and the next one downloads the checkpoint and its records."""
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1)
  fresh = tmp_path / 'fresh'
  (fresh / 'loss.jsonl').mkdir(parents=True)  # in the way of the record
  with pytest.raises(OSError):
    _fresh_start(store, fresh)
  assert layout.committed_steps(fresh / 'checkpoints') == {}
  (fresh / 'loss.jsonl').rmdir()
  run = _fresh_start(store, fresh)
  assert run.start_step == 1 and 1 in layout.committed_steps(fresh / 'checkpoints')
  assert (fresh / 'loss.jsonl').read_bytes() == LOSS
  assert (fresh / 'events.jsonl').read_bytes() == EVENTS


# ------------------------------------------------------------- a manifest out of its place
def test_a_manifest_naming_a_file_and_a_folder_of_it_is_not_intact(s3_server, local, tmp_path):
  store = Store(s3_server.bucket())
  _upload(store, local, 1, 2)

  def conflict(m, data):
    for rel, body in (('extra', b'one'), ('extra/inner', b'two')):
      store.write(data + rel, body)
      m['files'][rel] = {'size': len(body), 'crc32': f'{zlib.crc32(body):08x}'}

  _reseal(store, 2, conflict)
  problems = objects.inspect(store, 2)[3]
  assert problems and "'extra' both as a file and as the folder" in problems[0], problems
  with pytest.raises(CheckpointError) as e:
    objects.download(store, 2, tmp_path / 'down')
  assert e.value.code == 'E-STORE-012'
  assert_a_fresh_start_takes(store, tmp_path / 'fresh', 1)


def assert_a_fresh_start_takes(store, workdir, step: int) -> None:
  """A fresh machine's start from `store` takes `step` and downloads it alone."""
  run = _fresh_start(store, workdir)
  assert run.start_step == step
  assert list(layout.committed_steps(workdir / 'checkpoints')) == [step]


def test_a_step_folder_copied_in_the_bucket_is_not_intact(local, tmp_path):
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1, 2)
  for key in store.list(objects.step_prefix(1)):  # step_1 copied to step_7
    store.write(key.replace(layout.step_dirname(1), layout.step_dirname(7)), store.read(key))
  problems = objects.inspect(store, 7)[3]
  assert problems and 'step 1' in problems[0] and 'step 7' in problems[0], problems
  assert objects.latest_intact(store)[0] == 2
  assert_a_fresh_start_takes(store, tmp_path / 'fresh', 2)


def test_a_manifest_whose_step_is_no_whole_number_is_not_intact(local, tmp_path):
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1, 2)
  _reseal(store, 2, lambda m, data: m.update(step='2'))
  assert objects.inspect(store, 2)[3]
  with pytest.raises(CheckpointError) as e:
    objects.download(store, 2, tmp_path / 'down')
  assert e.value.code == 'E-STORE-012'
  assert objects.latest_intact(store)[0] == 1


def test_a_commit_over_its_bound_is_not_intact(local, tmp_path):
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1, 2)
  meta = json.loads(store.read(_meta_key(2)))
  store.write(_meta_key(2), json.dumps({**meta, 'pad': 'x' * (5 << 20)}).encode())
  problems = objects.inspect(store, 2)[3]
  assert problems and 'larger than' in problems[0], problems
  assert objects.latest_intact(store)[0] == 1


# ---------------------------------------------------------------------- retention on doubt
@pytest.mark.parametrize(
    'field, value', [
        ('retention', {'kept': 3}),
        ('retention', 'keep'),
        ('retention', {'kept': [], 'best': {'metric': 'heldout_loss', 'among': 'two'}}),
        ('metrics', [1]),
    ],
    ids=['kept a number', 'a string', 'among a string', 'metrics a list'])
def test_a_malformed_retention_record_is_kept_and_retention_goes_on(local, tmp_path, field, value):
  store = Store(str(tmp_path / 'bucket'))
  _upload(store, local, 1, 2)
  _reseal(store, 1, lambda m, data: m.update({field: value}))
  events = []
  uploader = Uploader(
      store,
      retention=RetentionPolicy(keep=1),
      on_event=lambda name, **fields: events.append((name, fields)))
  try:
    for step in (3, 4):
      uploader.submit(step, local / layout.step_dirname(step))
      assert uploader.wait(step, timeout=60), events
  finally:
    uploader.close()
  assert sorted(objects.committed(store)) == [1, 4], events  # 2 and 3 pruned, 1 kept
  assert [n for n, _ in events if n in ('upload_failed', 'remote_retention_failed')] == [], events


# --------------------------------------------------------------------------------- the lease
def _lease(**fields) -> bytes:
  now = time.time()
  body = {
      'id': 'someone', 'host': 'elsewhere', 'pid': 42, 'started_at': now, 'ttl_secs': 1.0,
      'renewed_at': now
  }
  return json.dumps({**body, **fields}).encode()


def _acquire(lease: Lease, timeout: float = 30.0):
  """(what `acquire` returned or raised, seconds taken); fails the test past `timeout`."""
  got, t0 = [], time.monotonic()

  def run():
    try:
      got.append(lease.acquire())
    except Exception as e:  # noqa: BLE001 - the test looks at it
      got.append(e)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(timeout)
  assert got, f'acquire still waiting after {timeout} s'
  return got[0], time.monotonic() - t0


@pytest.mark.parametrize(
    'body, why', [
        (_lease(started_at=1e20), 'started_at'),
        (_lease(started_at=float('nan')), 'started_at'),
        (_lease(renewed_at=float('nan')), 'renewed_at'),
        (_lease(renewed_at=1e20), 'renewed_at'),
        (_lease(ttl_secs=1e9, renewed_at=time.time() - 6e8), 'ttl_secs'),
        (_lease(host='h' * (100 << 10)), 'larger than'),
    ],
    ids=['started 1e20', 'started NaN', 'renewed NaN', 'renewed 1e20', 'ttl 1e9', 'too large'])
def test_a_damaged_lease_is_taken_over_once_unchanged_for_a_ttl(s3_server, body, why):
  url = s3_server.bucket()
  Store(url).write('LEASE', body)
  lease = Lease(Store(url), ttl_secs=1.0)
  got, seconds = _acquire(lease)
  assert isinstance(got, dict) and why in got.get('damaged', ''), got
  assert seconds >= 1.0  # it waited to see no one renews it
  assert json.loads(Store(url).read('LEASE'))['id'] == lease.me['id']
  lease.release()


def test_a_damaged_lease_someone_keeps_rewriting_is_refused(s3_server):
  url = s3_server.bucket()
  store, stop = Store(url), threading.Event()

  def rewrite():
    while not stop.is_set():
      store.write('LEASE', _lease(renewed_at=float('nan')))
      stop.wait(0.2)

  writer = threading.Thread(target=rewrite, daemon=True)
  store.write('LEASE', _lease(renewed_at=float('nan')))
  writer.start()
  try:
    got, _ = _acquire(Lease(Store(url), ttl_secs=1.0))
  finally:
    stop.set()
    writer.join(10)
  assert isinstance(got, LeaseError) and got.code == 'E-STORE-006', got
  assert 'is damaged (renewed_at' in got.what and 'rewritten' in got.what, got.line()
  assert json.loads(store.read('LEASE'))['id'] == 'someone'  # never written over


# ------------------------------------------------------------------- a process that says nothing
@contextlib.contextmanager
def _two_clients():
  """Two connected clients of a real coordination service (`jax.distributed`'s own)."""
  from jax._src.lib import _jax
  address = f'127.0.0.1:{free_port()}'
  service = _jax.get_distributed_runtime_service(
      address, 2, heartbeat_timeout=30, shutdown_timeout=5)
  clients = [
      _jax.get_distributed_runtime_client(address, k, init_timeout=30, heartbeat_timeout=30)
      for k in range(2)
  ]
  threads = [threading.Thread(target=c.connect) for c in clients]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  try:
    yield clients
  finally:
    stopping = [threading.Thread(target=c.shutdown) for c in clients]  # each waits for the other
    for t in stopping:
      t.start()
    for t in stopping:
      t.join(60)
    service.shutdown()


def _waiting(leader, lines, ended, closing, **bounds):

  def wait():
    try:
      leader.wait(5, closing.is_set, lambda: False, lines.append, every=0.05, **bounds)
      ended.append('returned')
    except Superseded:
      ended.append('superseded')

  waiter = threading.Thread(target=wait, daemon=True)
  waiter.start()
  return waiter


def test_process_0_names_a_process_that_began_no_upload_of_its_part():
  with _two_clients() as clients:
    leader, other = Parts(0, 2, client=clients[0]), Parts(1, 2, client=clients[1])
    lines, ended, closing = [], [], threading.Event()
    waiter = _waiting(leader, lines, ended, closing, silence=1.0)
    deadline = time.monotonic() + 20
    while not lines and time.monotonic() < deadline:
      time.sleep(0.05)
    assert len(lines) == 1 and lines[0].startswith('E-DIST-002: process(es) 1 began no upload '
                                                   'of their part of step 5'), lines
    other.started(5)  # uploading its part: waited for, not named again
    time.sleep(1.5)
    assert len(lines) == 1, lines
    other.said(5, 'ok')
    waiter.join(10)
    closing.set()
    assert ended == ['returned'] and len(lines) == 1, (ended, lines)


def test_process_0_gives_up_a_step_whose_upload_stopped_moving(monkeypatch):
  monkeypatch.setattr(parts_lib, 'MOVING_SECS', 0.0)
  with _two_clients() as clients:
    leader, other = Parts(0, 2, client=clients[0]), Parts(1, 2, client=clients[1])
    lines, ended, closing = [], [], threading.Event()
    t0 = time.monotonic()
    waiter = _waiting(leader, lines, ended, closing, silence=60.0, stall=2.0)
    other.started(5)
    while time.monotonic() - t0 < 4.0:  # moving for twice the bound: waited for
      other.moving(5)
      time.sleep(0.1)
    assert ended == [] and lines == [], (ended, lines)
    waiter.join(30)  # then it stops moving: given up within the bound, not waited for forever
    closing.set()
    assert ended == ['superseded'], ended
    assert len(lines) == 1 and lines[0].startswith('E-DIST-002: process(es) 1 moved no upload in '
                                                   '2 s (process 1: last began step 5): step 5 is '
                                                   'not committed remotely'), lines


def test_a_retry_after_a_failure_word_is_watched_again(monkeypatch):
  monkeypatch.setattr(parts_lib, 'MOVING_SECS', 0.0)
  with _two_clients() as clients:
    leader, other = Parts(0, 2, client=clients[0]), Parts(1, 2, client=clients[1])
    lines, ended, closing = [], [], threading.Event()
    other.started(5)
    other.said(5, 'E-STORE-010: the store did not answer')  # its first try failed
    waiter = _waiting(leader, lines, ended, closing, silence=60.0, stall=2.0)
    deadline = time.monotonic() + 20
    while not lines and time.monotonic() < deadline:  # process 0 heard the failure
      time.sleep(0.05)
    other.started(5)  # the retry, which then hangs: given up within the bound all the same
    waiter.join(30)
    closing.set()
    assert ended == ['superseded'], (ended, lines)
    assert lines[0] == 'process 1: E-STORE-010: the store did not answer'
    assert lines[-1].startswith('E-DIST-002: process(es) 1 moved no upload in 2 s'), lines
