"""One writer per remote prefix: a lease object created and renewed with conditional writes.

`URL/LEASE` names its holder (an id, host, pid, start time) and when it was last renewed. It is
created only if absent (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`) and renewed only if it
is still the version its holder wrote, so two machines can never both believe they hold it. A
lease not renewed for `ttl_secs` is stale (its holder is dead or cut off) and may be taken over,
again with a conditional write. A holder that fails to renew because someone else now holds the
lease has lost it, and must stop writing at once: `check()` raises from then on.

Staleness is judged with the taker's clock against the holder's `renewed_at`: keep `ttl_secs`
well above both the renewal period (ttl/3) and the clock skew between machines.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from ..errors import CheckpointError
from .store import Store, StoreError

LEASE = 'LEASE'


class LeaseError(CheckpointError):
  """The lease is held by another live writer, or was lost to one."""


def describe(holder: dict[str, Any]) -> str:
  age = _age(holder)
  return (f'{holder.get("host", "?")} pid {holder.get("pid", "?")} (started '
          f'{time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(holder.get("started_at", 0)))} UTC, '
          f'renewed {age:.0f} s ago)')


class Lease:
  """Holds `store`'s lease while the writer lives: `acquire()`, then `start()` renews it on a
  thread every `ttl_secs / 3`; `release()` gives it back."""

  def __init__(self,
               store: Store,
               *,
               ttl_secs: float = 60.0,
               on_lost: Callable[[dict[str, Any] | None], None] = lambda holder: None):
    self.store, self.ttl = store, float(ttl_secs)
    self.me = {
        'id': uuid.uuid4().hex, 'host': socket.gethostname(), 'pid': os.getpid(),
        'started_at': time.time(), 'ttl_secs': self.ttl
    }
    self._generation: bytes | None = None
    self._lost: dict[str, Any] | None = None
    self._on_lost = on_lost
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._lock = threading.Lock()

  def _body(self) -> bytes:
    return json.dumps({**self.me, 'renewed_at': time.time()}).encode()

  def acquire(self) -> dict[str, Any] | None:
    """Takes the lease. Returns the stale holder it took over from (None if it was free); raises
    `LeaseError` E-STORE-006 naming the holder when a live writer has it.

    A holder that has missed a renewal (silent for over half its TTL: the VM this one replaces,
    most likely) is waited for until its lease is stale, then taken over; one that renews in the
    meantime is alive, and refused."""
    waited = False
    for _ in range(4):  # another taker can win a race between our read and our write
      raw, generation = self.store.read_generation(LEASE)
      holder = _parse(raw)
      if raw is not None and holder is not None and not self._stale(holder):
        ttl, age = float(holder.get('ttl_secs', self.ttl)), _age(holder)
        if age > ttl / 2 and not waited:
          waited = True
          logging.warning(
              'the lease on %s was last renewed %.0f s ago by %s; waiting %.0f s '
              'to take it over', self.store.url, age, holder.get('host'), ttl - age)
          time.sleep(ttl - age + 0.1)
          continue
        raise LeaseError(
            'E-STORE-006', f'{self.store.url} is in use by another trainer: {describe(holder)}',
            'stop that run, or give this one another --remote prefix (a lease that is not '
            f'renewed for {holder.get("ttl_secs", self.ttl):.0f} s is taken over)')
      new = self.store.replace(LEASE, self._body(), generation)
      if new is not None:
        self._generation = new
        return holder if raw is not None else None
    raise LeaseError('E-STORE-006', f'{self.store.url}: another trainer keeps taking the lease',
                     'run one trainer per --remote prefix')

  def _stale(self, holder: dict[str, Any]) -> bool:
    return _age(holder) > float(holder.get('ttl_secs', self.ttl))

  def renew(self) -> None:
    """Renews the lease now; raises `LeaseError` if it was lost (see `check`)."""
    with self._lock:
      self.check()
      try:
        new = self.store.replace(LEASE, self._body(), self._generation)
      except StoreError:
        return  # the store is unreachable: the lease may go stale; the next renewal says
      if new is None:
        raw, _ = self.store.read_generation(LEASE)
        self._lost = _parse(raw) or {}
        self._on_lost(self._lost)
        self.check()
      self._generation = new

  def check(self) -> None:
    """Raises `LeaseError` E-STORE-007 once the lease went to another writer."""
    if self._lost is not None:
      raise LeaseError(
          'E-STORE-007', f'lost the lease on {self.store.url} to '
          f'{describe(self._lost) if self._lost else "another trainer"}',
          'this run no longer writes there; the other trainer owns the remote run now')

  @property
  def lost(self) -> bool:
    return self._lost is not None

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name='jaxckpt-lease', daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self.ttl / 3):
      try:
        self.renew()
      except LeaseError:
        return

  def release(self) -> None:
    """Stops renewing and deletes the lease if this writer still holds it."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    with self._lock:
      if self._generation is not None and self._lost is None:
        try:
          self.store.replace(LEASE, None, self._generation)
        except StoreError:
          pass  # left to go stale
      self._generation = None


def _age(holder: dict[str, Any]) -> float:
  return time.time() - float(holder.get('renewed_at', 0))


def _parse(raw: bytes | None) -> dict[str, Any] | None:
  try:
    holder = json.loads(raw) if raw else None
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def read(store: Store) -> dict[str, Any] | None:
  """The current holder of `store`'s lease, if any (for `jaxckpt inspect`)."""
  return _parse(store.read(LEASE))
