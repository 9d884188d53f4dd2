"""One writer per remote prefix: a lease object created and renewed with conditional writes.

`URL/LEASE` names its holder (an id, host, pid, boot, start time) and when it was last renewed.
It is created only if absent (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`) and renewed only
if it is still the version its holder wrote, so two machines can never both believe they hold
it. This holds only on a store that honours those conditions: the trainer's access probe refuses
one that does not. A lease not renewed for `ttl_secs` is stale (its holder is dead or cut off)
and may be taken over, again with a conditional write.

The holder fences itself with a local deadline: `last renewal + ttl - margin`, the renewal's
time taken on the monotonic clock before its request was sent, so however long the request
took, a taker (who needs `ttl` of silence by its own clock) cannot hold the lease before the
deadline passes here. Past it, `writable()` renews once and raises unless that extends it:
nothing is written or deleted until the lease is renewed. `margin` (`margin_secs`:
max(ttl/4, min(5 s, ttl/3))) covers the clock skew between the machines, the rate drift of the
two clocks over one TTL (parts per million) and one small write landing after its check. A
renewal whose response is lost (the store's retry then meets its own write and gets 412) is
recognised by the lease's `id`, and its generation adopted: a lost response is not a lost lease.

Staleness is judged with the taker's clock against the holder's `renewed_at`: keep the clock
skew between machines well under the margin. A lease naming this host, this boot and pid
namespace and a process that is no longer running is taken over at once (a restart after a
crash), not waited for.

The lease is read from the bucket, so it is checked before it is believed (`_parse`): at most
MAX_LEASE_BYTES, a JSON object whose times are finite numbers of seconds since 1970, none more
than MAX_AHEAD_SECS ahead of this machine's clock, a `ttl_secs` in (0, MAX_TTL_SECS] and a whole
`pid`. One that is not is damaged: no holder of this version writes it, but one might still
renew over it, so it is taken over only once it has stayed unchanged for this taker's TTL (or
the one it names, when that is in range): a live holder renews within a third of that. One
rewritten meanwhile, still damaged, is refused (E-STORE-006), naming what is wrong with it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from ..errors import ArgumentError, CheckpointError
from ..options import finite
from .checks import MAX_LEASE_BYTES, loads, read_small
from .store import PACE_SECS, Store, StoreError, paced

LEASE = paced('LEASE')  # written at most once a second per process (`Lease` may ask less)
MIN_RENEW_SECS = 1.0  # a renewal not forced is skipped within this of the last
MAX_TTL_SECS = 86400.0  # the longest TTL a lease may have (`--remote_lease_secs`): a day
MAX_AHEAD_SECS = 300.0  # a lease's times may be this far ahead of the reader's clock, no more


def margin_secs(ttl: float) -> float:
  """How long before `ttl` runs out the holder stops writing (see the module doc)."""
  return max(ttl / 4, min(5.0, ttl / 3))


class LeaseError(CheckpointError):
  """The lease is held by another live writer, or was lost to one (`lost`), or could not be
  renewed in time (`lost` False: writing may resume once it is)."""

  def __init__(self, code: str, what: str, fix: str = '', *, lost: bool = True):
    super().__init__(code, what, fix)
    self.lost = lost


def describe(holder: dict[str, Any]) -> str:
  """The holder `holder` (a lease `_parse` accepted) in a few words."""
  age = _age(holder)
  try:
    started = time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(holder.get('started_at', 0)))
  except (TypeError, ValueError, OverflowError, OSError):
    started = '?'
  return (f'{holder.get("host", "?")} pid {holder.get("pid", "?")} (started {started}, '
          f'renewed {age:.0f} s ago)')


class Lease:
  """Holds `store`'s lease while the writer lives: `acquire()`, then `start()` renews it on a
  thread every `ttl_secs / 3`; `writable(what)` / `renewed(what)` before each write or delete;
  `release()` gives it back. No lock is held across a store request: each is bounded."""

  def __init__(self,
               store: Store,
               *,
               ttl_secs: float = 60.0,
               on_lost: Callable[[dict[str, Any] | None], None] = lambda holder: None):
    self.store, self.ttl = store, float(ttl_secs)
    if not 0 < self.ttl <= MAX_TTL_SECS:  # another taker would read its lease as damaged
      raise ArgumentError(
          'E-CONFIG-004', f'a lease TTL of {self.ttl:g} s is not within '
          f'(0, {MAX_TTL_SECS:.0f}]', 'set --remote_lease_secs to seconds, e.g. 60')
    self.margin = margin_secs(self.ttl)
    paced(LEASE, min(PACE_SECS, self.margin / 2))  # under 1 s only for TTLs under 4 s (tests)
    self.request_secs = max(self.margin, 2.0)  # the longest a lease request is waited for
    self.me = {
        'id': uuid.uuid4().hex, 'host': socket.gethostname(), 'pid': os.getpid(),
        'pid_start': _pid_start(os.getpid()), 'pid_ns': _pid_ns(), 'boot_id': _boot_id(),
        'started_at': time.time(), 'ttl_secs': self.ttl
    }
    self._generation: bytes | None = None
    self._lost: dict[str, Any] | None = None
    self._on_lost = on_lost
    self._renewed = -float('inf')  # monotonic, before the request of the last renewal that held
    self._sent: dict[float, float] = {}  # renewed_at of the bodies written lately: their monotonic
    self._error: str | None = None  # why the last renewal failed (None: it did not)
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._state = threading.Lock()  # guards the fields above; never held across a request
    self._renewing = threading.Lock()  # one renewal request at a time

  @property
  def generation(self) -> bytes | None:
    """The generation of the lease object this holder last wrote (or adopted)."""
    return self._generation

  @property
  def deadline(self) -> float:
    """Monotonic time past which this holder writes nothing until it has renewed."""
    return self._renewed + self.ttl - self.margin

  def _body(self) -> tuple[bytes, float]:
    t0, now = time.monotonic(), time.time()
    with self._state:
      self._sent = {k: v for k, v in self._sent.items() if t0 - v < 2 * self.ttl}
      self._sent[now] = t0
    return json.dumps({**self.me, 'renewed_at': now}).encode(), t0

  def _held(self, generation: bytes, t0: float) -> None:
    with self._state:
      self._generation, self._error = generation, None
      self._renewed = max(self._renewed, t0)

  def _adopt(self, raw: bytes | None, generation: bytes) -> bool:
    """Whether the lease as read (`raw` at `generation`) is one this holder wrote (a write
    whose response was lost): if so its generation is ours, and its renewal time if known."""
    holder = _parse(raw)
    if raw is None or holder is None or holder.get('id') != self.me['id']:
      return False
    t0 = self._sent.get(float(holder.get('renewed_at', 0)), -float('inf'))
    self._held(generation, t0)
    logging.info('the lease on %s is still ours (a response was lost): adopting its version',
                 self.store.url)
    return True

  def acquire(self) -> dict[str, Any] | None:
    """Takes the lease. Returns the holder it took over from (None if it was free); raises
    `LeaseError` E-STORE-006 naming the holder when a live writer has it.

    A holder that has missed a renewal (silent for over half its TTL: the VM this one replaces,
    most likely) is waited for until its lease is stale, then taken over; one that renews in the
    meantime is alive, and refused. One on this host whose process is gone is taken over now.
    A damaged one (see the module doc) is taken over once unchanged for a TTL, else refused."""
    waited, previous, damaged = False, None, None
    for _ in range(4):  # another taker can win a race between our read and our write
      raw, generation = _read(self.store)
      holder, why = _parse_why(raw)
      if self._adopt(raw, generation):  # our write went through, its answer did not
        return previous
      if why is not None:
        if damaged is None:  # taken over only if no one rewrites it for a TTL
          damaged, wait = generation, self._damaged_wait(raw)
          logging.warning(
              'the lease on %s is damaged (%s): taking it over unless it is rewritten '
              'within %.0f s', self.store.url, why, wait)
          time.sleep(wait)
          continue
        if damaged != generation:
          raise LeaseError(
              'E-STORE-006', f'{self.store.join(LEASE)} is damaged ({why}) and was rewritten '
              'while this trainer waited to take it over: another trainer may hold it',
              'stop any other trainer on this --remote prefix and delete the LEASE object, or '
              'give this run another --remote prefix')
        holder = {'host': '?', 'damaged': why}  # unchanged for a TTL: taken over below
      elif raw is not None and holder is not None and not self._stale(holder):
        ttl, age = float(holder.get('ttl_secs', self.ttl)), _age(holder)
        if self._gone(holder):
          logging.warning(
              'the lease on %s names pid %s of this host, which is no longer running: '
              'taking it over', self.store.url, holder.get('pid'))
        elif age > ttl / 2 and not waited:
          waited = True
          logging.warning(
              'the lease on %s was last renewed %.0f s ago by %s; waiting %.0f s '
              'to take it over', self.store.url, age, holder.get('host'), ttl - age)
          time.sleep(ttl - age + 0.1)
          continue
        else:
          raise LeaseError(
              'E-STORE-006', f'{self.store.url} is in use by another trainer: {describe(holder)}',
              'stop that run, or give this one another --remote prefix (a lease that is not '
              f'renewed for {holder.get("ttl_secs", self.ttl):.0f} s is taken over)')
      previous = holder if raw is not None else None
      body, t0 = self._body()
      new = self.store.replace(LEASE, body, generation, timeout=self.request_secs)
      if new is not None:
        self._held(new, t0)
        return previous
    raise LeaseError('E-STORE-006', f'{self.store.url}: another trainer keeps taking the lease',
                     'run one trainer per --remote prefix')

  def _damaged_wait(self, raw: bytes | None) -> float:
    """How long a damaged lease must stay unchanged before it is taken over: this taker's TTL,
    or the one it names when that is a TTL a holder could have (a live one renews within a
    third of it)."""
    body = loads(raw) if raw != _TOO_LARGE else None
    ttl = body.get('ttl_secs') if isinstance(body, dict) else None
    named = ttl if finite(ttl) is not None and 0 < ttl <= MAX_TTL_SECS else 0.0
    return max(self.ttl, named) + 0.1

  def _stale(self, holder: dict[str, Any]) -> bool:
    return _age(holder) > float(holder.get('ttl_secs', self.ttl))

  def _gone(self, holder: dict[str, Any]) -> bool:
    """Whether `holder` is a process of this machine, since its boot and in this pid namespace,
    that is no longer running (or whose pid now belongs to another process)."""
    me = self.me
    if holder.get('host') != me['host'] or not me['boot_id'] or not me['pid_ns']:
      return False
    if holder.get('boot_id') != me['boot_id'] or holder.get('pid_ns') != me['pid_ns']:
      return False
    pid = holder.get('pid')
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
      return False
    started = _pid_start(pid)
    return started is None or started != holder.get('pid_start')

  def renew(self) -> None:
    """Renews the lease now; raises `LeaseError` if it was lost (see `check`). A renewal that
    fails leaves the deadline where it was (`writable` says when that is past)."""
    self._attempt(force=True)
    self.check()

  def _attempt(self, *, force: bool = False) -> None:
    """One renewal (skipped when one held within MIN_RENEW_SECS, unless `force`): a write
    conditional on our generation; on a mismatch the lease is read, and adopted if ours."""
    if not self._renewing.acquire(timeout=self.request_secs + 1):
      return  # another renewal is stuck in a request: this one fails with it
    try:
      with self._state:
        if self._lost is not None or self._generation is None:
          return
        if not force and time.monotonic() - self._renewed < MIN_RENEW_SECS:
          return
        generation = self._generation
      for _ in range(2):  # the second: at the generation adopted from a lost response
        body, t0 = self._body()
        new = self.store.replace(LEASE, body, generation, timeout=self.request_secs)
        if new is not None:
          self._held(new, t0)
          return
        raw, generation = _read(self.store, timeout=self.request_secs)
        if not self._adopt(raw, generation):
          if self._stop.is_set():
            return  # released meanwhile: the lease was given back, not lost
          with self._state:
            self._lost = _parse(raw) or {}
          self._on_lost(self._lost)
          return
    except StoreError as e:
      first = self._error is None
      with self._state:
        self._error = e.what
      if first:
        logging.warning(
            'could not renew the lease on %s (%s); nothing is written there once it '
            'is %.0f s old', self.store.url, e.what, self.ttl - self.margin)
    finally:
      self._renewing.release()

  def check(self) -> None:
    """Raises `LeaseError` E-STORE-007 once the lease went to another writer."""
    if self._lost is not None:
      raise LeaseError(
          'E-STORE-007', f'lost the lease on {self.store.url} to '
          f'{describe(self._lost) if self._lost else "another trainer"}',
          'this run no longer writes there; the other trainer owns the remote run now')

  def writable(self, what: str) -> None:
    """Returns if this holder may write now; raises `LeaseError` E-STORE-007 naming `what` if the
    lease was lost (`lost`), or if its deadline passed and one renewal did not extend it."""
    if self._lost is None and time.monotonic() >= self.deadline:
      self._attempt()
    if self._lost is not None:
      lost = self._lost
      raise LeaseError(
          'E-STORE-007', f'{what} not written: lost the lease on {self.store.url} to '
          f'{describe(lost) if lost else "another trainer"}',
          'this run no longer writes there; the other trainer owns the remote run now')
    if time.monotonic() >= self.deadline:
      since = time.monotonic() - self._renewed
      raise LeaseError(
          'E-STORE-007', f'{what} not written: the lease on {self.store.url} was last renewed '
          f'{since:.0f} s ago ({self._error or "no renewal held"}), and another trainer may take '
          f'it over after {self.ttl:.0f} s', 'check the store and the network; writing resumes '
          'once the lease is renewed',
          lost=False)

  def renewed(self, what: str) -> None:
    """Renews now (unless a renewal held within the last MIN_RENEW_SECS), then `writable`."""
    self._attempt()
    self.writable(what)

  @property
  def lost(self) -> bool:
    return self._lost is not None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name='jaxckpt-lease', daemon=True)
    self._thread.start()

  def _run(self) -> None:
    wait = self.ttl / 3
    while not self._stop.wait(wait):
      self._attempt(force=True)
      if self._lost is not None:
        return
      # A failed renewal is tried again sooner: the deadline is nearer.
      wait = self.ttl / 3 if self._error is None else max(MIN_RENEW_SECS, self.ttl / 10)

  def release(self, timeout: float = 5.0) -> None:
    """Stops renewing and deletes the lease if this writer still holds it; returns within
    about `timeout` seconds whatever the store does (an undeleted lease goes stale)."""
    end = time.monotonic() + timeout

    def left() -> float:
      return max(0.1, end - time.monotonic())

    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=min(1.0, timeout / 4))
    with self._state:
      generation, lost, until = self._generation, self._lost, self.deadline
      self._generation = None  # no renewal writes it again
      self._renewed = -math.inf  # released: `writable` refuses from now on, whatever is in flight
      self._error = 'released at the end of the run'
    if generation is None or lost is not None:
      return
    # A conditional delete on S3 is a HEAD, then a DELETE: only while no one can take the lease
    # over in between, so past the deadline it is renewed first (or left to go stale).
    try:
      if time.monotonic() >= until:
        body, t0 = self._body()
        generation = self.store.replace(LEASE, body, generation, timeout=left())
        until = t0 + self.ttl - self.margin
      if generation is None or time.monotonic() >= until:
        return
      if self.store.replace(LEASE, None, generation, timeout=left()):
        return
      raw, now = _read(self.store, timeout=left())
      mine = raw is not None and (_parse(raw) or {}).get('id') == self.me['id']
      if mine and time.monotonic() < until:
        self.store.replace(LEASE, None, now, timeout=left())
    except StoreError:
      pass  # left to go stale


def _age(holder: dict[str, Any]) -> float:
  return time.time() - float(holder.get('renewed_at', 0))


_TOO_LARGE = b'\0'  # `_read`'s body of a lease over MAX_LEASE_BYTES: never JSON


def _read(store: Store, *, timeout: float | None = None) -> tuple[bytes | None, bytes]:
  """(the lease's bytes, or None when there is none; its generation), read only up to
  MAX_LEASE_BYTES: a larger one reads as `_TOO_LARGE`, which `_parse_why` calls damaged."""
  raw, generation, large = read_small(store, LEASE, MAX_LEASE_BYTES, timeout=timeout)
  return (_TOO_LARGE if large else raw), generation


def _parse(raw: bytes | None) -> dict[str, Any] | None:
  return _parse_why(raw)[0]


def _parse_why(raw: bytes | None) -> tuple[dict[str, Any] | None, str | None]:
  """(the holder `raw` names, or None; why `raw` is a damaged lease, or None when it is none).
  From the bucket: a lease whose times are not finite numbers in range is no lease a holder
  of this version writes (a NaN `renewed_at` would never go stale, a huge `ttl_secs` would be
  waited for as long as it says)."""
  if raw is None:
    return None, None
  if raw == _TOO_LARGE:
    return None, f'larger than {MAX_LEASE_BYTES} bytes'
  holder = loads(raw)
  if not isinstance(holder, dict):
    return None, 'not a JSON object'
  latest = time.time() + MAX_AHEAD_SECS
  for k in ('renewed_at', 'started_at'):
    v = holder.get(k, 0)
    if not finite(v) is not None or not 0 <= v <= latest:
      return None, (f'{k} {v!r:.40} is not a time since 1970 at most {MAX_AHEAD_SECS:.0f} s '
                    "ahead of this machine's clock")
  ttl = holder.get('ttl_secs', 1.0)
  if not finite(ttl) is not None or not 0 < ttl <= MAX_TTL_SECS:
    return None, f'ttl_secs {ttl!r:.40} is not within (0, {MAX_TTL_SECS:.0f}]'
  pid = holder.get('pid', 0)
  if type(pid) is not int or pid < 0:  # pylint: disable=unidiomatic-typecheck
    return None, f'pid {pid!r:.40} is not a process id'
  return holder, None


def _boot_id() -> str:
  try:
    with open('/proc/sys/kernel/random/boot_id') as f:
      return f.read().strip()
  except OSError:
    return ''


def _pid_ns() -> str:
  try:
    return os.readlink('/proc/self/ns/pid')
  except OSError:
    return ''


def _pid_start(pid: int) -> int | None:
  """When process `pid` started (clock ticks since boot), or None if it is not running (a
  zombie is not)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      fields = f.read().rsplit(')', 1)[1].split()
  except (OSError, IndexError):
    return None
  return None if fields[0] in 'ZX' else int(fields[19])


def read(store: Store) -> dict[str, Any] | None:
  """The current holder of `store`'s lease, if any (for `jaxckpt inspect`): None when there is
  none, or it is damaged."""
  return _parse(_read(store)[0])
