"""A process's disk work beside the collectives of a restore from the peers, bounded.

Every process must take part in every window of every collective to the end, or the others wait
in one forever (a collective has no timeout of its own). So what a process does on its disk
between and beside them (opening a part, reading the next window, writing the last one, the
fsync and rename of a file received; a part read from the remote) runs on a thread of a `Disk`
and is waited for at most DISK_WAIT_SECS, or the wait it is given. Past that the disk is stuck
(a hung disk or mount): the process touches it no more, by any thread, sends zeros to the end,
and names what hung. A file received goes in
through a `Landing`: a temporary name, its CRC-32 as it comes, fsync, checks, rename.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from . import layout
from .checksum import crc32
from .errors import CheckpointError

MISMATCH = 'what was received does not match'  # a receiver's check, failed: its sender's doing?
# Disk work not done after this is stuck: the stuck thread is left behind (a daemon thread: the
# process exits without it).
DISK_WAIT_SECS = 120.0
HUNG = 'a hung disk?'  # the end of what a stuck disk says
# A task that moves a file's bytes (the fsync of one received) waits a second more per 20 MB.
DISK_BYTES_PER_SEC = 20e6
READER, WRITER = 'jaxckpt-send', 'jaxckpt-receive'  # `Disk`'s threads


class Stuck(OSError):
  """A disk task not done within its wait (`Disk`): its message names what and the thread."""


class Task(NamedTuple):
  future: concurrent.futures.Future
  thread: str
  what: str
  wait: float  # s: how long it is waited for before the disk is said to be stuck


class Disk:
  """One process's disk work beside the collectives of a restore from the peers (the windows
  read ahead of each collective, and written behind it), a thread for each kind, as a context.
  `result` waits for a task at most its wait (by default DISK_WAIT_SECS): one not done then is
  stuck, a hung disk or mount, and so is this process's disk from then on (`stuck` names what hung): no task runs on
  it, its callers do no more disk work on their own thread either (it would hang there, every
  other process waiting in the next collective) and send zeros to the last window, and neither
  leaving nor the process's exit waits for the threads."""

  def __init__(self):
    self.stuck: str | None = None
    self._pools: dict[str, _Worker] = {}

  def __enter__(self) -> Disk:
    return self

  def __exit__(self, failed, *_) -> None:
    for pool in self._pools.values():
      pool.shutdown(wait=self.stuck is None and failed is None)

  def submit(self,
             thread: str,
             what: str,
             fn: Callable,
             *args,
             nbytes: int = 0,
             wait: float | None = None) -> Task | None:
    """`fn(*args)` on the thread named `thread`, `what` naming it should it hang; None once
    the disk is stuck. It is waited for `wait` seconds, by default DISK_WAIT_SECS and a second
    per DISK_BYTES_PER_SEC of `nbytes`, the bytes it moves."""
    if self.stuck is not None:
      return None
    if thread not in self._pools:
      self._pools[thread] = _Worker(thread)
    wait = DISK_WAIT_SECS + nbytes / DISK_BYTES_PER_SEC if wait is None else wait
    return Task(self._pools[thread].submit(fn, *args), thread, what, wait)

  def result(self, task: Task) -> Any:
    """`task`'s result (or its exception), once done; Stuck if it is not within its wait
    (none at all, once the disk is stuck)."""
    done, _ = concurrent.futures.wait([task.future],
                                      timeout=0 if self.stuck is not None else task.wait)
    if not done:
      task.future.cancel()
      self.stuck = self.stuck or (
          f'{task.what}: not done after a wait of {round(task.wait, 1):g} s '
          f'(thread {task.thread}); {HUNG}')
      raise Stuck(self.stuck)
    return task.future.result()

  def run(self,
          thread: str,
          what: str,
          fn: Callable,
          *args,
          nbytes: int = 0,
          wait: float | None = None) -> Any:
    """`fn(*args)` on `thread`, waited for as `result` waits: its result, or its exception, or
    Stuck (at once, once the disk is stuck)."""
    task = self.submit(thread, what, fn, *args, nbytes=nbytes, wait=wait)
    if task is None:
      raise Stuck(self.stuck)
    return self.result(task)

  def kept(self,
           problems: list[str],
           thread: str,
           what: str,
           fn: Callable,
           *args,
           nbytes: int = 0) -> Any:
    """`run`'s answer, or None with what went wrong added to `problems` (`taken`)."""
    task = self.submit(thread, what, fn, *args, nbytes=nbytes)
    if task is None:
      problems.extend([] if self.stuck in problems else [self.stuck])
      return None
    return self.taken(problems, task)

  def taken(self, problems: list[str], task: Task) -> Any:
    """`result`'s answer, or None with what went wrong added to `problems`: a stuck disk once,
    an error naming no file named by its task."""
    try:
      return self.result(task)
    except Stuck as e:
      problems.extend([] if str(e) in problems else [str(e)])
    except CheckpointError as e:
      problems.append(e.line())
    except OSError as e:
      problems.append(f'{e.filename or task.what}: {e.strerror or e}')
    except Exception as e:  # noqa: BLE001 - said to every process, never raised on one alone
      problems.append(f'{type(e).__name__}: {e}')
    return None


class _Worker:
  """One daemon thread that runs what it is handed, in order: one stuck on a hung disk does not
  hold the process at its exit, where a `ThreadPoolExecutor`'s threads are joined."""

  def __init__(self, name: str):
    self._tasks: queue.SimpleQueue = queue.SimpleQueue()
    self._closed = False
    self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
    self._thread.start()

  def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
    if self._closed:  # it would never run: said at once, not waited out as a hung disk
      raise RuntimeError(f'{self._thread.name}: a task handed to it after it was let go')
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._tasks.put((future, fn, args))
    return future

  def _serve(self) -> None:
    while (task := self._tasks.get()) is not None:
      future, fn, args = task
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - its caller's to raise
          future.set_exception(e)

  def shutdown(self, wait: bool) -> None:
    """Those not begun cancelled, the thread let go; with `wait`, joined (it is idle: every
    task was waited for) for at most DISK_WAIT_SECS."""
    self._closed = True
    with contextlib.suppress(queue.Empty):
      while True:
        self._tasks.get_nowait()[0].cancel()
    self._tasks.put(None)
    if wait:
      self._thread.join(DISK_WAIT_SECS)


class Landing:
  """A file received window by window (`write(offset, bytes)`, the writes in order): under a
  temporary name beside `path` (None: this process receives nothing), its CRC-32 computed as it
  comes; `finish` fsyncs it and renames it in only when it is `size` bytes of the CRC-32 it
  should have and no problem was met, else removes it. Problems go to `problems`, shared with
  the caller: a receiver that fails goes on taking part in every window."""

  def __init__(self, path: Path | None, size: int, problems: list[str]):
    self.path, self.size, self.problems = path, size, problems
    self.tmp = None if path is None else path.with_name(path.name + layout.PEER_TMP)
    self.crc = self.wrote = 0
    self.fd = None
    # The disk hung (`Disk`): the file is left as it is, open, its temporary name removed at
    # the next restart (`holdings.tidy`): a stuck write may hold it, and a syscall would hang.
    self.left = False
    try:
      self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT
                        | os.O_TRUNC, 0o644) if self.tmp else None
    except OSError as e:
      problems.append(f'{e.filename}: {e.strerror or e}')

  @property
  def open(self) -> bool:
    return self.fd is not None

  def write(self, offset: int, data: np.ndarray) -> None:
    view = memoryview(data)[:max(0, min(len(data), self.size - offset))]
    done = 0
    while done < len(view):  # a write cut short (a disk nearly full) goes on, or raises
      n = os.pwrite(self.fd, view[done:], offset + done)
      if n <= 0:
        raise OSError(errno.ENOSPC, f'a write at {offset + done} wrote nothing', str(self.tmp))
      done += n
    self.crc, self.wrote = crc32(view, self.crc), self.wrote + done

  def finish(self, crc: str, against: str) -> str | None:
    """After the collectives: the problem (the first one met), or None with the file in. It
    never raises: a process that did would leave the others in the next collective."""
    if self.left:
      return self.problems[0] if self.problems else f'{self.tmp}: left on a hung disk'
    try:
      try:
        if self.fd is not None and not self.problems:
          os.fsync(self.fd)
      finally:
        if self.fd is not None:
          os.close(self.fd)
      if self.path is None or self.problems:
        self._drop()
        return self.problems[0] if self.problems else None
      if f'{self.crc:08x}' != crc or self.wrote != self.size:
        self._drop()
        return (f'{self.path}: {MISMATCH} {against} ({self.wrote} bytes, crc32 {self.crc:08x}; '
                f'{against} says {self.size}, {crc})')
      os.replace(self.tmp, self.path)
      return None
    except OSError as e:
      self._drop()  # a failed fsync or rename leaves nothing half in
      return self.problems[0] if self.problems else f'{e.filename or self.tmp}: {e.strerror or e}'

  def _drop(self) -> None:
    if self.tmp is not None:
      with contextlib.suppress(OSError):  # a disk gone read-only: the next restart removes it
        self.tmp.unlink(missing_ok=True)


__all__ = [
    'DISK_WAIT_SECS', 'HUNG', 'MISMATCH', 'READER', 'WRITER', 'Disk', 'Landing', 'Stuck', 'Task'
]
