"""The lease that keeps one writer per remote prefix, against real servers on loopback (moto's S3
server, the GCS emulator), with a real HTTP proxy between jaxckpt and the server where a test
needs a store that ignores conditional writes, loses an answer or stops answering.

- A store that ignores conditional writes is refused at start (E-STORE-014), unless
  `--remote_lease=off`, which runs without a lease and says so.
- A holder past its local deadline writes nothing until it has renewed.
- A lost response is not a lost lease: the holder recognises its own lease and adopts it.
- A lease left by a process of this host that is gone is taken over at once.
- `release()` returns in bounded time whatever the store does; so does a stopped trainer.
- A `--remote` path whose parent does not exist (a disk not mounted) is refused.
- Against a GCS emulator, tensorstore says nothing about credentials.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from condition_proxy import ConditionProxy
from conftest import REPO, committed_steps, events_of, wait_for

from jaxckpt.checkpoint.remote import Lease, LeaseError, Store, objects
from jaxckpt.records.runlog import read_status

REFUSED = ('ignores conditional writes, so one writer per prefix cannot be enforced; use a store '
           'that honours them, or pass --remote_lease=off')


@pytest.fixture
def proxy(s3_server):
  """A proxy that passes everything on, in front of moto; `store(url)` opens a store through it."""
  p = ConditionProxy(s3_server.endpoint)
  yield p
  p.stop()


def through(proxy: ConditionProxy, url: str) -> Store:
  saved = os.environ['AWS_ENDPOINT_URL']
  os.environ['AWS_ENDPOINT_URL'] = proxy.endpoint
  try:
    store = Store(url)
    store.list()  # the store is opened now, at the proxy's endpoint
    return store
  finally:
    os.environ['AWS_ENDPOINT_URL'] = saved


# ------------------------------------------------------------------ stores that ignore conditions
def test_the_probe_finds_a_store_that_ignores_conditions(s3_server, gcs_server):
  url = s3_server.bucket()
  assert Store(url).ignored_condition('probe') is None  # moto honours them
  stripping = ConditionProxy(s3_server.endpoint, strip=True)
  try:
    found = through(stripping, url).ignored_condition('probe')
  finally:
    stripping.stop()
  assert found == 'a second create-only write of one object went through'
  assert Store(url).list() == []  # the probe object is gone
  # The GCS emulator ignores ifGenerationMatch on the upload path tensorstore uses.
  assert Store(gcs_server.bucket()).ignored_condition('probe') is not None


def test_a_store_that_ignores_conditions_is_refused_unless_the_lease_is_off(
    trainer, s3_server, gcs_server, tmp_path):
  url = s3_server.bucket()
  stripping = ConditionProxy(s3_server.endpoint, strip=True)
  try:
    env = {'AWS_ENDPOINT_URL': stripping.endpoint}
    r = trainer.train(tmp_path / 'a', '--config.train.steps=5', f'--remote={url}', env=env)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f'jaxckpt: E-STORE-014: {url} {REFUSED}'), line
    assert 'Traceback' not in r.stderr
    assert not committed_steps(tmp_path / 'a')
    assert Store(url).list() == []  # nothing left behind, no lease taken

    gs = gcs_server.bucket()
    r = trainer.train(tmp_path / 'g', '--config.train.steps=5', f'--remote={gs}')
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(f'jaxckpt: E-STORE-014: {gs} {REFUSED}')

    before = len(stripping.requests)
    off = tmp_path / 'off'
    r = trainer.train(
        off,
        '--config.train.steps=10',
        '--checkpoint_every=5',
        f'--remote={url}',
        '--remote_lease=off',
        env=env)
    assert r.returncode == 0, r.stderr
    assert '--remote_lease=off: nothing stops another trainer' in r.stderr
    assert f'step 10 is durable in {url}/checkpoints/step_00000010' in r.stderr
    assert max(objects.committed(Store(url))) == 10
    assert read_status(off)['lease'] == 'off'
    assert [e['lease'] for e in events_of(off, 'remote')] == ['off']
    assert not [q for q in stripping.requests[before:] if q[1].endswith('/LEASE')]
  finally:
    stripping.stop()


# ------------------------------------------------------------------------- the local deadline
def test_past_its_deadline_a_holder_writes_nothing_until_it_renews(s3_server, proxy):
  url = s3_server.bucket()
  lease = Lease(through(proxy, url), ttl_secs=3.0)
  lease.acquire()
  lease.writable('the manifest of step 10')  # just renewed: writable
  proxy.hang.set()  # the store stops answering: the renewal cannot go through
  wait_for(lambda: time.monotonic() >= lease.deadline, timeout=30)
  with pytest.raises(
      LeaseError,
      match='E-STORE-007: the manifest of step 40 not written: the '
      f'lease on {url} was last renewed') as e:
    lease.writable('the manifest of step 40')
  assert not e.value.lost  # not lost to anyone: it may come back
  with pytest.raises(LeaseError, match='E-STORE-007: the manifest of step 40'):
    lease.renewed('the manifest of step 40')
  proxy.hang.clear()
  lease.renewed('the manifest of step 40')  # renewed: writable again
  assert time.monotonic() < lease.deadline
  assert json.loads(Store(url).read('LEASE'))['id'] == lease.me['id']
  lease.release()
  assert Store(url).read('LEASE') is None


def test_a_taken_over_holder_is_told_it_lost_the_lease(s3_server):
  url = s3_server.bucket()
  first = Lease(Store(url), ttl_secs=1.0)
  first.acquire()
  generation = first.generation
  wait_for(lambda: time.monotonic() >= first.deadline + first.margin + 0.2, timeout=30)
  second = Lease(Store(url), ttl_secs=1.0)
  assert second.acquire()['id'] == first.me['id']
  with pytest.raises(
      LeaseError,
      match='E-STORE-007: the manifest of step 5 not written: lost the '
      f'lease on {url} to ') as e:
    first.renewed('the manifest of step 5')
  assert e.value.lost and first.generation == generation
  second.release()


# --------------------------------------------------------------------------- lost responses
def test_a_lost_response_is_not_a_lost_lease(s3_server, proxy):
  url = s3_server.bucket()
  store = through(proxy, url)
  lease = Lease(store, ttl_secs=30.0)
  proxy.drop('PUT', '/LEASE')  # the create lands; its answer does not come back
  assert lease.acquire() is None  # not E-STORE-006 naming itself
  assert lease.generation == Store(url).read_generation('LEASE')[1]
  proxy.drop('PUT', '/LEASE')  # a renewal lands; its answer does not come back
  lease.renew()  # not E-STORE-007
  assert not lease.lost
  assert lease.generation == Store(url).read_generation('LEASE')[1]
  lease.writable('the manifest of step 10')
  lease.release()
  assert Store(url).read('LEASE') is None


# --------------------------------------------------------------- a restart on the same host
def _lease_of(pid: int) -> bytes:
  """A fresh lease body naming process `pid` of this host, this boot and pid namespace."""
  from jaxckpt.checkpoint.remote.lease import _boot_id, _pid_ns
  return json.dumps({
      'id': 'x' * 32, 'host': socket.gethostname(), 'pid': pid, 'pid_start': 1, 'pid_ns': _pid_ns(),
      'boot_id': _boot_id(), 'started_at': time.time(), 'ttl_secs': 600.0,
      'renewed_at': time.time()
  }).encode()


def test_a_lease_of_a_process_of_this_host_that_is_gone_is_taken_over_at_once(s3_server):
  url = s3_server.bucket()
  gone = subprocess.Popen([sys.executable, '-c', ''])
  gone.wait()
  Store(url).write('LEASE', _lease_of(gone.pid))
  lease = Lease(Store(url), ttl_secs=600.0)
  assert lease.acquire()['pid'] == gone.pid  # fresh (600 s TTL), yet taken over now
  lease.release()

  alive = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  try:
    body = json.loads(_lease_of(alive.pid))
    with open(f'/proc/{alive.pid}/stat') as f:
      body['pid_start'] = int(f.read().rsplit(')', 1)[1].split()[19])
    Store(url).write('LEASE', json.dumps(body).encode())
    with pytest.raises(LeaseError, match=f'E-STORE-006: .* pid {alive.pid} '):
      Lease(Store(url), ttl_secs=600.0).acquire()
    other_boot = dict(json.loads(_lease_of(gone.pid)), boot_id='another-boot')
    Store(url).write('LEASE', json.dumps(other_boot).encode())
    with pytest.raises(LeaseError, match=f'E-STORE-006: .* pid {gone.pid} '):
      Lease(Store(url), ttl_secs=600.0).acquire()
  finally:
    alive.kill()
    alive.wait()


def test_a_trainer_killed_and_restarted_on_the_same_host_takes_over_at_once(
    trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  first = trainer.start(tmp_path / 'a', '--config.train.steps=100000', '--checkpoint_every=10',
                        f'--remote={url}')  # the default TTL: 60 s
  try:
    wait_for(lambda: objects.committed(store), first)
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  assert json.loads(store.read('LEASE'))['pid'] == first.pid  # fresh, and left behind
  again = trainer.train(tmp_path / 'a', '--config.train.steps=60', '--checkpoint_every=10',
                        f'--remote={url}')
  assert again.returncode == 0, again.stderr
  assert f'names pid {first.pid} of this host, which is no longer running' in again.stderr
  assert [e['previous']['pid'] for e in events_of(tmp_path / 'a', 'lease_taken_over')
         ] == [first.pid]
  assert store.read('LEASE') is None  # released at the end


# ------------------------------------------------------------------------------ bounded exits
def test_release_returns_whatever_the_store_does(s3_server, proxy):
  url = s3_server.bucket()
  lease = Lease(through(proxy, url), ttl_secs=60.0)
  lease.acquire()
  proxy.hang.set()
  renewing = threading.Thread(target=lease.renew, daemon=True)
  renewing.start()  # a renewal stuck in a request to a store that does not answer
  wait_for(lambda: lease._renewing.locked(), timeout=30)
  t0 = time.monotonic()
  lease.release()  # gives the store 5 s
  assert time.monotonic() - t0 < 9.0  # not the store's timeouts (30 s a request, retried)


def test_a_stopped_trainer_exits_within_its_grace_whatever_the_store_does(
    trainer, s3_server, proxy, tmp_path):
  url = s3_server.bucket()
  workdir = tmp_path / 'run'
  proc = trainer.start(
      workdir,
      '--config.train.steps=100000',
      '--checkpoint_every=10',
      f'--remote={url}',
      '--remote_lease_secs=3',
      '--stop_grace_secs=2',
      env={'AWS_ENDPOINT_URL': proxy.endpoint})
  wait_for(lambda: events_of(workdir, 'uploaded'), proc)
  proxy.hang.set()  # every request from now on is held, unanswered
  proc.send_signal(signal.SIGTERM)
  t0 = time.monotonic()
  out, _ = proc.communicate(timeout=120)
  took = time.monotonic() - t0
  assert proc.returncode == 128 + signal.SIGTERM, out
  assert 'is committed locally only' in out
  assert took < 2 + 20, f'{took:.0f} s to exit after SIGTERM with --stop_grace_secs=2'


# ---------------------------------------------------------------------- a disk not mounted
def test_a_remote_path_whose_parent_does_not_exist_is_refused(trainer, tmp_path):
  remote = tmp_path / 'mnt' / 'persistent' / 'run'
  r = trainer.train(tmp_path / 'w', '--config.train.steps=5', f'--remote={remote}')
  assert r.returncode == 2, r.stderr
  line = r.stderr.strip().splitlines()[-1]
  assert line.startswith(f'jaxckpt: E-STORE-002: --remote={remote}: its parent directory does '
                         'not exist'), line
  assert 'Traceback' not in r.stderr
  assert not (tmp_path / 'mnt').exists()  # nothing created in its place
  (tmp_path / 'mnt' / 'persistent').mkdir(parents=True)  # mounted: it works, the path is made
  r = trainer.train(tmp_path / 'w', '--config.train.steps=5', f'--remote={remote}')
  assert r.returncode == 0, r.stderr
  assert (remote / 'checkpoints').is_dir()


# ------------------------------------------------------------------------ the GCS emulator
def test_the_gcs_emulator_gets_no_credentials_noise(gcs_server):
  url = gcs_server.bucket()
  env = {k: v for k, v in os.environ.items() if k != 'GOOGLE_AUTH_TOKEN_FOR_TESTING'}
  r = subprocess.run([sys.executable, '-m', 'jaxckpt.cli', 'inspect', url],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     timeout=120,
                     env=env)
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines() == [
      f'jaxckpt: E-STORE-009: {url} holds no intact checkpoint; check the URL: a run written '
      'with --remote=URL has URL/checkpoints/'
  ]
