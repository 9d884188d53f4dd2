"""Request rates a store accepts, against moto's S3 server behind a proxy that answers
`503 SlowDown` with `Retry-After: 1` (tests/condition_proxy.py): the store waits and resends,
an upload through it lands byte for byte, a store that never stops asking fails with one line
naming the object, a paced key (a commit, the lease) is written at most once a second, and an
upload paced to its process's share of the job's rate meets no 503 where one sent unpaced does."""

import itertools
import os
import threading
import time
import urllib.parse
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
import pytest
from condition_proxy import ConditionProxy

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.remote import Store, StoreError, objects, pacing
from jaxckpt.checkpoint.remote.store import PACE_SECS, Retries


@pytest.fixture
def proxy(s3_server):
  p = ConditionProxy(s3_server.endpoint)
  yield p
  p.stop()


def through(proxy: ConditionProxy, url: str, **kw) -> Store:
  saved = os.environ['AWS_ENDPOINT_URL']
  os.environ['AWS_ENDPOINT_URL'] = proxy.endpoint
  try:
    store = Store(url, **kw)
    store.list()  # opened now, at the proxy's endpoint
    return store
  finally:
    os.environ['AWS_ENDPOINT_URL'] = saved


def every_third_put():
  count, lock = itertools.count(1), threading.Lock()

  def slow_down(method: str, path: str) -> bool:
    if method != 'PUT' or urllib.parse.urlsplit(path).path.count('/') < 2:  # not the bucket
      return False
    with lock:
      return next(count) % 3 == 0

  return slow_down


def by_object(requests, method='PUT'):
  out = defaultdict(list)
  for r in sorted(requests, key=lambda r: r.began):
    if r.method == method:
      out[r.path].append(r)
  return out


@pytest.fixture(scope='module')
def step_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp('local') / 'checkpoints'
  w = np.random.default_rng(0).standard_normal(300_000, dtype=np.float32)
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    mgr.save(1, {'w': jnp.asarray(w), 'b': jnp.arange(7)}, {'step': 1})
  return root / layout.step_dirname(1)


def test_an_upload_through_503s_lands_and_waits_as_asked(s3_server, proxy, step_dir, tmp_path):
  url = s3_server.bucket()
  proxy.slow_down = every_third_put()
  objects.upload(
      through(proxy, url), step_dir, {'loss.jsonl': b'{"step":1}\n'}, part_bytes=256 << 10)
  # What moto holds, read without the proxy: the checkpoint, byte for byte.
  got, records = objects.download(Store(url), 1, tmp_path / 'fresh')
  assert records == {'loss.jsonl': b'{"step":1}\n'}
  files = [p for p in step_dir.rglob('*') if p.is_file()]
  assert files
  for path in files:
    assert (got / path.relative_to(step_dir)).read_bytes() == path.read_bytes(), path
  # At the proxy: 503s were answered, and every object answered one was sent again no sooner
  # than its Retry-After said.
  puts = by_object(proxy.requests)
  slowed = {k: v for k, v in puts.items() if any(r.status == 503 for r in v)}
  assert len(slowed) >= 2, puts
  for key, tries in slowed.items():
    assert tries[-1].status == 200, (key, tries)
    for answered, again in zip(tries, tries[1:]):
      if answered.status == 503:
        assert again.began - answered.began >= proxy.retry_after, (key, tries)


def test_a_store_that_always_says_slow_down_fails_naming_the_object(s3_server, proxy):
  url = s3_server.bucket()
  proxy.slow_down = lambda method, path: method == 'PUT' and path.endswith('/obj')
  store = through(proxy, url, retries=Retries(slow_secs=4.0))
  with pytest.raises(StoreError) as e:
    store.write('obj', b'never')
  line = e.value.line()
  assert e.value.code == 'E-STORE-015' and e.value.kind == 'slow_down'
  assert f'{url}/obj' in line and 'HTTP 503' in line and '\n' not in line, line
  tries = [r for r in proxy.requests if r.method == 'PUT' and r.path.endswith('/obj')]
  assert len(tries) >= 2 and all(r.status == 503 for r in tries)
  assert f'to {len(tries)} tries' in line, line
  assert tries[-1].began - tries[0].began <= 4.0  # within the bound it was given
  assert Store(url).read('obj') is None  # nothing was written


def test_a_paced_key_is_written_at_most_once_a_second(s3_server, proxy):
  url = s3_server.bucket()
  store = through(proxy, url)
  key = objects.step_prefix(7) + objects.REMOTE_META
  for i in range(3):
    store.write(key, b'%d' % i)
  store.write('checkpoints/other', b'0')  # not paced: not held back by the paced key
  store.write('checkpoints/other', b'1')
  sent = [r.began for r in proxy.requests if r.method == 'PUT' and r.path.endswith(key)]
  assert len(sent) == 3
  assert all(b - a >= PACE_SECS * 0.999 for a, b in zip(sent, sent[1:])), sent
  assert Store(url).read(key) == b'2'


# ------------------------------------------------------------------ the job's rate, shared
class FakeClock:
  """A clock that moves only when something sleeps on it."""

  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now

  def sleep(self, secs: float) -> None:
    self.now += secs


def test_a_rate_spaces_requests_evenly_from_a_random_phase():
  clock = FakeClock()
  rate = pacing.Rate(4.0, clock=clock, sleep=clock.sleep, phase=0.1)
  sent = []
  for _ in range(9):
    rate.take()
    sent.append(clock.now)
  assert sent[0] == pytest.approx(100.1)  # the first slot waits out its phase
  assert all(b - a == pytest.approx(0.25) for a, b in zip(sent, sent[1:])), sent
  assert rate.waited == pytest.approx(0.1 + 8 * 0.25)
  clock.now += 10  # idle: the next request goes at once, not in a burst of the missed slots
  assert rate.take() == 0.0 and rate.take() == pytest.approx(0.25)
  for per_s in (0.5, 3.15):  # at most ceil(per_s) in any second, whatever the phase
    clock, rng = FakeClock(), np.random.default_rng(1)
    rate = pacing.Rate(per_s, clock=clock, sleep=clock.sleep, phase=rng.uniform(0, 1 / per_s))
    times = []
    for _ in range(50):
      rate.take()
      times.append(clock.now)
    assert max(sum(t <= s < t + 1 for s in times) for t in times) == np.ceil(per_s)


@pytest.fixture
def job_rate():
  return pacing.share  # conftest's `_one_process_job` sets it back after each test


def test_each_process_takes_an_even_share_of_the_stores_limits(job_rate):
  job_rate(processes=1000, per_s='auto')
  assert pacing.rate_of('s3', 'write') == pytest.approx(3.15)
  assert pacing.rate_of('s3', 'read') == pytest.approx(4.95)
  assert pacing.rate_of('gs', 'write') == pytest.approx(0.9)
  assert pacing.rate_of('gs', 'delete') == pytest.approx(900)  # process 0's alone: the job's
  assert pacing.rate_of('file', 'write') is None  # a mounted path: no request limit
  job_rate(per_s=400)  # the job's requests a second, of each kind
  assert pacing.rate_of('s3', 'write') == pytest.approx(0.4)
  assert pacing.rate_of('gs', 'read') == pytest.approx(0.4)
  job_rate(per_s='off')
  assert pacing.rate_of('s3', 'write') is None
  for bad in (0, -1, 'fast', float('inf'), None):
    with pytest.raises(ValueError):
      pacing.parse_rate(bad)


def past_a_rate(limit: int, window: float = 1.0):
  """A store's request limit: a PUT of an object is answered 503 once `limit` PUTs reached the
  store in the `window` seconds before it (each one counted, refused or not)."""
  sent, lock = [], threading.Lock()

  def slow_down(method: str, path: str) -> bool:
    if method != 'PUT' or urllib.parse.urlsplit(path).path.count('/') < 2:  # not the bucket
      return False
    with lock:
      now = time.monotonic()
      recent = [t for t in sent if t > now - window]
      sent.append(now)
      return len(recent) >= limit

  return slow_down


@pytest.mark.parametrize('per_s', ['off', 2.0])
def test_an_upload_paced_to_its_share_meets_no_503(s3_server, proxy, step_dir, tmp_path, job_rate,
                                                   per_s):
  """A store that takes 4 PUTs a second: the upload sent as fast as its parts go is answered
  503s; paced to 2 a second (the job's rate, `--remote_rate`), it meets none."""
  url = s3_server.bucket()
  proxy.slow_down = past_a_rate(4)
  job_rate(processes=1, per_s=per_s)
  objects.upload(
      through(proxy, url), step_dir, {'loss.jsonl': b'{"step":1}\n'}, part_bytes=256 << 10)
  puts = [r for r in proxy.requests if r.method == 'PUT']
  refused = [r for r in puts if r.status == 503]
  assert len(puts) >= 8, puts
  if per_s == 'off':
    assert refused, puts  # the burst of parts in flight meets the limit
  else:
    assert not refused, refused
    # Paced to 2 a second: never more than 3 in any second as the store sees them (their slots
    # are 0.5 s apart; each arrives some moments after its slot, a loaded machine's later).
    parts = sorted(r.began for r in puts if not r.path.endswith(objects.REMOTE_META))
    assert all(b - a >= 1.0 for a, b in zip(parts, parts[3:])), parts
  got, _ = objects.download(Store(url), 1, tmp_path / 'fresh')
  for path in (p for p in step_dir.rglob('*') if p.is_file()):
    assert (got / path.relative_to(step_dir)).read_bytes() == path.read_bytes(), path
