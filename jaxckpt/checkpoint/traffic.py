"""Bytes through the `jax.distributed` key-value store, counted at the library's own calls.

A benchmark or a test calls `count_traffic()` in each process before the job's groups open;
`multihost.client()` then hands out a counting proxy, and `Traffic.snapshot()` says what this
process sent (keys and values) and received (values, and a directory's keys) so far.
"""

from __future__ import annotations

import threading


class Traffic:
  """Bytes this process sent to and received from the key-value store (keys and values), by the
  project's own calls, per thread (the watchdog's rounds apart from a save's): what a benchmark
  or a test compares across process counts."""

  def __init__(self):
    self._lock = threading.Lock()
    self._by: dict[str, list[int]] = {}  # thread name: [sent, received, calls]

  def add(self, sent: int, received: int) -> None:
    with self._lock:
      row = self._by.setdefault(threading.current_thread().name, [0, 0, 0])
      row[0] += sent
      row[1] += received
      row[2] += 1

  def snapshot(self, threads=None, *, but=()) -> dict[str, int]:
    """{'sent', 'received', 'calls'} so far, of the threads named `threads` (default all) but
    those named in `but`."""
    with self._lock:
      rows = [r for t, r in self._by.items() if (threads is None or t in threads) and t not in but]
    return dict(zip(('sent', 'received', 'calls'), (sum(c) for c in zip([0, 0, 0], *rows))))


_traffic: Traffic | None = None


def counted(client):
  """`client`, counted once `count_traffic()` was called."""
  return client if client is None or _traffic is None else _Counted(client, _traffic)


def count_traffic() -> Traffic:
  """Count this process's key-value traffic from now on (clients taken before are not)."""
  global _traffic
  _traffic = _traffic or Traffic()
  return _traffic


class _Counted:
  """A `jax.distributed` client that counts the bytes of each call it passes on."""

  def __init__(self, inner, traffic: Traffic):
    self._inner, self._traffic = inner, traffic

  def _count(self, sent: int, received: int) -> None:
    self._traffic.add(sent, received)

  def key_value_set(self, key, value, *args, **kwargs):
    self._count(len(key) + len(value), 0)
    return self._inner.key_value_set(key, value, *args, **kwargs)

  def blocking_key_value_get(self, key, *args, **kwargs):
    return self._get(self._inner.blocking_key_value_get, len, key, *args, **kwargs)

  def key_value_try_get(self, key, *args, **kwargs):
    return self._get(self._inner.key_value_try_get, len, key, *args, **kwargs)

  def key_value_dir_get(self, key, *args, **kwargs):
    return self._get(self._inner.key_value_dir_get,
                     lambda found: sum(len(k) + len(v) for k, v in found), key, *args, **kwargs)

  def _get(self, method, size_of, key, *args, **kwargs):
    """A read through `method`, counted: the key sent, and what came back (nothing on a miss)."""
    try:
      value = method(key, *args, **kwargs)
    except Exception:
      self._count(len(key), 0)
      raise
    self._count(len(key), size_of(value))
    return value

  def wait_at_barrier(self, name, *args, **kwargs):
    self._count(len(name), 0)
    return self._inner.wait_at_barrier(name, *args, **kwargs)

  def key_value_delete(self, key, *args, **kwargs):
    self._count(len(key), 0)
    return self._inner.key_value_delete(key, *args, **kwargs)

  def __getattr__(self, name):  # the rest (increments, live nodes, bytes variants) uncounted
    return getattr(self._inner, name)
