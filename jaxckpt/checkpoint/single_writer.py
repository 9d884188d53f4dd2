"""One writer per checkpoint directory: `.jaxckpt-writer`, held while a writer is open.

Two writers on one directory undo each other: the second one's start removes the first one's
save in progress as a crashed writer's debris, and each one's retention deletes what the other
still counts on. So a writer (`CheckpointManager(dir)`; across processes, the one that removes
debris: process 0 on a shared directory, each process on its own disk) takes an exclusive
`flock` on `DIR/.jaxckpt-writer` before it touches anything, and holds it until `close()`, which
removes the file (or until the process ends: the kernel lets go of a dead process's lock, and
the file it leaves is taken by the next writer). A manager whose save is stuck past its bound
keeps it after `close()`: that save may still write there. A second writer is refused: ArgumentError E-CKPT-020, naming the holder (pid,
host, since when), which the holder writes into the file. Readers (`writer=False`) take none.

Within one process the directories held are also kept in a table: where `flock` is emulated with
POSIX locks (NFS), a process does not conflict with itself, and closing any descriptor of the
file would drop its lock.

A filesystem that cannot lock (some network and FUSE mounts answer ENOLCK or EOPNOTSUPP) is a
warning, once: there, one writer per directory is the caller's to keep.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import weakref
from pathlib import Path

from .errors import ArgumentError

FILE = '.jaxckpt-writer'
_HELD: set[tuple[int, int]] = set()  # (device, inode) of the directories this process holds
_HELD_LOCK = threading.Lock()
_log = logging.getLogger(__name__)
_FIX = ('close that CheckpointManager, or stop its process, first: one directory has one writer '
        '(a reader opens with writer=False)')


class Held:
  """The lock of one open writer; `release()` removes its file and lets it go (also when it is
  garbage). Removed while held: a writer that opened the file before it went finds, once it has
  the lock, that the name is no longer its file's, and takes the new one (`hold`)."""

  def __init__(self, fd: int, path: Path, key: tuple[int, int]):
    self._close = weakref.finalize(self, _let_go, fd, path, key)

  def release(self) -> None:
    self._close()


def _let_go(fd: int, path: Path, key: tuple[int, int]) -> None:
  try:
    path.unlink()
  except OSError:
    pass  # the next writer takes it as it is
  finally:
    os.close(fd)
    with _HELD_LOCK:
      _HELD.discard(key)


def hold(directory: Path) -> Held | None:
  """Takes `directory`'s writer lock (see the module); None where the filesystem has no locks."""
  path = Path(directory) / FILE
  st = os.stat(directory)
  key = (st.st_dev, st.st_ino)
  with _HELD_LOCK:
    if key in _HELD:
      raise ArgumentError(
          'E-CKPT-020', f'{directory} has another writer open (pid {os.getpid()} on '
          f'{socket.gethostname()}: this process)', _FIX)
    _HELD.add(key)
  try:
    return _hold(path, directory, key)
  except BaseException:
    with _HELD_LOCK:
      _HELD.discard(key)
    raise


def _hold(path: Path, directory: Path, key: tuple[int, int]) -> Held | None:
  for _ in range(100):  # another writer's release between the open and the lock: open again
    fd = _lock(path, directory)
    if fd is None or same_file(fd, path):
      break
    os.close(fd)
  else:
    raise ArgumentError('E-CKPT-020', f'{path} keeps changing under this writer',
                        'one directory has one writer: stop the others')
  if fd is None:
    with _HELD_LOCK:
      _HELD.discard(key)  # nothing is held: no lock on this filesystem
    return None
  me = {'pid': os.getpid(), 'host': socket.gethostname(), 'since': time.time()}
  try:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)  # for the message a second writer gets
  except OSError:
    pass  # the lock holds all the same; only its holder's name is missing
  return Held(fd, path, key)


def same_file(fd: int, path: Path) -> bool:
  """Whether `fd` is still the file at `path` (a lock on one removed since names nothing)."""
  try:
    return os.path.samestat(os.fstat(fd), os.stat(path))
  except FileNotFoundError:
    return False


def _lock(path: Path, directory: Path) -> int | None:
  """A descriptor of `path` with its exclusive lock; None where the filesystem has no locks."""
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = holder_of(fd)
    os.close(fd)
    since = holder.get('since')
    when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since)) if isinstance(
        since, (int, float)) else 'an unknown time'
    raise ArgumentError(
        'E-CKPT-020', f'{directory} has another writer open (pid {holder.get("pid", "?")} on '
        f'{holder.get("host", "?")}, since {when})', _FIX) from None
  except OSError as e:  # no locks on this filesystem
    os.close(fd)
    _log.warning('cannot lock %s (%s): one writer per directory is not enforced there', path,
                 e.strerror or e)
    return None
  return fd


def holder_of(fd: int) -> dict:
  """What a lock file's holder wrote in it; {} when it is empty or not such a record."""
  try:
    found = json.loads(os.pread(fd, 4096, 0) or b'{}')
  except (OSError, ValueError, RecursionError):
    return {}
  return found if isinstance(found, dict) else {}
