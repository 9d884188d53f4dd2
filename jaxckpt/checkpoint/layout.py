"""Names on disk, durable writes, and discovery of committed checkpoints.

A checkpoint is the directory `step_<8+ digits>/`. It is written as `step_<n>.tmp-<nonce>/`, fsynced,
renamed to its final name, and only then is `manifest.json` written into it (temporary name, fsync,
rename, fsync of the directory). So a checkpoint is committed exactly when its manifest exists;
anything else (a `.tmp-` directory, a step directory without a manifest, a `.deleting-` directory)
is debris from a crash, never read, and removed by the next writer.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

from jaxckpt.errors import CheckpointError, ResumeError

MANIFEST = 'manifest.json'
STATE_DIR = 'state'
RUN_STATE = 'run_state.json'

_STEP_RE = re.compile(r'^step_(\d{8,})$')
_DEBRIS_RE = re.compile(r'^step_\d{8,}\.(tmp|deleting)-[0-9a-f]+$')


def step_dirname(step: int) -> str:
  return f'step_{step:08d}'


def parse_step(name: str) -> int | None:
  m = _STEP_RE.match(name)
  return int(m.group(1)) if m else None


def temporary_dir(root: Path, step: int) -> Path:
  return root / f'{step_dirname(step)}.tmp-{uuid.uuid4().hex[:12]}'


def deleting_dir(root: Path, step: int) -> Path:
  return root / f'{step_dirname(step)}.deleting-{uuid.uuid4().hex[:12]}'


def _listdir(root: Path) -> list[str]:
  """Names in `root`; a location that exists but cannot be listed is an error, never 'empty'."""
  try:
    return os.listdir(root)
  except FileNotFoundError:
    return []
  except OSError as e:
    raise ResumeError('E-RESUME-002', f'cannot list the checkpoint location {root}: '
                      f'{e.strerror or e}', 'fix the path or its permissions; refusing to start '
                      'fresh over checkpoints that may exist') from e


def committed_steps(root: Path) -> dict[int, Path]:
  """{step: directory} of every committed checkpoint under `root`, ascending."""
  found = {}
  for name in _listdir(root):
    step = parse_step(name)
    if step is not None and (root / name / MANIFEST).is_file():
      found[step] = root / name
  return dict(sorted(found.items()))


def debris(root: Path) -> list[Path]:
  """Directories a crashed writer left behind: temporary, half-deleted or uncommitted ones."""
  out = []
  for name in _listdir(root):
    path = root / name
    if _DEBRIS_RE.match(name) or (parse_step(name) is not None
                                  and not (path / MANIFEST).is_file()):
      out.append(path)
  return sorted(out)


def remove_debris(root: Path) -> list[Path]:
  removed = debris(root)
  for path in removed:
    shutil.rmtree(path, ignore_errors=True)
  if removed:
    fsync_dir(root)
  return removed


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
  except (OSError, ValueError) as e:
    raise CheckpointError('E-CKPT-004', f'cannot read {path}: {e}',
                          'the file is missing or corrupt; run `jaxckpt verify` on it') from e


def safe_member(step_dir: Path, relpath: str) -> Path:
  """`step_dir/relpath`, refusing names (from a manifest) that point outside the checkpoint."""
  path = (step_dir / relpath).resolve()
  base = step_dir.resolve()
  if relpath.startswith('/') or '..' in Path(relpath).parts or base not in path.parents:
    raise CheckpointError('E-CKPT-005', f'{step_dir}: manifest names a file outside the '
                          f'checkpoint: {relpath!r}', 'the manifest is corrupt or hostile; '
                          'do not load this checkpoint')
  return path
