"""What the watchdog reads from the key-value store is checked: a verdict that is not one process 0
writes stops this process with one line naming it, never a dead watchdog thread (whose silence
process 0 would then report as this process lost)."""


import pytest

from jaxckpt.hosts import watchdog


class _Cluster:
  heartbeat_secs, index, count = 30.0, 1, 2

  def __init__(self, verdict):
    self._client = _Client(verdict)

  def client(self):
    return self._client


class _Client:

  def __init__(self, verdict):
    self.values = {'jaxckpt/run/alive/0': '1', 'jaxckpt/run/verdict': verdict}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.values[key] = value

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError('NOT_FOUND: ' + key)
    return self.values[key]


@pytest.mark.parametrize('verdict', [
    'not json', '[1]', '{"x": 1}', '{"lost": [5], "why": "it failed"}',
    '{"lost": [], "why": "it failed"}', '{"lost": ["0"], "why": "x"}', '{"lost": [1]}',
    '[' * 100_000
])
def test_a_verdict_that_is_not_one_stops_this_process_naming_it(monkeypatch, verdict):
  stopped = []

  def stop_all(self, lost, why, timed=True):
    stopped.append((lost, why, timed))
    self._finished.set()

  monkeypatch.setattr(watchdog.Watchdog, '_stop_all', stop_all)
  dog = watchdog.Watchdog(_Cluster(verdict))
  dog.run()  # on this thread: returns once stopped
  assert len(stopped) == 1, stopped
  lost, why, timed = stopped[0]
  assert lost == [0] and why.startswith('its verdict is not one: ') and not timed
  assert verdict[:20] in why


@pytest.mark.parametrize('verdict, lost', [('{"lost": [1], "why": "it failed"}', [1]),
                                           ('{"lost": [0, 1], "why": "no sign of life"}', [0, 1])])
def test_a_verdict_names_who_was_lost(monkeypatch, verdict, lost):
  stopped = []
  monkeypatch.setattr(
      watchdog.Watchdog,
      '_stop_all',
      lambda self, lost, why, timed=True: stopped.append(lost) or self._finished.set())
  watchdog.Watchdog(_Cluster(verdict)).run()
  assert stopped == [lost]
