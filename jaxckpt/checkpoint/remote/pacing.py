"""How fast this process sends requests to a store: per key, per process, and after a refusal.

Object stores limit request rates per prefix and answer `503 SlowDown` (or 429) past them: S3
about 3,500 writes and 5,500 reads a second per prefix partition; GCS a new bucket about 1,000
object writes a second (doubling every 20 minutes of sustained load) and 5,000 reads. A job of
1000 processes, each with 8 parts in flight, offers several times that at once. So:

- **The job's rate, shared** (`share`, `admit`): the parts' requests of each process go out
  evenly spaced, at most `rate / processes` a second, where `rate` is the store's documented
  limit times `SHARE` (or what `share(per_s=...)` sets for the whole job). One process alone
  never meets it (3,150 writes a second); 1000 processes on S3 send about 3 each, and together
  stay under the limit instead of meeting 503s and backing off. Each process's first slot is at
  a random offset within its spacing, so the processes' requests interleave instead of landing
  in the same instant.
- **A paced key** (`paced`): the lease and each step's commit, written at most once a second per
  key per process (GCS takes about one write a second to one object name).
- **After a refusal** (`Retries`): a 503 or 429 is waited on, 1 s doubling to 30 s, jittered up,
  for 120 s (`store.Store._call`).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import Callable, NamedTuple

PACE_SECS = 1.0  # the shortest time between two writes of one paced key from this process
_paced: dict[str, float] = {}  # names (a key's last part): the shortest time between writes
_last_write: dict[tuple[str, str], float] = {}  # (store URL, key): when its last write ended

# Requests a second per prefix that each store documents: (writes, reads). A mounted path has
# none (`file`: not paced).
LIMITS = {'s3': (3500.0, 5500.0), 'gs': (1000.0, 5000.0)}
SHARE = 0.9  # of a documented limit, for the whole job: the rest is headroom (lease, listings)
WRITES = ('write', 'delete')  # the ops that count against a store's write rate


class Retries(NamedTuple):
  """How `Store` retries a request (see the module doc); every wait is jittered upwards."""
  slow_first: float = 1.0  # the first wait after a 503 or 429
  slow_max: float = 30.0  # the longest one
  slow_secs: float = 120.0  # how long one request is retried while the store asks to slow down
  transient: int = 3  # retries of a lost connection or another 5xx: 0.2 s doubling to 2 s


def paced(name: str, secs: float = PACE_SECS) -> str:
  """Marks `name` (a key's last part) as written at most once per `secs` per key."""
  _paced[name] = secs
  return name


def is_paced(key: str) -> bool:
  return key.rsplit('/', 1)[-1] in _paced


@contextlib.contextmanager
def pacing(url: str, key: str | None):
  """A write of `key`: if its name is paced, not sent until its pace after the last one ended."""
  secs = 0.0 if key is None else _paced.get(key.rsplit('/', 1)[-1], 0.0)
  if secs > 0:  # one thread writes a paced key at a time (the lease's, the uploader's)
    time.sleep(max(0.0, _last_write.get((url, key), -secs) + secs - time.monotonic()))
  try:
    yield
  finally:
    if secs > 0:
      _last_write[(url, key)] = time.monotonic()  # from its end: when the store had it


class Rate:
  """At most `per_s` requests a second, evenly spaced: each `take()` gets the next free slot,
  `1 / per_s` after the one before it, and waits for it. Thread-safe. The first slot is at a
  random offset within one spacing (processes that start together interleave)."""

  def __init__(self,
               per_s: float,
               *,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep,
               phase: float | None = None):
    if not per_s > 0:
      raise ValueError(f'a request rate must be positive, not {per_s}')
    self.per_s, self.spacing = per_s, 1.0 / per_s
    self._clock, self._sleep = clock, sleep
    self._phase = random.uniform(0.0, self.spacing) if phase is None else phase
    self._next = None
    self._lock = threading.Lock()
    self.waited = 0.0  # seconds spent waiting for slots, in all

  def take(self) -> float:
    """Waits for this request's slot; returns how long it waited."""
    with self._lock:
      now = self._clock()
      slot = now + self._phase if self._next is None else max(now, self._next)
      self._next = slot + self.spacing
      wait = max(0.0, slot - now)
      self.waited += wait
    if wait > 0:
      self._sleep(wait)
    return wait


class _Job:
  """The process's share of each store's rate (`share`), and its `Rate`s."""

  def __init__(self):
    self.processes, self.per_s = 1, 'auto'
    self.rates: dict[tuple[str, str, str], Rate | None] = {}
    self.lock = threading.Lock()


_job = _Job()


def parse_rate(value) -> float | str:
  """A job request rate as given (a flag, a config field): 'auto', 'off', or a positive number
  of requests a second; ValueError otherwise."""
  if isinstance(value, str) and value.strip().lower() in ('auto', 'off'):
    return value.strip().lower()
  try:
    per_s = float(value)
  except (TypeError, ValueError):
    per_s = float('nan')
  if not 0 < per_s < float('inf'):
    raise ValueError(f'{value!r} is not auto, off or a positive number of requests a second')
  return per_s


def share(processes: int | None = None, per_s: float | str | None = None) -> None:
  """Sets this process's share of the job's request rate to every store: `processes` (the job's
  process count; each takes an even share) and `per_s`, the whole job's requests a second of
  each kind (writes, reads): 'auto' (the store's documented limits times `SHARE`), a number, or
  'off' (not paced: a store known to take more, such as an S3 prefix already split). Either left
  None stays as it was. Every process of a job makes the same call."""
  if processes is not None and processes < 1:
    raise ValueError(f'a job has at least one process, not {processes}')
  per_s = None if per_s is None else parse_rate(per_s)
  with _job.lock:
    now = (_job.processes if processes is None else int(processes),
           _job.per_s if per_s is None else per_s)
    if now != (_job.processes, _job.per_s):  # unchanged: the `Rate`s keep their slots
      _job.processes, _job.per_s = now
      _job.rates.clear()


def rate_of(scheme: str, op: str) -> float | None:
  """This process's requests a second for `op` on a store, or None when not paced. A delete
  is process 0's alone (retention, debris: nobody else deletes), so it goes at the job's whole
  write rate, on a `Rate` of its own."""
  if _job.per_s == 'off' or scheme not in LIMITS:
    return None
  job = LIMITS[scheme][0 if op in WRITES else 1] * SHARE if _job.per_s == 'auto' else _job.per_s
  return job if op == 'delete' else job / _job.processes


def admit(scheme: str, bucket: str, op: str) -> float:
  """Waits for this process's next slot for `op` on the store `scheme://bucket` (one `Rate` per
  store and kind, shared by every `Store` of it in the process); returns the wait."""
  key = (scheme, bucket, 'delete' if op == 'delete' else 'write' if op in WRITES else 'read')
  with _job.lock:
    if key not in _job.rates:
      per_s = rate_of(scheme, op)
      _job.rates[key] = None if per_s is None else Rate(per_s)
    rate = _job.rates[key]
  return 0.0 if rate is None else rate.take()
