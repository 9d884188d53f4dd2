"""The run directory: where each of its files lives, and who may write in it.

    WORKDIR/
      checkpoints/        step_<n>/ directories (the checkpoint library's)
      exports/            exports written during training and by `jaxckpt export`
      tensorboard/        the scalars as TensorBoard event files, one per start (`tensorboard`)
      status.json, events.jsonl, loss.jsonl      run records (`runlog`)
      samples.json, bandit.json, archive/        phase satellites (`phases`)
      evaluated.json      the evaluator's results (`evaluate`)
      LOCK                held by the trainer;  evaluated.json.lock: held by the evaluator

One writer per run directory: `WorkdirLock` (`WORKDIR/LOCK`) is held with `flock` for as long as
the trainer lives; the kernel releases it when the process dies, however it dies, so a lock left
by a crashed or killed run is simply taken over. The file also records who holds it (pid, host,
start time), for the error a second writer gets and for the `took over` note. flock works
between processes of one machine; on a shared filesystem mounted by several machines, give each
run its own workdir. `EvaluatorLock` is the same for `jaxckpt evaluate`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from jaxckpt.checkpoint import single_writer
from jaxckpt.errors import UsageError

CHECKPOINTS = 'checkpoints'
EXPORTS = 'exports'
TENSORBOARD = 'tensorboard'
STATUS = 'status.json'
EVENTS = 'events.jsonl'
LOSSES = 'loss.jsonl'
SAMPLES = 'samples.json'
BANDIT = 'bandit.json'
ARCHIVE = 'archive'
EVALUATED = 'evaluated.json'
LOCK = 'LOCK'


def checkpoints_dir(workdir: str | os.PathLike) -> Path:
  return Path(workdir) / CHECKPOINTS


def exports_dir(workdir: str | os.PathLike) -> Path:
  return Path(workdir) / EXPORTS


def tensorboard_dir(workdir: str | os.PathLike) -> Path:
  return Path(workdir) / TENSORBOARD


class WorkdirLock:
  """`with WorkdirLock(workdir) as lock:` — raises `UsageError` E-LOCK-001 when already held,
  E-USAGE-005 when `workdir` is not a directory and cannot be made one."""

  FILE, CODE, HOLDER = LOCK, 'E-LOCK-001', 'trainer'
  FIX = 'wait for it to finish or stop it (SIGTERM checkpoints and exits); one workdir has one writer'

  def __init__(self, workdir: str | os.PathLike):
    self.path = Path(workdir) / self.FILE
    self.previous_holder: dict[str, Any] | None = None  # set when a dead holder's lock is taken
    self._fd: int | None = None
    self._made = False  # the workdir did not exist: a start refused at once removes it again

  def acquire(self) -> 'WorkdirLock':
    for _ in range(100):  # a refused start removing its workdir between the open and the lock
      fd = self._open_locked()
      if single_writer.same_file(fd, self.path):
        break
      os.close(fd)  # the lock of a file no longer there names nothing: open the one there now
    else:
      raise UsageError(self.CODE, f'{self.path} keeps changing under this start',
                       'one workdir has one writer: stop the others')
    holder = single_writer.holder_of(fd)
    self.previous_holder = holder or None
    me = {'pid': os.getpid(), 'host': socket.gethostname(), 'started_at': time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  def _open_locked(self) -> int:
    """A descriptor of LOCK holding its exclusive lock (the workdir made first if missing)."""
    workdir = self.path.parent
    try:
      self._made = self._made or not workdir.exists()
      workdir.mkdir(parents=True, exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # the first thing a run writes: a bad --workdir shows here
      what = 'is not a directory' if workdir.exists() and not workdir.is_dir() else (
          f'cannot be created or written: {e.strerror or e}')
      raise UsageError('E-USAGE-005', f'the workdir {workdir} {what}',
                       'pass a --workdir that is a directory, or that can be created') from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = single_writer.holder_of(fd)
      os.close(fd)
      raise UsageError(
          self.CODE, f'{self.path.parent} is in use by another {self.HOLDER} '
          f'(pid {holder.get("pid", "?")} on {holder.get("host", "?")}, since '
          f'{_when(holder.get("started_at"))})', self.FIX) from None
    return fd

  def release(self) -> None:
    """Lets go; a workdir this lock made that holds nothing else goes too (a start refused
    before it wrote anything leaves no empty directory behind), while still held."""
    if self._fd is not None and self._made:
      with contextlib.suppress(OSError):
        if os.listdir(self.path.parent) == [self.FILE]:
          self.path.unlink()
          self.path.parent.rmdir()  # fails, and stays, if another start just made its LOCK
    if self._fd is not None:
      os.ftruncate(self._fd, 0)  # an empty file: nobody holds it
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None

  def __enter__(self) -> 'WorkdirLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


class EvaluatorLock(WorkdirLock):
  """One evaluator per workdir: two would both evaluate every checkpoint (E-EVAL-001)."""

  FILE, CODE, HOLDER = f'{EVALUATED}.lock', 'E-EVAL-001', 'evaluator'
  FIX = 'let it finish, or stop it first; one evaluator per workdir'


def _when(t: float | None) -> str:
  return time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t)) if t else 'an unknown time'
