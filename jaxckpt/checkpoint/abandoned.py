"""The checkpoints a run left behind when it went back to an older one: `abandoned.json`.

A run that continues from step R while committed checkpoints numbered above R exist (an explicit
older checkpoint) abandons them. They stay on disk: nothing here deletes, and the replay replaces
each one as it reaches its step. Until it does, none of them is the newest checkpoint: a stop or
a crash before the replay gets there resumes the history the run is on, not the abandoned one.

`record(root, R)` (`CheckpointManager.continue_from`) writes their steps and seals, durably,
before the first step; `steps(root)` is what is still abandoned: a step the replay rewrote has
another seal and counts again (the record goes once none is left: `left`, after each commit).
`discovery.latest_intact` passes over them; retention does not count them in `keep`, and
deletes those below the step just committed (the replay passed them without saving them again)
unless their manifests keep them. The record is this directory's:
a checkpoint copied elsewhere carries no word of it; a remote tier keeps its own
(`remote.abandoned`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Mapping

from . import atomic, layout, manifest

FILE = 'abandoned.json'
MAX_BYTES = 1 << 20  # a step and a seal per checkpoint: far below this
_log = logging.getLogger(__name__)


def seal(step_dir: Path) -> str | None:
  """The seal of the manifest in `step_dir`; None when it cannot be read."""
  try:
    return manifest.seal_of((step_dir / layout.MANIFEST).read_bytes())
  except OSError:
    return None


def record(root: Path, step: int) -> dict[int, str]:
  """Records the committed checkpoints under `root` above `step` as abandoned ({step: seal}),
  with what the record already names but was not replaced: a step the replay skipped is still
  abandoned, and one deleted here may still be in `--remote`. `step` itself, the checkpoint the
  run continues from, is not. Returns the record; none left: removed."""
  committed = layout.committed_steps(root)
  gone = _unreplaced(_read(root)[1], committed)
  gone.pop(step, None)
  gone.update({s: seal(p) for s, p in committed.items() if s > step})
  gone = {s: sl for s, sl in sorted(gone.items()) if sl is not None}
  _write(root, step, gone)
  return gone


def _unreplaced(table: Mapping[int, str], committed: Mapping[int, Path]) -> dict[int, str]:
  """The entries of `table` not committed again with another seal (gone here, or the same)."""
  return {s: sl for s, sl in table.items() if s not in committed or seal(committed[s]) == sl}


def _write(root: Path, step: int, gone: Mapping[int, str]) -> None:
  path = root / FILE
  if gone:
    atomic.write_json_durably(path, encode(step, gone))
  elif path.exists():
    path.unlink()
    atomic.fsync_dir(root)


def recorded(root: Path) -> dict[int, str]:
  """{step: seal} of the record; {} when there is none. A record that is not one a writer gives
  is ignored, with a warning: the abandoned checkpoints are then candidates again, as they were
  before it, and nothing is deleted for it."""
  return _read(root)[1]


def _read(root: Path) -> tuple[int, dict[int, str]]:
  """(the step the run went back to, `recorded`'s table)."""
  path = root / FILE
  try:
    with open(path, 'rb') as f:
      raw = f.read(MAX_BYTES + 1)
  except FileNotFoundError:
    return 0, {}
  except OSError as e:
    _log.warning('cannot read %s (%s): checkpoints it names are not passed over', path, e)
    return 0, {}
  return parse(raw, str(path))


def parse(raw: bytes, where: str) -> tuple[int, dict[int, str]]:
  """(the step the run went back to, {step: seal}) of a record's bytes, read from `where`; one
  that is not a record a writer gives (over MAX_BYTES, not JSON, a name that is no step, a seal
  that is no string) is (0, {}), with a warning: nothing is passed over for it."""
  try:
    found = json.loads(raw) if len(raw) <= MAX_BYTES else None
    table = found.get('abandoned') if isinstance(found, Mapping) else None
    out = {int(s): sl for s, sl in table.items() if isinstance(sl, str)}
    if len(out) == len(table) and all(s >= 0 for s in out):
      step = found.get('from_step')
      return (step if type(step) is int else 0), out  # pylint: disable=unidiomatic-typecheck
  except (ValueError, RecursionError, AttributeError, TypeError):
    pass
  _log.warning('%s is not a record of abandoned checkpoints: ignored', where)
  return 0, {}


def encode(step: int, gone: Mapping[int, str]) -> dict:
  """The record of the checkpoints `gone` ({step: seal}) a run abandoned going back to `step`."""
  return {'from_step': step, 'abandoned': {str(s): sl for s, sl in sorted(gone.items())}}


def steps(root: Path, committed: Mapping[int, Path] | None = None) -> set[int]:
  """The committed steps under `root` still abandoned: named by the record, with the same seal."""
  table = recorded(root)
  if not table:
    return set()
  committed = layout.committed_steps(root) if committed is None else committed
  return {s for s in _unreplaced(table, committed) if s in committed}


def forget(root: Path, gone: set[int]) -> None:
  """Drops the entries of `gone` that are not committed here (the remote tier no longer holds
  them with the recorded seal): a record that names only what nothing holds any more goes."""
  step, table = _read(root)
  committed = layout.committed_steps(root)
  kept = {s: sl for s, sl in table.items() if s not in gone or s in committed}
  if kept != table:
    _write(root, step, kept)


def left(root: Path, committed: Mapping[int, Path]) -> set[int]:
  """`steps`, for the writer after a commit. An entry goes from the record once its step is
  committed again with another seal (the replay replaced it); one whose checkpoint was deleted
  here stays, as `--remote` may still hold it (`forget` drops it once the remote does not). None
  left: the record goes."""
  step, table = _read(root)
  if not table:
    return set()
  kept = _unreplaced(table, committed)
  if kept != table:
    try:
      _write(root, step, kept)
    except OSError:
      pass  # the entries are checked by seal whenever they are read: stale ones do no harm
  return {s for s in kept if s in committed}
