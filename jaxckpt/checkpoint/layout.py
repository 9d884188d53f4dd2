"""Names on disk, and which step directories are committed checkpoints.

A checkpoint is the directory `step_<8+ digits>/`. It is written as `step_<n>.tmp-<nonce>/`, fsynced,
renamed to its final name, and only then is `manifest.json` written into it (temporary name, fsync,
rename, fsync of the directory; see `atomic`). So a checkpoint is committed exactly when its
manifest exists; anything else (a `.tmp-` directory, a step directory without a manifest, a
`.deleting-` directory) is debris from a crash, never read, and removed by the next writer.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from .atomic import fsync_dir
from .errors import ArgumentError, CheckpointError

MANIFEST = 'manifest.json'
STATE_DIR = 'state'
RUN_STATE = 'run_state.json'
# Suffixes of a file being received into a step directory by a peer restore (from a peer, from
# the remote): one a crash left behind is debris (`peers` removes it before the next).
PEER_TMP, FETCH_TMP = '.peer-tmp', '.fetch-tmp'
SUBSET = '.subset'  # + to a part's name: the tensors of it a peer restore sent this process alone

_STEP_RE = re.compile(r'^step_(\d{8,})$')
_DEBRIS_RE = re.compile(r'^step_\d{8,}\.(tmp|deleting|aside)-[0-9a-f]+$')
_ASIDE_RE = re.compile(r'^(step_\d{8,})\.aside-[0-9a-f]+$')


def subset_of(part: Path) -> Path:
  """Where the tensors of `part` a peer restore sent this process alone are kept (`SUBSET`)."""
  return part.with_name(part.name + SUBSET)


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
    raise ArgumentError(
        'E-RESUME-002', f'cannot list the checkpoint location {root}: '
        f'{e.strerror or e}', 'fix the path or its permissions (a location '
        'that cannot be listed is never taken for an empty one)') from e


def check_writable(root: Path) -> None:
  """Makes `root` and writes a file there (removed at once): ArgumentError E-CKPT-019, naming
  why, when it cannot be, so that a writer learns it before it trains, not at its first save."""
  probe = root / f'.jaxckpt-probe-{uuid.uuid4().hex[:12]}'
  try:
    root.mkdir(parents=True, exist_ok=True)
    probe.touch(exist_ok=False)
    probe.unlink()
  except OSError as e:
    raise ArgumentError('E-CKPT-019', f'the checkpoint directory {root} cannot be written: '
                        f'{e.strerror or e}',
                        'fix its permissions, or pass a directory that can be written') from None


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
    if _DEBRIS_RE.match(name) or (parse_step(name) is not None and not (path / MANIFEST).is_file()):
      out.append(path)
  return sorted(out)


def recover_aside(root: Path) -> list[Path]:
  """Puts back a committed checkpoint a replace cut short left aside (`atomic.publish_dir` where
  the filesystem cannot exchange two names): `step_<n>.aside-*` holding a manifest, when
  `step_<n>` holds none; returns the steps put back. Others aside are debris (`debris`)."""
  back = []
  for name in sorted(_listdir(root)):
    m = _ASIDE_RE.match(name)
    if not m or not (root / name / MANIFEST).is_file():
      continue
    final = root / m.group(1)
    if (final / MANIFEST).is_file():
      continue  # the new version is committed: the old one aside is debris
    if final.exists():
      shutil.rmtree(final)  # the new version, uncommitted
    os.rename(root / name, final)
    back.append(final)
  if back:
    fsync_dir(root)
  return back


def remove_debris(root: Path) -> list[Path]:
  """Removes what `debris` lists, after putting back what a cut-short replace set aside."""
  recover_aside(root)
  removed = debris(root)
  for path in removed:
    shutil.rmtree(path, ignore_errors=True)
  if removed:
    fsync_dir(root)
  return removed


_MAX_MEMBER = 1024  # characters in a member's name


def member_problem(relpath: Any) -> str | None:
  """Why `relpath` (a name read from a manifest or a bucket) cannot be a file inside a
  checkpoint, or None. A member is relative, with no empty, `.` or `..` part and no control
  character: joined to any directory, it names something inside it."""
  if not isinstance(relpath, str) or not relpath or len(relpath) > _MAX_MEMBER:
    return f'{relpath!r:.80}: not a file name'
  if relpath.startswith('/'):
    return f'{relpath!r:.80}: an absolute path'
  if any(part in ('', '.', '..') for part in relpath.split('/')):
    return f'{relpath!r:.80}: a name that leaves its directory (an empty, . or .. part)'
  if any(ord(c) < 32 or c == '\\' for c in relpath):
    return f'{relpath!r:.80}: a control character or backslash'
  return None


def safe_member(step_dir: Path, relpath: str) -> Path:
  """`step_dir/relpath`, refusing names (from a manifest) that point outside the checkpoint."""
  problem = member_problem(relpath)
  if problem is None and step_dir.resolve() not in (step_dir / relpath).resolve().parents:
    problem = f'{relpath!r:.80}: a link that leads out of it'
  if problem is not None:
    raise CheckpointError(
        'E-CKPT-005', f'{step_dir}: manifest names a file outside the '
        f'checkpoint: {problem}', 'the manifest is corrupt or hostile; '
        'do not load this checkpoint')
  return (step_dir / relpath).resolve()
