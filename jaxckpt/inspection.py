"""`jaxckpt inspect` and `jaxckpt verify`: what a checkpoint is, and whether it is intact.

    jaxckpt inspect runs/tiny/checkpoints/step_00000300          identity, knobs, every tensor
    jaxckpt inspect runs/tiny/checkpoints/step_00000300 --json   the same for scripts
    jaxckpt verify runs/tiny                                     every checkpoint of the run
    jaxckpt verify runs/tiny/checkpoints/step_00000300 --no-checksums

`inspect` reads manifest.json and nothing else: no array is loaded and jax is not imported (so it
answers in well under a second for any size of model); a manifest that does not match its own
checksum is printed with a warning. `verify` checks every file of a checkpoint against the
manifest (size and CRC-32) and the manifest against its own checksum; it exits 0 when everything
is intact and 1 otherwise. It may read a run that is still training: a checkpoint being written
is skipped, and one that the writer removes or replaces while it is read is looked at again, never
failed (only damage of a checkpoint that stays put fails). `latest_intact` is what
`--resume=latest` uses: the newest committed checkpoint that passes, with the newer ones it had to
pass over.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from jaxckpt.checkpoint import layout, manifest
from jaxckpt.errors import CheckpointError, ResumeError, UsageError

MANIFEST = layout.MANIFEST
_DEBRIS_MARKS = ('.tmp-', '.deleting-')

NOT_A_CHECKPOINT = 'E-CKPT-010'

_ITEMSIZE = {'bool': 1, 'int8': 1, 'uint8': 1, 'int16': 2, 'uint16': 2, 'float16': 2,
             'bfloat16': 2, 'int32': 4, 'uint32': 4, 'float32': 4, 'int64': 8, 'uint64': 8,
             'float64': 8, 'complex64': 8, 'complex128': 16}


class ArgumentParser(argparse.ArgumentParser):
  """argparse, but bad usage is one line `jaxckpt: E-USAGE-001: ...` and exit 2."""

  def error(self, message: str):
    raise UsageError('E-USAGE-001', f'{self.prog}: {message}', f'see `{self.prog} --help`')


# ------------------------------------------------------------------------------- reading
def _newest_under(path: Path) -> Path | None:
  """The newest committed checkpoint in `path` or `path/checkpoints`, for a helpful error."""
  for root in (path / 'checkpoints', path):
    try:
      steps = sorted(p for p in root.iterdir() if p.name.startswith('step_')
                     and p.name[5:].isdigit() and (p / MANIFEST).is_file())
    except OSError:
      continue
    if steps:
      return steps[-1]
  return None


def checkpoint_dir(path: str | Path) -> Path:
  """`path` as a committed checkpoint directory, or a `UsageError` that says what it is instead."""
  path = Path(path)
  if path.is_file() and path.name == MANIFEST:
    path = path.parent
  if not path.exists():
    raise UsageError(NOT_A_CHECKPOINT, f'{path} does not exist', 'pass a checkpoints/step_<n> '
                     'directory')
  if not path.is_dir():
    raise UsageError(NOT_A_CHECKPOINT, f'{path} is a file, not a checkpoint directory',
                     'pass a checkpoints/step_<n> directory')
  if any(mark in path.name for mark in _DEBRIS_MARKS):
    raise UsageError(NOT_A_CHECKPOINT, f'{path} is not a complete checkpoint: it is a temporary '
                     'or half-deleted directory left by a writer', 'pass a committed '
                     'checkpoints/step_<n> directory (the next writer removes this one)')
  if not (path / MANIFEST).is_file():
    newest = _newest_under(path)
    fix = (f'did you mean {newest}?' if newest is not None else
           'pass a committed checkpoints/step_<n> directory')
    what = ('is a run or checkpoints directory, not a checkpoint' if newest is not None else
            'is not a complete checkpoint: it has no manifest.json (written last, the commit '
            'marker), so its save never finished or the manifest was lost')
    raise UsageError(NOT_A_CHECKPOINT, f'{path} {what}', fix)
  return path


def read_manifest(step_dir: Path) -> dict[str, Any]:
  """manifest.json of a checkpoint (`jaxckpt.checkpoint.manifest.read`)."""
  return manifest.read(step_dir)


def read_manifest_bytes(step_dir: Path) -> tuple[bytes, dict[str, Any]]:
  """(manifest.json's bytes, the manifest they hold), from one read; E-CKPT-010 when the
  checkpoint was removed (a live run's retention) since it was found."""
  path = step_dir / MANIFEST
  try:
    raw = path.read_bytes()
  except OSError as e:
    if not step_dir.exists():
      raise UsageError(NOT_A_CHECKPOINT, f'{step_dir} was removed while it was being read (a live '
                       'run deletes its older checkpoints after each commit)',
                       'pass a newer checkpoint of the run') from e
    raise CheckpointError('E-CKPT-004', f'cannot read {path}: {e}',
                          'the file is missing or corrupt; run `jaxckpt verify` on it') from e
  return raw, manifest.parse(step_dir, raw)


def describe(step_dir: Path, m: Mapping[str, Any], raw: bytes | None = None) -> dict[str, Any]:
  """The manifest, plus: its path, each tensor's `trainable`, each parameter's flat offset, and
  with `raw` (the manifest's bytes) whether it matches its own checksum (`manifest_seal`: ok,
  absent (written before seals) or mismatch, with the problem in `warnings`)."""
  out = {'path': str(step_dir), **m}
  if raw is not None:
    problem = manifest.check_seal(raw, m)
    out['manifest_seal'] = 'mismatch' if problem else 'ok' if manifest.SEAL in m else 'absent'
    out['warnings'] = [problem] if problem else []
  params = m.get('parameters')
  trainable = {}
  if params is not None:
    rows, offset = [], 0
    for row in params:
      count = math.prod(row['shape'])
      rows.append({**row, 'offset': offset, 'size': count})
      trainable[row['path']] = row.get('trainable')
      offset += count
    out['parameters'] = rows
  tensors = []
  for t in m.get('tensors') or []:
    name = t['name']
    if name.startswith('params/'):
      flag = trainable.get(name[len('params/'):].replace('/', '.')) if params is not None else None
    else:
      flag = False  # optimizer state and counters: not parameters, never trained
    tensors.append({**t, 'trainable': flag})
  out['tensors'] = tensors
  return out


# ------------------------------------------------------------------------------- inspect
def _table(rows: list[list[str]], indent: str = '  ') -> list[str]:
  if not rows:
    return []
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return [indent + '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _bytes(t: Mapping[str, Any]) -> int | None:
  size = _ITEMSIZE.get(t.get('dtype'))
  return None if size is None else size * math.prod(t['shape'])


def _shape(shape) -> str:
  return '(' + ', '.join(str(d) for d in shape) + (',)' if len(shape) == 1 else ')')


def _warning(problem: str) -> str:
  return (f'WARNING: {problem}: the manifest was changed after it was written, so what it says '
          'may be wrong (`jaxckpt verify` fails this checkpoint)')


def render(d: Mapping[str, Any]) -> str:
  """The human-readable form of `describe(...)`."""
  # A damaged manifest's warning opens and closes the output: it must not scroll out of sight.
  warnings = [_warning(w) for w in d.get('warnings') or []]
  lines = warnings + [f'checkpoint  {d["path"]}',
           f'step        {d.get("step")}' + ('  (finished: the run\'s last step)'
                                             if d.get('finished') else '')]
  if d.get('committed_at') is not None:
    lines.append('committed   ' + time.strftime('%Y-%m-%d %H:%M:%S UTC',
                                                time.gmtime(d['committed_at'])))
  if 'seed' in d:
    lines.append(f'seed        {d["seed"]}')
  where = [f'mesh {d["mesh"]}' if d.get('mesh') is not None else '',
           f'devices {d["devices"]}' if d.get('devices') is not None else '',
           f'processes {d["processes"]}' if d.get('processes') is not None else '',
           f'platform {d["platform"]}' if d.get('platform') is not None else '']
  if any(where):
    lines.append('placement   ' + ', '.join(w for w in where if w))
  if d.get('counters'):
    lines.append('counters    ' + ', '.join(f'{k} {v}' for k, v in d['counters'].items()))
  if d.get('init_from'):
    pin = d['init_from']
    lines.append(f'init_from   {pin["path"]} ({pin["size"]:,} bytes, sha256 {pin["sha256"]})')
  if d.get('versions'):
    lines.append('versions    ' + ', '.join(f'{k} {v}' for k, v in d['versions'].items()))

  knobs = d.get('knobs')
  if knobs is None and d.get('config') is not None:  # a manifest from before knob tables
    from jaxckpt.identity import flatten_config
    knobs = {k: {'value': v, 'source': '?'} for k, v in flatten_config(d['config']).items()}
  if knobs:
    lines += ['', f'knobs ({len(knobs)})']
    lines += _table([[k, json.dumps(v['value']), v['source']] for k, v in knobs.items()])
  if d.get('sources'):
    lines += ['', f'sources ({len(d["sources"])}, sha256)']
    lines += _table([[h[:12], p] for p, h in d['sources'].items()])
  if d.get('optimizer'):
    groups: dict[tuple[str, ...], list[str]] = {}
    for param, states in d['optimizer'].items():
      groups.setdefault(tuple(states), []).append(param)
    lines += ['', 'optimizer state']
    lines += _table([[', '.join(states) or '(none)',
                      params[0] if len(params) == 1 else f'{len(params)} parameters']
                     for states, params in groups.items()])

  if d.get('parameters') is not None:
    total = sum(r['size'] for r in d['parameters'])
    lines += ['', f'parameters ({len(d["parameters"])}, {total:,} elements; offset = element '
              'offset in the flat .bin export)']
    lines += _table([['offset', 'name', 'dtype', 'shape', 'spec', 'trainable']] + [
        [f'{r["offset"]:,}', r['path'], r['dtype'], _shape(r['shape']), str(r.get('spec')),
         {True: 'yes', False: 'frozen'}.get(r.get('trainable'), '?')]
        for r in d['parameters']])
  tensors = d.get('tensors') or []
  nbytes = sum(_bytes(t) or 0 for t in tensors)
  lines += ['', f'tensors ({len(tensors)}, {nbytes:,} bytes)']
  lines += _table([['name', 'dtype', 'shape', 'spec', 'trainable']] + [
      [t['name'], t['dtype'], _shape(t['shape']), str(t.get('spec')),
       '-' if not t['name'].startswith('params/') else  # optimizer state, counters
       {True: 'yes', False: 'frozen'}.get(t['trainable'], '?')] for t in tensors])
  files = d.get('files') or {}
  lines += ['', f'files ({len(files)}, {sum(f["size"] for f in files.values()):,} bytes; '
            '`jaxckpt verify` checks them)']
  if warnings:
    lines += ['', *warnings]
  return '\n'.join(lines)


def inspect_main(argv: list[str]) -> int:
  """`jaxckpt inspect CKPT [--json]`."""
  parser = ArgumentParser(prog='jaxckpt inspect', description='Print what a checkpoint is, '
                          'from its manifest.json alone (no array is loaded).')
  parser.add_argument('checkpoint', help='a checkpoints/step_<n> directory')
  parser.add_argument('--json', action='store_true', help='one JSON object, for scripts')
  args = parser.parse_args(argv)
  step_dir = checkpoint_dir(args.checkpoint)
  raw, m = read_manifest_bytes(step_dir)
  d = describe(step_dir, m, raw)
  # Exit 0 even with a seal warning: inspect shows what a manifest says; verify judges it.
  print(json.dumps(d, indent=1) if args.json else render(d))
  return 0


# -------------------------------------------------------------------------------- verify
def check(step_dir: Path, *, checksums: bool = True) -> list[str]:
  """Problems of one checkpoint directory ([] when intact)."""
  return manifest.check(step_dir, checksums=checksums)[1]


def _step_dirs(root: Path) -> tuple[dict[int, Path], list[Path]]:
  """({step: committed dir}, [uncommitted step dirs]) under a checkpoints directory."""
  committed = layout.committed_steps(root)
  uncommitted = [p for p in layout.debris(root) if layout.parse_step(p.name) is not None]
  return committed, uncommitted


# What a reader of a live run finds, besides OK and FAIL (each printed as SKIP).
UNCOMMITTED, REMOVED, CHANGING = 'uncommitted', 'removed', 'changing'
_WHY = {
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
      return REMOVED, [_WHY[REMOVED]]
    if before[2] is None:
      return UNCOMMITTED, [_WHY[UNCOMMITTED]]
    problems = check(step_dir, checksums=checksums)
    if _identity(step_dir) == before:
      return ('FAIL', problems) if problems else ('OK', [])
  return CHANGING, [_WHY[CHANGING]]


def scan(root: Path, *, checksums: bool = True,
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


def latest_intact(ckpt_dir: str | Path, *, checksums: bool = True,
                  known_bad: Mapping[Path, str] | None = None
                  ) -> tuple[Path | None, list[tuple[Path, str]]]:
  """The newest committed checkpoint under `ckpt_dir` that passes verification.

  Returns (path or None when none passes, [(path, problem)] of the newer ones passed over,
  newest first): the caller warns for each. Step directories without a manifest that are newer
  than the one chosen are reported too (an interrupted save, or a lost manifest). A location
  that cannot be listed raises `ResumeError` E-RESUME-002, never "no checkpoint". `known_bad`
  ({path: problem}) are checkpoints the caller found damaged itself, e.g. while loading them.
  """
  committed, uncommitted = _step_dirs(Path(ckpt_dir))
  candidates = sorted([(s, p, None) for s, p in committed.items()] +
                      [(layout.parse_step(p.name), p, 'not committed') for p in uncommitted],
                      key=lambda c: c[0], reverse=True)
  skipped: list[tuple[Path, str]] = []
  for _, path, state in candidates:
    if state is not None:
      skipped.append((path, 'not committed: no manifest.json (an interrupted save, or its '
                      'manifest was lost)'))
      continue
    problems = [known_bad[path]] if path in (known_bad or {}) else \
        check(path, checksums=checksums)
    if not problems:
      return path, skipped
    skipped.append((path, problems[0] + (f' (+{len(problems) - 1} more)'
                                         if len(problems) > 1 else '')))
  return None, skipped


def latest_intact_or_raise(ckpt_dir: str | Path, *, checksums: bool = True,
                           known_bad: Mapping[Path, str] | None = None
                           ) -> tuple[Path | None, list[tuple[Path, str]]]:
  """`latest_intact`, for `--resume=latest`: None (start fresh) only when no checkpoint was ever
  committed; committed checkpoints none of which is intact raise ResumeError E-RESUME-004
  instead of silently starting over them."""
  path, skipped = latest_intact(ckpt_dir, checksums=checksums, known_bad=known_bad)
  damaged = [(p, why) for p, why in skipped if not why.startswith('not committed')]
  if path is None and damaged:
    raise ResumeError('E-RESUME-004', f'none of the {len(damaged)} committed checkpoint(s) in '
                      f'{ckpt_dir} is intact (newest: {damaged[0][0].name}: {damaged[0][1]})',
                      'see `jaxckpt verify` on the workdir; restore the files, or start over in '
                      'a new --workdir')
  return path, skipped


def verify_or_raise(path: str | Path, *, checksums: bool = True) -> Path:
  """`path` if it is a committed, intact checkpoint (for an explicit `--resume=PATH`).

  Raises ResumeError E-RESUME-003 when it is not a committed checkpoint, CheckpointError
  E-CKPT-003 when a file does not match the manifest.
  """
  path = Path(path)
  if not (path / layout.MANIFEST).is_file() or layout.parse_step(path.name) is None:
    raise ResumeError('E-RESUME-003', f'--resume={path} is not a committed checkpoint '
                      '(a step_<n> directory with a manifest.json)',
                      'use --resume=latest, --resume=none, or the path of a step_<n> directory')
  problems = check(path, checksums=checksums)
  if problems:
    raise CheckpointError('E-CKPT-003', f'{path} is damaged: {problems[0]}'
                          + (f' (+{len(problems) - 1} more)' if len(problems) > 1 else ''),
                          'resume from another checkpoint (`jaxckpt verify WORKDIR` lists the '
                          'intact ones), or --resume=latest to take the newest intact one')
  return path


def verify_main(argv: list[str]) -> int:
  """`jaxckpt verify CKPT|WORKDIR [--no-checksums]`: exit 0 when all is intact, else 1."""
  parser = ArgumentParser(prog='jaxckpt verify', description='Check every file of a checkpoint '
                          '(or of every checkpoint of a run) against its manifest.')
  parser.add_argument('path', help='a checkpoints/step_<n> directory, a run directory, or its '
                      'checkpoints/ directory')
  parser.add_argument('--no-checksums', dest='checksums', action='store_false',
                      help='compare sizes only (fast; misses flipped bits)')
  args = parser.parse_args(argv)
  path = Path(args.path)
  if not path.is_dir():
    raise UsageError(NOT_A_CHECKPOINT, f'{path} does not exist' if not path.exists() else
                     f'{path} is a file, not a checkpoint or run directory',
                     'pass a checkpoints/step_<n> directory or a run directory')
  named = (path / MANIFEST).is_file()
  if named:
    status, lines = check_live(path, checksums=args.checksums)
    results = [(status, path, lines)]
  elif layout.parse_step(path.name) is not None or any(m in path.name for m in _DEBRIS_MARKS):
    named, results = True, [(UNCOMMITTED, path, [_WHY[UNCOMMITTED]])]
  else:
    root = path / 'checkpoints' if (path / 'checkpoints').is_dir() else path
    results = scan(root, checksums=args.checksums)
  seen, bad = 0, 0
  for status, target, lines in results:
    seen += 1
    if named and status == REMOVED:  # what was named is gone: nothing to verify, nor damaged
      raise UsageError(NOT_A_CHECKPOINT, f'{target} was removed while it was being verified (a '
                       'live run deletes its older checkpoints after each commit): not damage',
                       'verify the run directory to check the checkpoints it has now')
    if status == 'OK':
      print(f'OK {target}' + ('' if args.checksums else ' (sizes only)'))
      continue
    # In a run, a checkpoint being written or removed is a SKIP; named directly, what cannot be
    # checked fails.
    failed = status == 'FAIL' or named
    bad += failed
    for line in lines:
      print(f'{"FAIL" if failed else "SKIP"} {target}: {line}')
  if not seen:
    raise UsageError(NOT_A_CHECKPOINT, f'{path} holds no checkpoint (looked in {root})',
                     'pass a checkpoints/step_<n> directory or a run directory')
  return 1 if bad else 0
