"""Finding checkpoints to read, and checking one while a live run may change it.

- `checkpoint_dir(path)`: a path as a committed checkpoint, or an error that says what it is.
- `problems(step_dir)`: what is wrong with one checkpoint ([] when intact).
- `check_live` / `scan`: the same for a run that is still writing and deleting checkpoints: one
  being written is not committed yet, one removed by retention under the reader was not damaged.
- `latest_intact(root)`: the newest committed checkpoint that passes, with the newer ones it
  passed over (a resume takes it); checkpoints the run abandoned (`abandoned`) only when nothing
  else is intact; `latest_intact_or_raise` and `intact_or_raise` refuse,
  rather than silently start over, when committed checkpoints exist but none (or not the one
  named) is intact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from . import abandoned, layout, manifest
from .errors import ArgumentError, CheckpointError

MANIFEST = layout.MANIFEST

DEBRIS_MARKS = ('.tmp-', '.deleting-')

NOT_A_CHECKPOINT = 'E-CKPT-010'


# ------------------------------------------------------------------------------- reading
def _newest_under(path: Path) -> Path | None:
  """The newest committed checkpoint in `path` or `path/checkpoints`, for a helpful error."""
  for root in (path / 'checkpoints', path):
    try:
      steps = sorted(
          p for p in root.iterdir()
          if p.name.startswith('step_') and p.name[5:].isdigit() and (p / MANIFEST).is_file())
    except OSError:
      continue
    if steps:
      return steps[-1]
  return None


def checkpoint_dir(path: str | Path) -> Path:
  """`path` as a committed checkpoint directory, or an `ArgumentError` that says what it is
  instead."""
  path = Path(path)
  if path.is_file() and path.name == MANIFEST:
    path = path.parent
  if not path.exists():
    raise ArgumentError(NOT_A_CHECKPOINT, f'{path} does not exist', 'pass a checkpoints/step_<n> '
                        'directory')
  if not path.is_dir():
    raise ArgumentError(NOT_A_CHECKPOINT, f'{path} is a file, not a checkpoint directory',
                        'pass a checkpoints/step_<n> directory')
  if any(mark in path.name for mark in DEBRIS_MARKS):
    raise ArgumentError(
        NOT_A_CHECKPOINT, f'{path} is not a complete checkpoint: it is a temporary '
        'or half-deleted directory left by a writer', 'pass a committed '
        'checkpoints/step_<n> directory (the next writer removes this one)')
  if not (path / MANIFEST).is_file():
    newest = _newest_under(path)
    fix = (f'did you mean {newest}?'
           if newest is not None else 'pass a committed checkpoints/step_<n> directory')
    what = ('is a run or checkpoints directory, not a checkpoint' if newest is not None else
            'is not a complete checkpoint: it has no manifest.json (written last, the commit '
            'marker), so its save never finished or the manifest was lost')
    raise ArgumentError(NOT_A_CHECKPOINT, f'{path} {what}', fix)
  return path


def read_manifest_bytes(step_dir: Path) -> tuple[bytes, dict[str, Any]]:
  """(manifest.json's bytes, the manifest they hold), from one read; E-CKPT-010 when the
  checkpoint was removed (a live run's retention) since it was found."""
  path = step_dir / MANIFEST
  try:
    raw = path.read_bytes()
  except OSError as e:
    if not step_dir.exists():
      raise ArgumentError(
          NOT_A_CHECKPOINT, f'{step_dir} was removed while it was being read (a live '
          'run deletes its older checkpoints after each commit)',
          'pass a newer checkpoint of the run') from e
    raise CheckpointError('E-CKPT-004', f'cannot read {path}: {e}',
                          'the file is missing or corrupt; verify the checkpoint') from e
  return raw, manifest.parse(step_dir, raw)


# -------------------------------------------------------------------------------- verify
def problems(step_dir: Path, *, checksums: bool = True) -> list[str]:
  """Problems of one checkpoint directory ([] when intact)."""
  return manifest.audit(step_dir, checksums=checksums)[1]


def _step_dirs(root: Path) -> tuple[dict[int, Path], list[Path]]:
  """({step: committed dir}, [uncommitted step dirs]) under a checkpoints directory."""
  committed = layout.committed_steps(root)
  uncommitted = [p for p in layout.debris(root) if layout.parse_step(p.name) is not None]
  return committed, uncommitted


# What a reader of a live run finds, besides OK and FAIL (each printed as SKIP).
UNCOMMITTED, REMOVED, CHANGING = 'uncommitted', 'removed', 'changing'

WHY = {
    UNCOMMITTED: 'not committed (no manifest.json): being written, or an interrupted save or a '
                 'lost manifest; never resumed from',
    REMOVED: 'removed while it was being verified, by a live writer (retention deletes older '
             'checkpoints after each commit): not damage',
    CHANGING: 'replaced by a live writer each time it was read; not checked, verify it again',
}

_LOOKS = 3  # reads of one checkpoint that keeps changing under the reader


def _identity(step_dir: Path) -> tuple | None:
  """What tells the checkpoint now under this name from another one; None once the name is gone.

  The directory's inode and ctime (a rename, or a file added or removed inside, changes it) and
  its manifest's inode, mtime and size (None: not committed).
  """
  try:
    d = os.stat(step_dir)
  except (FileNotFoundError, NotADirectoryError):
    return None
  try:
    m = os.stat(step_dir / MANIFEST)
    committed = (m.st_ino, m.st_mtime_ns, m.st_size)
  except (FileNotFoundError, NotADirectoryError):
    committed = None
  return d.st_ino, d.st_ctime_ns, committed


def check_live(step_dir: Path, *, checksums: bool = True) -> tuple[str, list[str]]:
  """(status, lines) of one checkpoint of a run that may be writing and deleting meanwhile.

  'OK' (no lines), 'FAIL' (its problems), or UNCOMMITTED, REMOVED or CHANGING (one line: why).
  Problems found while the directory changed under the reader (retention renamed it away, a
  resumed run swapped a new checkpoint in) are not damage: it is looked at again. Only a
  checkpoint that stayed put while it was read can fail.
  """
  for _ in range(_LOOKS):
    before = _identity(step_dir)
    if before is None:
      return REMOVED, [WHY[REMOVED]]
    if before[2] is None:
      return UNCOMMITTED, [WHY[UNCOMMITTED]]
    found = problems(step_dir, checksums=checksums)
    if _identity(step_dir) == before:
      return ('FAIL', found) if found else ('OK', [])
  return CHANGING, [WHY[CHANGING]]


def scan(root: Path,
         *,
         checksums: bool = True,
         rounds: int = 3) -> Iterator[tuple[str, Path, list[str]]]:
  """`check_live` of every checkpoint under a checkpoints directory, each as it is checked.

  When one was removed while it was read (a newer one committed meanwhile) or nothing was found
  (a listing that raced a commit), the directory is listed again, up to `rounds` times, and the
  checkpoints not checked yet are checked. Step directories without a manifest come last, after
  a last look: checked if they were committed since, else UNCOMMITTED.
  """
  done: set[Path] = set()
  waiting: set[Path] = set()
  for _ in range(rounds):
    committed, uncommitted = _step_dirs(root)
    waiting.update(uncommitted)
    again = not committed and not uncommitted
    for path in committed.values():
      if path in done:
        continue
      status, lines = check_live(path, checksums=checksums)
      if status == UNCOMMITTED:  # its manifest went away after the listing: see below
        waiting.add(path)
        continue
      done.add(path)
      again = again or status in (REMOVED, CHANGING)
      yield status, path, lines
    if not again:
      break
  for path in sorted(waiting - done):
    status, lines = check_live(path, checksums=checksums)
    yield status, path, lines


ABANDONED = ('abandoned: the run went back to an older checkpoint and has not replayed this step '
             f'yet ({abandoned.FILE}); kept until it does, or `jaxckpt delete` removes it')
NOT_COMMITTED = 'not committed: no manifest.json (an interrupted save, or its manifest was lost)'


def latest_intact(
    ckpt_dir: str | Path,
    *,
    checksums: bool = True,
    known_bad: Mapping[Path, str] | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
  """The newest committed checkpoint under `ckpt_dir` that passes verification.

  Returns (path or None when none passes, [(path, problem)] of the newer ones passed over,
  newest first): the caller warns for each. Step directories without a manifest that are newer
  than the one chosen are reported too (an interrupted save, or a lost manifest). A location
  that cannot be listed raises `ArgumentError` E-RESUME-002, never "no checkpoint". `known_bad`
  ({path: problem}) are checkpoints the caller found damaged itself, e.g. while loading them.
  """
  committed, uncommitted = _step_dirs(Path(ckpt_dir))
  left = abandoned.steps(Path(ckpt_dir), committed)
  candidates = sorted(
      [(s, p, ABANDONED if s in left else None) for s, p in committed.items()] +
      [(layout.parse_step(p.name), p, NOT_COMMITTED) for p in uncommitted],
      key=lambda c: c[0],
      reverse=True)
  skipped: list[tuple[Path, str]] = []
  for _, path, state in candidates:
    if state is not None:
      skipped.append((path, state))
      continue
    found = [known_bad[path]] if path in (known_bad or {}) else \
        problems(path, checksums=checksums)
    if not found:
      return path, skipped
    skipped.append((path, _summary(found)))
  # Nothing of the history the run is on is left: what it abandoned is better than nothing.
  rest: list[tuple[Path, str]] = []
  for path, why in skipped:
    if why == ABANDONED:
      found = [known_bad[path]] if path in (known_bad or {}) else \
          problems(path, checksums=checksums)
      if not found:
        return path, rest
      why = _summary(found)
    rest.append((path, why))
  return None, rest


def latest_intact_or_raise(
    ckpt_dir: str | Path,
    *,
    checksums: bool = True,
    known_bad: Mapping[Path, str] | None = None) -> tuple[Path | None, list[tuple[Path, str]]]:
  """`latest_intact`, but None (nothing to continue from) only when no checkpoint was ever
  committed; committed checkpoints none of which is intact raise `CheckpointError`
  E-RESUME-004 instead of letting the caller silently start over them."""
  path, skipped = latest_intact(ckpt_dir, checksums=checksums, known_bad=known_bad)
  damaged = [(p, why) for p, why in skipped if why != NOT_COMMITTED]
  if path is None and damaged:
    raise CheckpointError(
        'E-RESUME-004', f'none of the {len(damaged)} committed '
        f'checkpoint(s) in {ckpt_dir} is intact (newest: {damaged[0][0].name}: '
        f'{damaged[0][1]})', 'restore the damaged files, or start over in '
        'another directory')
  return path, skipped


def intact_or_raise(path: str | Path, *, checksums: bool = True) -> Path:
  """`path` if it is a committed, intact checkpoint.

  Raises `ArgumentError` E-RESUME-003 when it is not a committed checkpoint, `CheckpointError`
  E-CKPT-003 when a file does not match the manifest.
  """
  path = Path(path)
  if not (path / layout.MANIFEST).is_file() or layout.parse_step(path.name) is None:
    raise ArgumentError(
        'E-RESUME-003', f'{path} is not a committed checkpoint (a step_<n> '
        'directory with a manifest.json)', 'name a committed step_<n> directory')
  found = problems(path, checksums=checksums)
  if found:
    raise CheckpointError('E-CKPT-003', f'{path} is damaged: {_summary(found)}',
                          'take another checkpoint, or the newest intact one')
  return path


def _summary(found: list[str]) -> str:
  return found[0] + (f' (+{len(found) - 1} more)' if len(found) > 1 else '')
