"""`manifest.json`: the commit marker, and what a checkpoint is.

It lists every other file of the checkpoint with its size and CRC-32 (`checksum.crc32`, ~29 GB/s:
verifying a checkpoint costs about what reading it does), the tensor table (name, shape, dtype,
partition spec), and whatever identity the writer passes in (`metadata`).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import atomic, layout, shardtable
from .checksum import crc32
from .errors import CheckpointError

FORMAT = 'jaxckpt.checkpoint'
# 2: the shards of a checkpoint written by several processes are in `shards.json`
# (`shardtable`); 3: that table may be a grid (`shardgrid`), which a reader of 2 cannot read. A
# manifest without a shard table is still written as 1, which every version reads.
FORMAT_VERSION = 3
_CHUNK = 8 << 20


def crc32_file(path: Path, *, fsync: bool = False) -> tuple[int, str]:
  """(size, crc32 hex) of a file, read in chunks; fsyncs it on the way when asked."""
  crc, size = 0, 0
  buf = memoryview(bytearray(_CHUNK))  # one buffer for every chunk: no fresh pages per read
  with open(path, 'rb', buffering=0) as f:
    while n := f.readinto(buf):
      crc = crc32(buf[:n], crc)
      size += n
    if fsync:
      os.fsync(f.fileno())
  return size, f'{crc:08x}'


def file_table(directory: Path,
               *,
               fsync: bool = True,
               known: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
  """{relative path: {size, crc32}} for every file under `directory`; makes them durable.

  `known` entries (a writer that checksummed and fsynced a file as it wrote it) are taken as
  given instead of being read back; those not under `directory` (another process's part, on its
  own disk) are listed all the same.
  """
  table, known = {}, dict(known or {})
  for dirpath, dirnames, filenames in os.walk(directory):
    dirnames.sort()
    for name in sorted(filenames):
      path = Path(dirpath) / name
      rel = str(path.relative_to(directory))
      if rel in known:
        table[rel] = dict(known[rel])
        continue
      size, crc = crc32_file(path, fsync=fsync)
      table[rel] = {'size': size, 'crc32': crc}
    if fsync:
      atomic.fsync_dir(Path(dirpath))
  for rel in sorted(set(known) - set(table)):
    table[rel] = dict(known[rel])
  return table


def build(step: int,
          files: Mapping[str, Any],
          tensors: Iterable[Mapping[str, Any]],
          metadata: Mapping[str, Any] | None = None,
          committed_at: float | None = None) -> dict[str, Any]:
  """The manifest of checkpoint `step`; the same bytes on every process that commits it with
  the same `committed_at` (files in name order)."""
  return {
      'format': FORMAT,
      'format_version': FORMAT_VERSION if shardtable.KEY in (metadata or {}) else 1,
      'step': step,
      'committed_at': time.time() if committed_at is None else committed_at,
      'tensors': list(tensors),
      'files': dict(sorted(files.items())),
      **(dict(metadata) if metadata else {}),
  }


def read(step_dir: Path) -> dict[str, Any]:
  return read_bytes(step_dir)[1]


def read_bytes(step_dir: Path) -> tuple[bytes, dict[str, Any]]:
  """(manifest.json's bytes, the manifest they hold), from one read."""
  path = step_dir / layout.MANIFEST
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise CheckpointError('E-CKPT-004', f'cannot read {path}: {e}', _UNREADABLE) from e
  return raw, parse(step_dir, raw)


_UNREADABLE = 'the file is missing or corrupt; verify the checkpoint'


def parse(step_dir: Path, raw: bytes) -> dict[str, Any]:
  """The manifest in `raw`, the bytes of `step_dir`'s manifest.json. A reader that checks the
  seal parses the very bytes it checked: a second read could see a writer's newer file.

  Every field a reader relies on is checked for its type (`_malformed`): E-CKPT-004 naming the
  first that is wrong, never a TypeError or KeyError later in whichever reader meets it."""
  try:
    m = json.loads(raw)
  except (ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep to parse
    why = e if isinstance(e, ValueError) else 'nested too deep'
    raise CheckpointError('E-CKPT-004', f'cannot read {step_dir / layout.MANIFEST}: {why}',
                          _UNREADABLE) from e
  if not isinstance(m, dict) or m.get('format') != FORMAT:
    raise CheckpointError('E-CKPT-004', f'{step_dir}: manifest.json is not a jaxckpt manifest',
                          'point at a step_<n> directory written by jaxckpt')
  version = m.get('format_version', 0)
  if _whole(version) and version > FORMAT_VERSION:
    raise CheckpointError(
        'E-CKPT-006', f'{step_dir}: manifest format {version} is '
        f'newer than this jaxckpt understands ({FORMAT_VERSION})', 'upgrade jaxckpt')
  if problem := _malformed(m):
    seal = check_seal(raw, m)  # an edit after the commit, or a writer's own fault
    raise CheckpointError(
        'E-CKPT-004', f'{step_dir}: {layout.MANIFEST}: {problem}' + (f' ({seal})' if seal else ''),
        _UNREADABLE)
  return m


def _whole(value: Any) -> bool:
  """An int (never a bool, which JSON's true would be) >= 0."""
  return type(value) is int and value >= 0  # pylint: disable=unidiomatic-typecheck


def _text(value: Any) -> str:
  return json.dumps(value, default=str)[:60]


def _tensor_problem(field: str, rows: Any) -> str | None:
  """Why `rows` (the manifest's `field`) is not a tensor table, or None."""
  if not isinstance(rows, list):
    return f'{field} is {_text(rows)}, not a list'
  for k, row in enumerate(rows):
    where = f'{field}[{k}]'
    if not isinstance(row, dict):
      return f'{where} is {_text(row)}, not an object'
    if not isinstance(row.get('name'), str):
      return f'{where} has the name {_text(row.get("name"))}, not a string'
    shape = row.get('shape')
    if not isinstance(shape, list) or not all(_whole(n) for n in shape):
      return f'{where} ({row["name"]:.60}) has the shape {_text(shape)}, not a list of counts'
    if not isinstance(row.get('dtype'), str):
      return f'{where} ({row["name"]:.60}) has the dtype {_text(row.get("dtype"))}, not a string'
    if row.get('crc32') is not None and not isinstance(row['crc32'], str):
      return f'{where} ({row["name"]:.60}) has the crc32 {_text(row["crc32"])}, not a string'
  return None


def _malformed(m: Mapping[str, Any]) -> str | None:
  """Why manifest `m` cannot be read as one, its first field of the wrong type; None when every
  field a reader relies on is the type `build` writes. What only `jaxckpt inspect` shows is its
  own to check."""
  if 'format_version' in m and not _whole(m['format_version']):
    return f'format_version is {_text(m["format_version"])}, not a whole number'
  if not _whole(m.get('step')):
    return f'step is {_text(m.get("step"))}, not a whole number'
  at = m.get('committed_at')
  if at is not None and (type(at) not in (int, float) or not math.isfinite(at)):
    return f'committed_at is {_text(at)}, not a time'
  for field in ('tensors', 'excluded'):
    if (m.get(field) is not None or field == 'tensors') and \
        (problem := _tensor_problem(field, m.get(field))):
      return problem
  files = m.get('files')
  if not isinstance(files, dict):
    return f'files is {_text(files)}, not an object'
  for rel, want in files.items():
    if not isinstance(want, dict) or not _whole(want.get('size')) or \
        not isinstance(want.get('crc32'), str):
      return f'files[{rel!r:.80}] is {_text(want)}, not {{"size": <bytes>, "crc32": <hex>}}'
  state_files = m.get('state_files')
  if state_files is not None and (not isinstance(state_files, list)
                                  or not all(isinstance(f, str) for f in state_files)):
    return f'state_files is {_text(state_files)}, not a list of file names'
  for field in ('storage', shardtable.KEY):
    if m.get(field) is not None and not isinstance(m[field], str):
      return f'{field} is {_text(m[field])}, not a string'
  return None


def file_problems(
    step_dir: Path,
    manifest: Mapping[str, Any] | None = None,
    *,
    checksums: bool = True,
    skip_checksum: Iterable[str] = (),
    absent_ok: Iterable[str] = ()
) -> list[str]:
  """Problems found comparing the files under `step_dir` with its manifest ([] when intact).

  Files in `skip_checksum` get their size checked only (their reader checks the CRC itself);
  those in `absent_ok` may be missing (other processes' parts, on their own disks).
  """
  manifest = read(step_dir) if manifest is None else manifest
  problems, skip = [], set(skip_checksum)
  for rel, want in manifest['files'].items():
    path = layout.safe_member(step_dir, rel)
    try:
      size = path.stat().st_size
    except OSError:
      if rel not in absent_ok:
        problems.append(f'{rel}: missing')
      continue
    if size != want['size']:
      problems.append(f'{rel}: size {size}, manifest says {want["size"]}')
    elif checksums and rel not in skip and (problem := _crc_problem(path, rel, want['crc32'])):
      problems.append(problem)
  return problems


def _crc_problem(path: Path, rel: str, want: str) -> str | None:
  try:
    crc = crc32_file(path)[1]
  except FileNotFoundError:  # there when its size was read, gone now: reported, never raised
    return f'{rel}: missing'
  except OSError as e:
    return f'{rel}: unreadable ({e.strerror or e})'
  return None if crc == want else f'{rel}: checksum mismatch (crc32 {crc}, manifest says {want})'


# The manifest's own checksum. The files table protects every other file; this protects the
# manifest itself, where a flipped bit in a shape, a knob or a size would otherwise go unnoticed.
# It is the CRC-32 of the file's exact bytes with the seal's 8 hex digits written as zeros, so
# even a change that parses to the same value (`1e-05` -> `1E-05`) is caught. The writer calls
# `sealed_json(build(...))` instead of serializing the manifest itself.
SEAL = 'manifest_crc32'
_SEAL_RE = re.compile(rb'"manifest_crc32": "([0-9a-f]{8})"')
_UNSEALED = b'00000000'


def sealed_json(m: Mapping[str, Any]) -> bytes:
  """The bytes of manifest.json for `m`, ending with its own checksum."""
  text = (json.dumps({**{k: v for k, v in m.items() if k != SEAL}, SEAL: _UNSEALED.decode()},
                     indent=1) + '\n').encode()
  crc = f'{crc32(text):08x}'.encode()
  start, end = list(_SEAL_RE.finditer(text))[-1].span(1)
  return text[:start] + crc + text[end:]


def check_seal(raw: bytes, m: Mapping[str, Any]) -> str | None:
  """A problem line when manifest.json (`raw`, parsed as `m`) does not match its own checksum.

  Manifests written before sealing existed carry no seal and pass, unless a key one character
  away from the seal's name says that the seal's own name was damaged.
  """
  if SEAL not in m:
    if any(len(k) == len(SEAL) and sum(a != b for a, b in zip(k, SEAL)) == 1 for k in m):
      return f'{layout.MANIFEST}: its checksum entry is damaged'
    return None
  found = list(_SEAL_RE.finditer(raw))
  if not found or found[-1].group(1).decode() != m[SEAL]:
    return f'{layout.MANIFEST}: its checksum entry is damaged'
  start, end = found[-1].span(1)
  got = f'{crc32(raw[:start] + _UNSEALED + raw[end:]):08x}'
  if got != m[SEAL]:
    return f'{layout.MANIFEST}: checksum mismatch (crc32 {got}, manifest says {m[SEAL]})'
  return None


def commit_label(path: Path) -> str:
  """`path`'s name and its manifest's seal: two commits of one step (another history's, another
  host's copy) share the name, not the seal. A manifest from before seals gives the CRC-32 of its
  bytes; a path without one (a `.bin`) gives its name alone."""
  try:
    raw = (path / layout.MANIFEST).read_bytes()
  except OSError:
    return path.name
  return f'{path.name} ({SEAL} {seal_of(raw)})'


def seal_of(raw: bytes) -> str:
  """The seal of manifest bytes `raw` (the CRC-32 of the bytes, for one from before seals)."""
  found = list(_SEAL_RE.finditer(raw))
  return found[-1].group(1).decode() if found else f'{crc32(raw):08x}'


def audit(
    step_dir: Path,
    manifest: Mapping[str, Any] | None = None,
    *,
    checksums: bool = True,
    skip_checksum: Iterable[str] = (),
    absent_ok: Iterable[str] = ()
) -> tuple[dict[str, Any] | None, list[str]]:
  """(manifest or None, problems) of a checkpoint: its manifest readable and matching its seal,
  and every file matching the manifest (`file_problems`). Never raises for damage: it reports it.
  `manifest` is the caller's own `read` of it, when it has one."""
  try:
    raw = (step_dir / layout.MANIFEST).read_bytes()
  except OSError as e:
    return None, [
        f'{layout.MANIFEST}: missing or unreadable ({e.strerror or e}): not a '
        'committed checkpoint'
    ]
  try:
    m = parse(step_dir, raw) if manifest is None else dict(manifest)
  except CheckpointError as e:
    return None, [_within(step_dir, e.what)]
  problems = [p for p in (check_seal(raw, m),) if p]
  skip_checksum = set(skip_checksum)
  table = m.get(shardtable.KEY) is not None
  # The shard rows: in shards.json, or in the tensor rows of a format-1 manifest across processes.
  rows = checksums and (table or bool(m.get('state_files'))) and \
      shardtable.SHARDS not in skip_checksum
  if rows and table:  # its size and CRC-32 are checked with its rows, below: one read of it
    skip_checksum.add(shardtable.SHARDS)
  try:
    problems += file_problems(
        step_dir, m, checksums=checksums, skip_checksum=skip_checksum, absent_ok=set(absent_ok))
  except CheckpointError as e:
    problems.append(_within(step_dir, e.what))
  except (KeyError, TypeError, AttributeError) as e:
    problems.append(f'{layout.MANIFEST}: malformed files table ({type(e).__name__}: {e})')
  if rows and not problems:  # every byte is read: every shard row is checked
    try:
      shardtable.shard_table(step_dir, m, None)
    except CheckpointError as e:
      problems.append(_within(step_dir, e.what))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
      problems.append(f'{layout.MANIFEST}: malformed ({type(e).__name__}: {e})')
  return m, problems


def _within(step_dir: Path, what: str) -> str:
  """`what`, an error's line about `step_dir`, as a problem of it: without the directory's name
  in front, which whoever reports the problem puts there (`FAIL <dir>: <problem>`)."""
  for head in (f'{step_dir}: ', f'{step_dir}/'):
    if what.startswith(head):
      return what[len(head):]
  return what


def commit(tmp: Path,
           final: Path,
           step: int,
           known: Mapping[str, Mapping[str, Any]],
           tensors: list[dict[str, Any]],
           metadata: Mapping[str, Any],
           run_state: bytes,
           committed_at: float | None = None) -> dict[str, dict[str, Any]]:
  """Seal the written directory `tmp` (with `run_state` and a manifest covering every file) as
  checkpoint `step` at `final`, the manifest written last; returns the manifest's file table.

  Where `final` is already a checkpoint (an earlier history reached this step too) the manifest
  goes into `tmp` first, so `tmp` is a complete checkpoint under a temporary name (debris to any
  reader), and one exchange swaps the two names (`atomic.publish_dir`): never neither.
  """
  atomic.write_file_durably(tmp / layout.RUN_STATE, run_state)
  files = file_table(tmp, known=known)
  sealed = sealed_json(build(step, files, tensors, metadata, committed_at))
  try:
    if final.exists():
      atomic.write_file_durably(tmp / layout.MANIFEST, sealed)
      atomic.publish_dir(tmp, final)
      atomic.fsync_dir(final.parent)
    else:
      os.rename(tmp, final)
      atomic.fsync_dir(final.parent)
      atomic.write_file_durably(final / layout.MANIFEST, sealed)  # the commit
  except Exception as e:
    if _holds(final / layout.MANIFEST, sealed):  # in place: its durability is what failed
      raise NotConfirmed(
          'E-CKPT-001', f'{final} is in place but its durability was not confirmed: '
          f'{type(e).__name__}: {e}', 'a reader sees it committed; the next checkpoint '
          'commits again, and the disk needs checking') from e
    raise
  return files


class NotConfirmed(CheckpointError):
  """A commit whose manifest is in place, but an fsync after it failed: not known durable."""


def _holds(path: Path, data: bytes) -> bool:
  try:
    return path.read_bytes() == data
  except OSError:
    return False
