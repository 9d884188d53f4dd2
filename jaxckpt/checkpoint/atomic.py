"""Durable writes: a reader sees the old content or the whole new content, never a mix.

Each write goes to a temporary sibling (`<name>.tmp-<nonce>`), is fsynced, renamed over its
final name, and the directory is fsynced. A directory that replaces another is swapped in with
one `renameat2(RENAME_EXCHANGE)` where the OS has it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from .errors import CheckpointError


def fsync_dir(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


TMP_MARK = '.tmp-'  # temporary siblings are named `<final name>.tmp-<nonce>`


def temporary_sibling(path: Path) -> Path:
  return path.with_name(f'{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}')


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
  """Yields a temporary path next to `path`; on success it becomes `path`, durably.

  The caller writes the whole file to the yielded path. It is then fsynced, renamed over `path`
  (old content or new, never a mix) and the directory fsynced. On error it is removed.
  """
  path = Path(path)
  tmp = temporary_sibling(path)
  try:
    yield tmp
    fd = os.open(tmp, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  fsync_dir(path.parent)


def exchange(a: Path, b: Path) -> bool:
  """Atomically swap two paths (Linux >= 3.15 `renameat2` RENAME_EXCHANGE).

  Returns False, having changed nothing, where the OS or the filesystem cannot.
  """
  renameat2 = getattr(ctypes.CDLL(None, use_errno=True), 'renameat2', None)
  if renameat2 is None:
    return False
  at_fdcwd, rename_exchange = -100, 2
  return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def write_file_durably(path: Path, data: bytes) -> None:
  """Write `data` to `path` so that `path` holds either the old or the whole new content."""
  with atomic_file(path) as tmp:
    tmp.write_bytes(data)


def write_json_durably(path: Path, obj: Any) -> None:
  write_file_durably(path, (json.dumps(obj, indent=1, sort_keys=False) + '\n').encode())


def read_json(path: Path) -> Any:
  try:
    with open(path, 'rb') as f:
      return json.loads(f.read())
  except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
    raise CheckpointError('E-CKPT-004', f'cannot read {path}: {e}',
                          'the file is missing or corrupt; verify the checkpoint') from e


ASIDE_MARK = '.aside-'  # `<final name>.aside-<nonce>`: a complete old version, set aside


def publish_dir(tmp: Path, path: Path) -> None:
  """Rename the complete directory `tmp` to `path`, replacing an existing `path` in one step.

  With RENAME_EXCHANGE a crash at any moment leaves the old directory or the new one at `path`,
  never neither; the old one, now at `tmp`'s name, is removed once `path.parent` is fsynced.
  Where the OS or filesystem cannot exchange (NFS, FUSE, an old libc), the old one is renamed
  aside first, to `<path>.aside-<nonce>`: a crash between the two renames leaves it there whole,
  and a reader that finds no `path` puts it back (`layout.remove_debris`, for checkpoints); a
  second rename that fails puts it back at once.

  A `path` that is a symbolic link is replaced as a name: the link goes, and the directory it
  points to is left as it is (never followed to delete what it holds).
  """
  if not os.path.lexists(path):
    os.rename(tmp, path)
    return
  if exchange(tmp, path):
    old = tmp
  else:
    old = path.with_name(f'{path.name}{ASIDE_MARK}{uuid.uuid4().hex[:12]}')
    os.rename(path, old)
    try:
      os.rename(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.rename(old, path)  # the old version back under its name
      raise
  fsync_dir(path.parent)  # the new version durably in place before the old one goes
  if old.is_symlink():  # rmtree refuses a link (and must not follow it): the link alone goes
    old.unlink(missing_ok=True)
  else:
    shutil.rmtree(old, ignore_errors=True)
