"""An HTTP proxy on loopback in front of a real object store server (moto, the GCS emulator):
what a store between jaxckpt and its bucket can do to the requests and answers.

- `strip`: the conditions are taken off every request (S3 `If-None-Match` / `If-Match`, GCS
  `ifGenerationMatch` / `ifMetagenerationMatch` and their `x-goog-if-*` headers), as a store that
  ignores conditional writes behaves.
- `drop(method, key)`: the next such request is forwarded, and its answer never comes back (the
  connection is closed): a lost response.
- `hang`: while set, requests are held without an answer (a store that stops answering);
  `hold(key)`: so are those whose path ends with `key` (a store that stops answering for one
  object: a writer cut off from its lease while its other requests go through).
- `slow_down(method, path)`: when it says True, the request is not forwarded and is answered
  `503 SlowDown` with `Retry-After: retry_after` (a store asking for fewer requests).

`requests` lists every request forwarded (`Request`: method, path, status, when it began), in the
order answered.
"""

from __future__ import annotations

import http.client
import http.server
import threading
import time
import urllib.parse
from typing import NamedTuple

CONDITION_HEADERS = ('if-none-match', 'if-match', 'x-goog-if-generation-match',
                     'x-goog-if-metageneration-match')
CONDITION_PARAMS = ('ifGenerationMatch', 'ifMetagenerationMatch', 'ifGenerationNotMatch')
HOP_BY_HOP = ('connection', 'keep-alive', 'transfer-encoding', 'proxy-connection', 'upgrade')
HANG_SECS = 300.0  # the longest a held request is held, so a test that fails never hangs


class Request(NamedTuple):
  method: str
  path: str  # without the query
  status: int  # the server's answer
  began: float  # time.monotonic() when the request's headers had arrived


class ConditionProxy:

  def __init__(self, upstream: str, *, strip: bool = False):
    target = urllib.parse.urlsplit(upstream)
    self.upstream = (target.hostname, target.port)
    self.strip = strip
    self.slow_down = None  # (method, path) -> bool
    self.retry_after = 1
    self.hang = threading.Event()
    self.released = threading.Event()  # set by `stop`: held requests end
    self.requests: list[tuple[str, str]] = []
    self._drops: list[tuple[str, str]] = []
    self._held: list[str] = []
    self._lock = threading.Lock()
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = 'HTTP/1.1'

      def log_message(self, *args):  # quiet: the tests read what they assert on
        pass

      def _forward(self):
        proxy._handle(self)

      do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

    self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    self._server.daemon_threads = True
    self.endpoint = f'http://127.0.0.1:{self._server.server_address[1]}'
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
    self._thread.start()

  def drop(self, method: str, key: str) -> None:
    """The answer to the next `method` request whose path ends with `key` is lost."""
    with self._lock:
      self._drops.append((method, key))

  def hold(self, key: str) -> None:
    with self._lock:
      self._held.append(key)

  def stop(self) -> None:
    self.released.set()
    self._server.shutdown()
    self._server.server_close()

  def _dropping(self, method: str, path: str) -> bool:
    with self._lock:
      for i, (m, key) in enumerate(self._drops):
        if m == method and urllib.parse.urlsplit(path).path.endswith(key):
          del self._drops[i]
          return True
    return False

  def _handle(self, request: http.server.BaseHTTPRequestHandler) -> None:
    began = time.monotonic()  # its headers are in; its body may still be on the way
    length = int(request.headers.get('content-length') or 0)
    body = request.rfile.read(length) if length else b''
    with self._lock:
      held = any(urllib.parse.urlsplit(request.path).path.endswith(k) for k in self._held)
    if held or self.hang.is_set():
      self.released.wait(HANG_SECS)
      request.close_connection = True
      return
    if self.slow_down is not None and self.slow_down(request.command, request.path):
      with self._lock:
        self.requests.append(
            Request(request.command,
                    urllib.parse.urlsplit(request.path).path, 503, began))
      body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>'
              b'Please reduce your request rate.</Message></Error>')
      request.send_response(503, 'Slow Down')
      for k, v in (('Retry-After', str(self.retry_after)), ('Content-Type', 'application/xml'),
                   ('Content-Length', str(len(body)))):
        request.send_header(k, v)
      request.end_headers()
      request.wfile.write(body)
      return
    path = request.path
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
    if self.strip:
      headers = {k: v for k, v in headers.items() if k.lower() not in CONDITION_HEADERS}
      url = urllib.parse.urlsplit(path)
      query = [(k, v)
               for k, v in urllib.parse.parse_qsl(url.query, keep_blank_values=True)
               if k not in CONDITION_PARAMS]
      path = urllib.parse.urlunsplit(('', '', url.path, urllib.parse.urlencode(query), ''))
    conn = http.client.HTTPConnection(*self.upstream, timeout=60)
    try:
      conn.request(request.command, path, body=body, headers=headers)
      answer = conn.getresponse()
      data = answer.read()
    finally:
      conn.close()
    with self._lock:
      self.requests.append(
          Request(request.command,
                  urllib.parse.urlsplit(path).path, answer.status, began))
    if self._dropping(request.command, request.path):
      request.close_connection = True  # the write happened; its answer is lost
      return
    request.send_response(answer.status, answer.reason)
    head = request.command == 'HEAD'  # its content-length is the object's: passed on as it is
    for k, v in answer.getheaders():
      if k.lower() not in HOP_BY_HOP and (head or k.lower() != 'content-length'):
        request.send_header(k, v)
    if not head:
      request.send_header('Content-Length', str(len(data)))
    request.end_headers()
    if not head:
      request.wfile.write(data)
