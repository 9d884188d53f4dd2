"""One writer per remote prefix, fenced: every upload writes under its own attempt name, only a
conditional commit (`remote.json`) makes it visible, and a writer whose lease is not fresh
writes and deletes nothing. Against moto's S3 server (and a path), with a logging proxy in
front of a frozen trainer to see every request it sends."""

import http.client
import http.server
import json
import shutil
import signal
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import events_of, jaxckpt_cli, wait_for

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.remote import Lease, LeaseError, Store, Uploader, objects


def _checkpoint(root, step: int, seed: int):
  """A committed local checkpoint of `step`; another `seed` is another history's."""
  rng = np.random.default_rng(seed)
  state = {'w': jnp.asarray(rng.standard_normal(200_000, dtype=np.float32)), 'b': jnp.arange(7)}
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    mgr.save(step, state, {'step': step})
  return root / layout.step_dirname(step)


@pytest.fixture(params=['s3', 'path'])
def store(request, tmp_path):
  if request.param == 's3':
    return Store(request.getfixturevalue('s3_server').bucket())
  return Store(str(tmp_path / 'run'))  # tmp_path: the mounted disk


def _manifest_of(step_dir) -> bytes:
  return (step_dir / layout.MANIFEST).read_bytes()


def test_a_replay_replaces_a_step_in_one_swap_that_never_uncommits_it(store, tmp_path):
  first = _checkpoint(tmp_path / 'a', 2, seed=1)
  replay = _checkpoint(tmp_path / 'b', 2, seed=2)
  objects.upload(store, first, {}, part_bytes=256 << 10)
  seen = []

  def before_the_swap():  # every object of the replay is written: the old commit still stands
    seen.append((objects.latest_intact(store)[0], objects.inspect(store, 2)[0]))

  objects.upload(store, replay, {}, may_commit=before_the_swap, part_bytes=256 << 10)
  assert seen == [(2, _manifest_of(first))]
  assert objects.inspect(store, 2)[0] == _manifest_of(replay)
  got, _ = objects.download(store, 2, tmp_path / 'fresh')
  assert (got / 'state').exists() and _manifest_of(got) == _manifest_of(replay)
  # The replaced attempt's objects are gone; one attempt is left beside the commit.
  keys = store.list('checkpoints/step_00000002/')
  assert {k.split('/')[2] for k in keys} == {
      objects.REMOTE_META,
      json.loads(store.read('checkpoints/step_00000002/remote.json'))['attempt']
  }


def test_a_commit_made_meanwhile_by_another_writer_is_never_overwritten(store, tmp_path):
  ours = _checkpoint(tmp_path / 'a', 3, seed=1)
  theirs = _checkpoint(tmp_path / 'b', 3, seed=2)

  def the_other_writer_commits_first():
    objects.upload(store, theirs, {}, part_bytes=256 << 10)

  with pytest.raises(
      LeaseError, match='E-STORE-007: .*remote.json was changed by another '
      'writer'):
    objects.upload(store, ours, {}, may_commit=the_other_writer_commits_first)
  assert objects.inspect(store, 3)[0] == _manifest_of(theirs)
  assert objects.latest_intact(store) == (3, [])


def test_a_checkpoint_from_before_attempts_is_read_and_replaced(store, tmp_path):
  """The layout without attempts: files beside remote.json, manifest.json the commit."""
  old = _checkpoint(tmp_path / 'a', 4, seed=1)
  prefix = objects.step_prefix(4)
  meta = {'format': 'jaxckpt.remote', 'part_bytes': 1 << 30, 'records': {}}
  store.write_many({
      **{
          prefix + str(p.relative_to(old)): p.read_bytes()
          for p in old.rglob('*')
          if p.is_file() and p.name != layout.MANIFEST
      }, prefix + objects.REMOTE_META: json.dumps(meta).encode()
  })
  store.write(prefix + layout.MANIFEST, _manifest_of(old))  # last, as it was
  assert objects.latest_intact(store) == (4, [])
  got, _ = objects.download(store, 4, tmp_path / 'fresh')
  assert _manifest_of(got) == _manifest_of(old)

  replay = _checkpoint(tmp_path / 'b', 4, seed=2)
  objects.upload(store, replay, {})
  assert objects.inspect(store, 4)[0] == _manifest_of(replay)
  left = store.list(prefix)
  assert prefix + layout.MANIFEST not in left and prefix + 'run_state.json' not in left


def test_a_writer_past_its_lease_deadline_writes_and_deletes_nothing(s3_server, tmp_path):
  url = s3_server.bucket()
  stale = Lease(Store(url), ttl_secs=2.0)
  stale.acquire()  # and never renewed: a holder frozen or cut off
  wait_for(lambda: time.time() - json.loads(Store(url).read('LEASE'))['renewed_at'] > 2.2)
  taker = Lease(Store(url), ttl_secs=2.0)
  assert taker.acquire()['id'] == stale.me['id']
  from jaxckpt.checkpoint import RetentionPolicy
  fresh = Uploader(Store(url), lease=taker)
  try:
    fresh.submit(1, _checkpoint(tmp_path / 'a', 1, seed=1))
    assert fresh.wait(1, timeout=60)
  finally:
    fresh.close()
  store = Store(url)
  before = {k: store.read(k) for k in store.list()}

  events = []
  uploader = Uploader(
      Store(url),
      lease=stale,
      retention=RetentionPolicy(keep=1),  # would delete step 1 once step 5 is up
      on_event=lambda name, **f: events.append((name, f)))
  try:
    uploader.submit(5, _checkpoint(tmp_path / 'b', 5, seed=2))
    wait_for(lambda: any(name == 'lease_lost' for name, _ in events), timeout=60)
  finally:
    uploader.close()
  assert {k: store.read(k) for k in store.list()} == before  # nothing written, nothing deleted
  assert 'E-STORE-007' in dict(events)['lease_lost']['error']
  assert not uploader.durable(5)
  taker.release()


# ------------------------------------------------- a frozen trainer, and the one that takes over
class LoggingProxy:
  """An HTTP proxy on loopback in front of `upstream` that records every request it forwards:
  (monotonic time it was sent on, method, path, status)."""

  def __init__(self, upstream_port: int):
    self.log: list[tuple[float, str, str, int]] = []
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = 'HTTP/1.1'

      def log_message(self, *args):  # quiet
        pass

      def _forward(self):
        n = int(self.headers.get('Content-Length') or 0)
        body = self.rfile.read(n) if n else None
        conn = http.client.HTTPConnection('127.0.0.1', upstream_port, timeout=60)
        conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
          if name.lower() not in ('expect', 'connection'):
            conn.putheader(name, value)
        conn.endheaders(body)
        sent = time.monotonic()
        response = conn.getresponse()
        data = response.read()
        conn.close()
        proxy.log.append((sent, self.command, self.path, response.status))
        self.send_response(response.status)
        for name, value in response.getheaders():
          if name.lower() not in ('transfer-encoding', 'connection', 'content-length'):
            self.send_header(name, value)
        length = response.getheader('Content-Length') if self.command == 'HEAD' else len(data)
        self.send_header('Content-Length', str(length or 0))
        self.end_headers()
        if self.command != 'HEAD':
          self.wfile.write(data)

      do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    self.endpoint = f'http://127.0.0.1:{self._server.server_address[1]}'
    threading.Thread(target=self._server.serve_forever, daemon=True).start()

  def close(self):
    self._server.shutdown()
    self._server.server_close()


def _uploaded(workdir) -> list[int]:
  if not (workdir / 'events.jsonl').exists():
    return []
  return [e['step'] for e in events_of(workdir, 'uploaded')]


def test_a_frozen_holder_writes_and_deletes_nothing_once_another_took_over(
    trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  proxy = LoggingProxy(s3_server.port)
  flags = ('--config.train.steps=100000', '--checkpoint_every=5', '--keep=2', f'--remote={url}',
           '--remote_lease_secs=3', '--stop_grace_secs=5')
  a_dir, b_dir = tmp_path / 'a', tmp_path / 'b'
  a = trainer.start(a_dir, *flags, env={'AWS_ENDPOINT_URL': proxy.endpoint})
  b = None
  try:
    wait_for(lambda: any(s >= 10 for s in _uploaded(a_dir)), a)
    a.send_signal(signal.SIGSTOP)  # frozen: its lease goes stale, its requests wait
    holder = json.loads(store.read('LEASE'))
    wait_for(lambda: time.time() - holder['renewed_at'] > 3.5)
    b = trainer.start(b_dir, *flags)
    wait_for(lambda: json.loads(store.read('LEASE') or b'{}').get('id') not in (None, holder['id']),
             b)
    taken_over = time.monotonic()  # B holds the lease from at least here
    wait_for(lambda: any(s > 0 for s in _uploaded(b_dir)), b)  # and has committed
    a.send_signal(signal.SIGCONT)
    wait_for(lambda: events_of(a_dir, 'lease_lost'), a, timeout=120)
    seen = len(_uploaded(b_dir))
    wait_for(lambda: len(_uploaded(b_dir)) > seen + 1, b)  # B goes on committing
  finally:
    a.send_signal(signal.SIGCONT)
    for p in (a, b):
      if p is not None:
        p.send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=120)[0] if p is not None else '' for p in (a, b)]
    proxy.close()
  assert a.returncode == 128 + signal.SIGTERM, outs[0][-3000:]
  assert 'E-STORE-007' in events_of(a_dir, 'lease_lost')[0]['error']

  # Every request A sent after B took over: reads, a refused renewal of the lease, or an
  # object of its own attempt in flight when it froze (which nothing reads). Never a commit,
  # never a delete, never an object of B's.
  attempts = {p.split('/a-', 1)[1].split('/', 1)[0] for _, _, p, _ in proxy.log if '/a-' in p}
  assert len(attempts) <= 1, attempts  # one name for all it sent
  own = f'/a-{attempts.pop()}/' if attempts else None
  writes = [(m, p.split('?')[0], s)
            for t, m, p, s in proxy.log
            if t > taken_over and m not in ('GET', 'HEAD')]
  allowed = [
      (m, p, s)
      for m, p, s in writes
      if m == 'PUT' and (p.endswith('/LEASE') and s >= 400
                         or own is not None and own in p and not p.endswith(objects.REMOTE_META))
  ]
  assert writes == allowed, [w for w in writes if w not in allowed]

  verify = jaxckpt_cli('verify', url)  # what B committed is whole
  assert verify.returncode == 0, verify.stdout + verify.stderr
  assert verify.stdout.count('OK ') >= 2
  shutil.rmtree(a_dir, ignore_errors=True)


def test_remote_retention_deletes_abandoned_attempts(s3_server, tmp_path):
  from jaxckpt.checkpoint import RetentionPolicy
  store = Store(s3_server.bucket())
  objects.upload(store, _checkpoint(tmp_path / 'a', 1, seed=1), {})
  # A stale writer's objects: beside step 1's commit, and a step it never committed.
  debris = [
      'checkpoints/step_00000001/a-00000000deadbeef/state/process_0.safetensors',
      'checkpoints/step_00000002/a-00000000deadbeef/run_state.json'
  ]
  store.write_many({k: b'stale' for k in debris})
  kept = sorted(k for k in store.list('checkpoints/') if k not in debris)
  uploader = Uploader(store, retention=RetentionPolicy(keep=0))  # every step kept
  try:
    uploader.submit(3, _checkpoint(tmp_path / 'b', 3, seed=2))
    assert uploader.wait(3, timeout=60)
  finally:
    uploader.close()
  left = store.list('checkpoints/')
  assert not set(debris) & set(left)
  assert [k for k in left if k.startswith('checkpoints/step_00000001/')] == kept
  assert objects.latest_intact(store) == (3, []) and sorted(objects.committed(store)) == [1, 3]
