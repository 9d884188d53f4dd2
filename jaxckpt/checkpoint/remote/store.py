"""Object storage, or a mounted path, behind one small interface: tensorstore's kvstore drivers.

    s3://bucket/prefix     the `s3` driver. Endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL,
                           region from AWS_REGION or AWS_DEFAULT_REGION, credentials from the
                           AWS_* variables when set, else the default chain (profile, instance).
    gs://bucket/prefix     the `gcs` driver: application default credentials; STORAGE_EMULATOR_HOST
                           (or TENSORSTORE_GCS_HTTP_URL) points it at an emulator.
    /path, file:///path    the `file` driver: a mounted persistent disk or a shared filesystem.
                           The path's parent must exist (a disk that is not mounted is refused,
                           never replaced by directories on the boot disk); the path itself is
                           created.

Conditional writes on S3: tensorstore sends `If-None-Match`/`If-Match` on a PUT without a HEAD
first only to amazonaws.com endpoints unless its spec's `use_conditional_write` is true;
elsewhere it HEADs first, a race between two writers. jaxckpt sets it true for every S3 store, so
the condition travels with the write itself; TENSORSTORE_S3_USE_CONDITIONAL_WRITE=false (the
variable older tensorstore releases read) turns it off. S3 DELETE is never conditional in
tensorstore (a HEAD, then an unconditional DELETE). Whether a store honours the conditions at
all is checked by the trainer's access probe.

GCS credentials: with STORAGE_EMULATOR_HOST set (or TENSORSTORE_GCS_HTTP_URL at an http:// URL)
jaxckpt sets GOOGLE_AUTH_TOKEN_FOR_TESTING (unless set) to a placeholder token, so tensorstore
does not look for application default credentials an emulator does not need. What tensorstore
logs of the credentials it found (or did not) at a process's first GCS request is held back;
a store that refuses the credentials is jaxckpt's one line (E-STORE-003).

Retries are `Store`'s own (`Retries`; tensorstore's off). HTTP 503 `SlowDown`, 429: waits of 1 s
(tensorstore hides `Retry-After`) doubling to 30 s, jittered up, for 120 s or the call's `timeout`,
then E-STORE-015; a lost connection or other 5xx: 3 retries. A `paced` name (the lease, a commit)
is written at most once a second per key per process (GCS takes about one a second per object).
Each request of a part (`start_write`, `start_read`: a save's and a restore's bulk) waits for
this process's share of the job's request rate to the store (`pacing`).

Keys are relative to the prefix. Every failure is a `StoreError` whose `kind` says what went
wrong (a missing bucket, refused credentials, no permission, an endpoint that cannot be reached)
so callers can name the fix. Conditional writes (`create`, `replace`) carry the store's
generation of an object: S3 `If-None-Match`/`If-Match`, GCS `ifGenerationMatch`, a file's stamp.
"""

from __future__ import annotations

import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..errors import CheckpointError
from .answers import classify
from .pacing import WRITES, PACE_SECS, Retries, admit, is_paced, paced, pacing  # noqa: F401

SCHEMES = ('s3', 'gs', 'file')
_URL = re.compile(r'^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*)://(?P<rest>.*)$')
_TS_RETRIES = {'max_retries': 0}  # tensorstore's: every retry is `Store`'s own (`Retries`)
_ABSENT = b'\x02'  # tensorstore's generation of a key that holds no value
# A mounted path's request (`file`) unanswered this long is a mount that does not answer (S3
# and GCS requests are bounded by `HTTP_TIMEOUTS`); a call's own `timeout` overrides it.
FILE_OP_SECS = 600.0
DELETE_BATCH = 64  # deletes in flight at once (`delete_many`), each batch fenced
_AUTH_LOG = 'google_auth_provider.cc'  # where tensorstore says how it found GCS credentials
_auth_said = threading.Lock()  # taken for good by the first GCS store of the process


class StoreError(CheckpointError):
  """A store operation failed. `kind`: what `classify` makes of the store's answer."""

  def __init__(self, code: str, what: str, fix: str = '', kind: str = 'failed'):
    super().__init__(code, what, fix)
    self.kind = kind


class StoreTimeout(StoreError, TimeoutError):
  """No answer within the call's `timeout`: a TimeoutError too, as a future's `result` raises."""


def parse_url(url: str) -> tuple[str, str, str]:
  """(scheme, bucket, prefix) of a remote URL; a plain path is ('file', '', absolute path).

  Raises `StoreError` E-STORE-001 for a scheme that is not s3, gs or file, or a missing bucket.
  """
  m = _URL.match(url)
  if not m:
    return 'file', '', str(Path(url).expanduser().absolute())
  scheme, rest = m['scheme'].lower(), m['rest']
  if scheme not in SCHEMES:
    raise StoreError('E-STORE-001', f'{url}: unknown storage scheme {scheme}://',
                     'use s3://bucket/prefix, gs://bucket/prefix or a path')
  if scheme == 'file':
    return 'file', '', str(Path('/' + rest.lstrip('/')))
  bucket, _, prefix = rest.partition('/')
  if not bucket:
    raise StoreError('E-STORE-001', f'{url}: no bucket named', f'use {scheme}://bucket/prefix')
  return scheme, bucket, prefix.strip('/')


# A store that stops answering (a half-open connection, a hung server) must fail the request so
# that it is retried, not hang the uploader: tensorstore's HTTP transport reads these once, when
# it starts. Set them in the environment to change them.
HTTP_TIMEOUTS = {
    'TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS': '20',
    'TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS': '30',  # under 1 byte/s for 30 s: give up
    'TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES': '1',
}


def _spec(scheme: str, bucket: str, prefix: str, retries: Mapping[str, Any]) -> dict:
  path = prefix + '/' if prefix else ''
  if scheme == 'file':
    return {'driver': 'file', 'path': path}
  for name, value in HTTP_TIMEOUTS.items():
    os.environ.setdefault(name, value)
  if scheme == 'gs':
    emulator = os.environ.get('STORAGE_EMULATOR_HOST')
    if emulator and not os.environ.get('TENSORSTORE_GCS_HTTP_URL'):
      os.environ['TENSORSTORE_GCS_HTTP_URL'] = (
          emulator if '://' in emulator else f'http://{emulator}')
    if emulator or os.environ.get('TENSORSTORE_GCS_HTTP_URL', '').startswith('http://'):
      os.environ.setdefault('GOOGLE_AUTH_TOKEN_FOR_TESTING', 'emulator')
    return {
        'driver': 'gcs', 'bucket': bucket, 'path': path,
        'context': {'gcs_request_retries': dict(retries)}
    }
  env = os.environ
  spec = {
      'driver': 's3', 'bucket': bucket, 'path': path,
      'aws_credentials': {'type': 'environment' if env.get('AWS_ACCESS_KEY_ID') else 'default'},
      'context': {'s3_request_retries': dict(retries)},
      'use_conditional_write': _flag(env.get('TENSORSTORE_S3_USE_CONDITIONAL_WRITE'), True)
  }
  endpoint = env.get('AWS_ENDPOINT_URL_S3') or env.get('AWS_ENDPOINT_URL')
  region = env.get('AWS_REGION') or env.get('AWS_DEFAULT_REGION')
  if endpoint:
    spec['endpoint'] = endpoint
  if region or endpoint:  # an S3-compatible server needs one to sign with; us-east-1 is the usual
    spec['aws_region'] = region or 'us-east-1'
  return spec


def _flag(value: str | None, default: bool) -> bool:
  """A boolean environment variable as absl parses one (true/false, 1/0, yes/no, t/f, y/n)."""
  if value is None or not value.strip():
    return default
  return value.strip().lower() not in ('false', '0', 'no', 'f', 'n', 'off')


def _without_auth_lines(first_request) -> None:
  """Runs a process's first GCS request with stderr held: tensorstore then logs how it found
  credentials ('Using ...', or an ERROR that it found none and goes on without), a line before
  jaxckpt's own; held lines other than those are passed on. Without credentials, GCS refuses
  the requests and jaxckpt says so in its one line (E-STORE-003, naming the fix)."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      first_request()
    except Exception:  # noqa: BLE001 - the store's own requests say what is wrong
      pass
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
    held.seek(0)
    kept = [line for line in held.read().splitlines(True) if _AUTH_LOG.encode() not in line]
  if kept:
    os.write(2, b''.join(kept))


def _key_range(prefix: str):
  import tensorstore as ts
  if not prefix:
    return None
  end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
  return ts.KvStore.KeyRange(inclusive_min=prefix, exclusive_max=end)


class Store:
  """One remote location (`url`); keys are paths under it. Thread-safe: tensorstore is."""

  def __init__(self, url: str, *, retries: Retries = Retries()):
    self.url = url.rstrip('/') if '://' in url else url
    self.scheme, self.bucket, self.prefix = parse_url(url)
    self.retries = retries
    self._spec = _spec(self.scheme, self.bucket, self.prefix, _TS_RETRIES)
    self._kv = None

  def __repr__(self) -> str:
    return f'Store({self.url!r})'

  @property
  def kv(self):
    if self._kv is None:
      import tensorstore as ts
      if self.scheme == 'file':
        path = Path(self._spec['path'])
        if not path.parent.is_dir():  # a disk not mounted: never a directory on the boot disk
          raise StoreError('E-STORE-002', f'{path.parent} does not exist',
                           'mount the disk it is on, or create that directory', 'missing_parent')
        self._call('open', None, lambda left: path.mkdir(exist_ok=True))
      kv = self._call('open', None, lambda left: ts.KvStore.open(self._spec).result())
      if self.scheme == 'gs' and _auth_said.acquire(blocking=False):
        _without_auth_lines(lambda: kv.read('.jaxckpt-probe-auth').result(timeout=10))
      self._kv = kv
    return self._kv

  def join(self, *parts: str) -> str:
    """The URL of a key, for messages."""
    return '/'.join([self.url, *parts])

  def _call(self, op: str, key: str | None, fn: Callable, *, timeout: float | None = None):
    """`fn(seconds left of timeout, or None)` (a request), retried as `self.retries` says."""
    r, t0 = self.retries, time.monotonic()
    if timeout is None and self.scheme == 'file':  # no HTTP timeouts bound a mount's answer
      timeout = FILE_OP_SECS
    end, tries, slow, transient = None if timeout is None else t0 + timeout, 0, 0, 0
    while True:
      tries += 1
      try:
        with pacing(self.url, key if op in WRITES else None):
          return fn(None if end is None else max(0.0, end - time.monotonic()))
      except (ValueError, RuntimeError, OSError) as e:
        message = str(e) or ('timed out' if isinstance(e, TimeoutError) else repr(e))
        kind, where, until, wait = classify(message), self.join(key) if key else self.url, end, None
        if kind == 'slow_down':
          wait, slow = min(r.slow_max, r.slow_first * 2**slow), slow + 1
          until = t0 + r.slow_secs if end is None else min(end, t0 + r.slow_secs)
        elif transient < r.transient and 'retry attempts failed' in message:  # tensorstore's
          wait, transient = min(2.0, 0.2 * 2**transient), transient + 1
        wait = wait and wait * random.uniform(1.0, 1.5)  # never under the wait asked for
        if wait is None or until is not None and time.monotonic() + wait > until:
          if kind == 'slow_down':
            status = (re.findall(r"http_response_code='(\d+)'", message) or ['503'])[0]
            raise StoreError(
                'E-STORE-015', f'{op} {where}: the store answered HTTP {status} '
                f'(slow down) to {tries} tries over {time.monotonic() - t0:.1f} s',
                'send fewer requests: --remote_rate=auto, or a lower number (pacing)', kind) from e
          hung = self.scheme == 'file' and isinstance(e, TimeoutError)
          raise (StoreTimeout if isinstance(e, TimeoutError) else StoreError)(
              'E-STORE-010', f'{op} {where} failed: {message.splitlines()[0][:300]}' +
              (f' after {time.monotonic() - t0:.0f} s' if hung else ''),
              'check that filesystem (a mount that does not answer)'
              if hung else 'check the store and the network', kind) from e
        logging.debug('%s %s: %s; retried in %.1f s', op, where, kind, wait)
        time.sleep(wait)

  # Plain operations.
  def read(self, key: str) -> bytes | None:
    """The object's bytes, or None when there is none."""
    r = self._call('read', key, lambda left: self.kv.read(key).result(timeout=left))
    return r.value if r.state == 'value' else None

  def read_range(self, key: str, start: int, stop: int) -> bytes:
    r = self._call(
        'read', key,
        lambda left: self.kv.read(key, byte_range=slice(start, stop)).result(timeout=left))
    if r.state != 'value':
      raise StoreError('E-STORE-011', f'{self.join(key)} is missing', 'the object was removed')
    return r.value

  def read_range_version(self,
                         key: str,
                         start: int,
                         stop: int | None = None) -> tuple[bytes, bytes]:
    """(bytes [start, stop) of an object, to its end when `stop` is None; the generation the
    store reported with them). A range not inside the object is StoreError E-STORE-012, kind
    'out_of_range'; a missing object E-STORE-011."""

    def read(left):
      try:
        return self.kv.read(key, byte_range=slice(start, stop)).result(timeout=left)
      except ValueError as e:
        # S3 answers 416; the GCS emulator a Content-Range that tensorstore refuses.
        if any(s in str(e).lower() for s in ('out_of_range', 'content-range', 'not satisfiable')):
          raise StoreError('E-STORE-012', f'{self.join(key)} holds no bytes [{start}, {stop})',
                           'the object is shorter than that', 'out_of_range') from e
        raise

    r = self._call('read', key, read)
    if r.state != 'value':
      raise StoreError('E-STORE-011', f'{self.join(key)} is missing', 'the object was removed')
    return r.value, r.stamp.generation

  def version_label(self, generation: bytes) -> str | None:
    """What the store calls the version a generation stands for: an S3 ETag (quoted, as S3
    writes it), a GCS generation number, a file's stamp; None when the store reported none."""
    body = generation[1:]  # tensorstore's first byte holds flags, the rest the store's own value
    if self.scheme == 'gs':
      number = int.from_bytes(body[:8], 'little') if len(body) >= 8 else 0
      return str(number) if number else None
    return body.decode(errors='replace') if body.strip(b'\x00') else None

  def write(self, key: str, data: bytes, *, timeout: float | None = None) -> None:
    """`timeout`: seconds to wait for the store (StoreTimeout past it; the write may land)."""
    self._call(
        'write',
        key,
        lambda left: self.kv.write(key, bytes(data)).result(timeout=left),
        timeout=timeout)

  def write_many(self, items: Mapping[str, bytes]) -> None:
    """Writes every object at once; returns when all are durable (raises on the first error)."""
    for request in [self.start_write(k, bytes(v)) for k, v in items.items()]:
      request.result()

  def start_write(self, key: str, data: bytes | None, op: str = 'write') -> 'Request':
    """A write in flight (None: a delete); `finish(op, key, request)` waits for it."""
    return Request(self, op, key, lambda: self.kv.write(key, data))

  def start_read(self, key: str, byte_range: slice | None = None) -> 'Request':
    return Request(self, 'read', key, lambda: self.kv.read(key, byte_range=byte_range))

  def finish(self, op: str, key: str, request: 'Request') -> Any:
    return request.result()

  def delete(self, key: str) -> None:
    self._call('delete', key, lambda left: self.kv.write(key, None).result(timeout=left))

  def delete_many(self, keys: Iterable[str], fence: Callable[[], None] | None = None) -> None:
    """Deletes `keys`, DELETE_BATCH in flight at a time; `fence()` (a writer's lease check)
    before each batch, so that nothing more is deleted once it raises: sends wait for their
    share of the request rate, and thousands of keys take longer than a lease's margin."""
    keys = list(keys)
    for at in range(0, len(keys), DELETE_BATCH):
      if fence is not None:
        fence()
      for request in [self.start_write(k, None, 'delete') for k in keys[at:at + DELETE_BATCH]]:
        request.result()

  def list(self, prefix: str = '') -> list[str]:
    """Every key that starts with `prefix`, sorted."""
    keys = self._call('list', prefix or None,
                      lambda left: self.kv.list(_key_range(prefix)).result(timeout=left))
    # Filtered here too: some servers (the GCS emulator) answer with more than the range asked.
    return sorted(k for k in (k.decode() for k in keys) if k.startswith(prefix))

  # Conditional operations: a generation is what the store says of an object's current version.
  def read_generation(self,
                      key: str,
                      *,
                      timeout: float | None = None) -> tuple[bytes | None, bytes]:
    """(bytes or None, generation); the generation of an absent object makes `replace` a create.
    `timeout`: seconds to wait for the answer (StoreError past it; the request may still land)."""
    r = self._call(
        'read', key, lambda left: self.kv.read(key).result(timeout=left), timeout=timeout)
    return (r.value if r.state == 'value' else None), r.stamp.generation

  def replace(self,
              key: str,
              data: bytes | None,
              generation: bytes,
              *,
              timeout: float | None = None) -> bytes | None:
    """Writes (or deletes, with None) `key` only if it is still at `generation`; returns the new
    generation, or None when someone else changed it first. `timeout` as for `read_generation`."""
    if generation != _ABSENT and not generation.strip(b'\x00'):
      # The server read the object without saying its version (the GCS emulator's downloads
      # carry no x-goog-generation): there is nothing to make the write conditional on.
      logging.warning('%s does not report object generations: writing %s unconditionally', self.url,
                      key)
      generation = None
    stamp = self._call(
        'write',
        key,
        lambda left: self.kv.write(key, data, if_equal=generation).result(timeout=left),
        timeout=timeout)
    return stamp.generation or None  # an empty generation: the condition did not hold

  def create(self, key: str, data: bytes) -> bytes | None:
    """Writes `key` only if it does not exist; its generation, or None when it exists."""
    return self.replace(key, data, _ABSENT)

  def ignored_condition(self, key: str) -> str | None:
    """Whether the store honours conditional writes, tried on `key` (created, then deleted):
    None if it does, else the write it let through that it should have refused (or the one it
    refused that it should have let through)."""
    first = self.create(key, b'jaxckpt condition probe 1\n')
    if first is None:
      return f'a create-only write of {key}, which did not exist, was refused'
    try:
      if self.create(key, b'jaxckpt condition probe 2\n') is not None:
        return 'a second create-only write of one object went through'
      if self.replace(key, b'jaxckpt condition probe 3\n', first) is None:
        return 'a write at its own generation was refused'
      if self.replace(key, b'jaxckpt condition probe 4\n', first) is not None:
        return 'a write at a stale generation went through'
      # The lease is taken at the generation a read reports: a read without one would make
      # every such write unconditional (`replace`).
      _, read = self.read_generation(key)
      if read != _ABSENT and not read.strip(b'\x00'):
        return 'a read reported no generation for an object that exists'
      return None
    finally:
      self.delete(key)


class Request:
  """A request in flight; `result(timeout)` waits for it, resending as `Store.retries` says.
  Each send, the first and every resend, waits for this process's slot of the job's request
  rate to the store (`pacing.admit`): the bulk of a save's and a restore's requests."""

  def __init__(self, store: Store, op: str, key: str, send: Callable[[], Any]):
    self._store, self._op, self._key, self._send = store, op, key, send
    # A paced key's write is sent by `result`, after its pause (`_call`).
    self._future = None if op != 'read' and is_paced(key) else self._paced_send()

  def _paced_send(self):
    admit(self._store.scheme, self._store.bucket, self._op)
    return self._send()

  def result(self, timeout: float | None = None) -> Any:

    def attempt(left):
      start = time.monotonic()
      future, self._future = self._future or self._paced_send(), None
      if left is not None:  # a wait for the slot counts against the call's time
        left = max(0.0, left - (time.monotonic() - start))
      return future.result(timeout=left)

    return self._store._call(self._op, self._key, attempt, timeout=timeout)
