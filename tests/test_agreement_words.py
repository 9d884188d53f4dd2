"""The save and stop votes across processes (`jaxckpt.hosts.agreement`) read each other's words
from the key-value store: a vote or an outcome that is not one a process writes stops the run
with one E-DIST-005 line naming it, at once, never a dead vote thread and an unnamed timeout."""

import signal
import threading
import time

import pytest

from jaxckpt.errors import JaxckptError
from jaxckpt.hosts import agreement, distributed


class _Store:
  """The key-value calls the votes make, in memory (the real store is `jax.distributed`'s)."""

  def __init__(self):
    self.values, self.cond = {}, threading.Condition()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.cond:
      self.values[key] = value
      self.cond.notify_all()

  def blocking_key_value_get(self, key, timeout_ms):
    with self.cond:
      if not self.cond.wait_for(lambda: key in self.values, timeout_ms / 1000):
        raise RuntimeError(f'DEADLINE_EXCEEDED: {key}')
      return self.values[key]

  def key_value_delete(self, key):
    with self.cond:
      for k in [k for k in self.values if k.startswith(key)]:
        del self.values[k]


class _Cluster:
  count, timeout_secs = 2, 20.0  # a refusal comes at once, long before this

  def __init__(self, index, store):
    self.index, self.leader, self._store = index, index == 0, store

  def client(self):
    return self._store


class _Watcher:
  stop_signal = None

  def take_save_request(self):
    return False


def _agreement(index, store):
  agree = agreement.Agreement(_Watcher(), 0, cluster=_Cluster(index, store))
  return agree


def _step(agree, step, want=False):
  return agree.save_now(step, 100, lambda: False, lambda: want)


def _voted(agree, store, step=1):
  """`step`'s save asked for a round; returns once this process's vote thread voted in it."""
  _step(agree, step, want=True)
  store.blocking_key_value_get(f'jaxckpt/run/round/0/vote/{agree.cluster.index}', 5000)


def _refusal(index: int, key: str, word: str) -> str:
  """The E-DIST-005 line process `index` stops with once the other process's `word` is at `key`
  of round 0: at once, not after the timeout, and at every later step too."""
  store = _Store()
  agree = _agreement(index, store)
  try:
    _voted(agree, store)
    store.key_value_set(f'jaxckpt/run/round/0/{key}', word)
    t0 = time.monotonic()
    with pytest.raises(JaxckptError, match='E-DIST-005') as e:
      _step(agree, 2)
    assert time.monotonic() - t0 < 10, 'refused at once, not after the timeout'
    with pytest.raises(JaxckptError, match='E-DIST-005'):
      _step(agree, 3)
    return str(e.value)
  finally:
    agree.close()


@pytest.mark.parametrize('vote', [
    '[1]', '"x"', '[1, true]', '[99999999999, false, 0]', '[1, 1, 0]', '[1, false, 99]',
    '[-1, false, 0]', 'not json'
])
def test_process_0_refuses_a_vote_that_is_not_one(vote):
  line = _refusal(0, 'vote/1', vote)  # process 1's vote
  assert f'process 1 voted {vote[:20]!r}'[:-1] in line, line


@pytest.mark.parametrize(
    'outcome',
    ['[99999999999, false, 0]', '[5]', '5', '{"missing": 7}', '[5, false, 99]', '{"x": 1}'])
def test_another_process_refuses_an_outcome_that_is_not_one(outcome):
  line = _refusal(1, 'outcome', outcome)  # process 0's outcome
  assert 'a save or stop vote that is not one: process 0 posted the outcome' in line, line


def test_a_vote_that_is_one_is_agreed():
  store = _Store()
  agree = _agreement(0, store)
  try:
    _voted(agree, store)
    store.key_value_set('jaxckpt/run/round/0/vote/1', '[3, false, 0]')  # process 1 is at step 3
    assert _step(agree, 2) is False
    assert _step(agree, 3) is False
    assert _step(agree, 4) is True  # after max(votes) + 1, on every process
    assert store.values['jaxckpt/run/round/0/outcome'] == '[4, true, 0]'
  finally:
    agree.close()


class _Gone(_Store):

  def blocking_key_value_get(self, key, timeout_ms):
    raise RuntimeError('UNAVAILABLE: failed to connect to the coordination service')


def test_a_wait_for_a_word_says_how_long_it_waited_and_why_it_ended():
  cluster = _Cluster(1, _Gone())
  with pytest.raises(JaxckptError, match='E-DIST-005') as e:
    distributed.wait_word(cluster, 'jaxckpt/run/lock', "the workdir lock (process 0's word)")
  line = str(e.value)
  assert "waited 0.0 s for the workdir lock (process 0's word) (the store failed: UNAVAILABLE" \
      in line, line
  assert f'{cluster.timeout_secs:g} s' not in line  # it did not wait the whole timeout
  t0 = time.monotonic()
  with pytest.raises(JaxckptError, match='no answer in time') as e:
    distributed.wait_word(
        _Cluster(1, _Store()), 'jaxckpt/run/x', 'x (process 0)', deadline=time.monotonic() + 0.3)
  assert time.monotonic() - t0 < 5 and 'raise --barrier_timeout_secs' in str(e.value)


class _Stopped(_Watcher):
  stop_signal = signal.SIGTERM


@pytest.mark.parametrize('stopped', [None, 0, 1])
def test_a_stop_signal_while_starting_stops_every_process_before_a_step(stopped):
  """SIGTERM on one process during the restore or the compile: no process trains a step."""
  store = _Store()
  agrees = [
      agreement.Agreement(
          _Stopped() if k == stopped else _Watcher(), 100, cluster=_Cluster(k, store))
      for k in (0, 1)
  ]
  try:
    threads = [threading.Thread(target=a.stop_at_start) for a in agrees]
    for t in threads:
      t.start()
    for t in threads:
      t.join(30)
    want = None if stopped is None else signal.SIGTERM
    assert [a.stop_signal for a in agrees] == [want, want]
    assert [_step(a, 101) for a in agrees] == [False, False]  # no stop asked again in a round
  finally:
    for a in agrees:
      a.close()
