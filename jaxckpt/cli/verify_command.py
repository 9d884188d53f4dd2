"""`jaxckpt verify CKPT|WORKDIR [--no-checksums]`: whether checkpoints are intact.

    jaxckpt verify runs/tiny                                     every checkpoint of the run
    jaxckpt verify runs/tiny/checkpoints/step_00000300 --no-checksums

Every file of a checkpoint is checked against the manifest (size and CRC-32) and the manifest
against its own checksum; exit 0 when everything is intact, 1 otherwise. It may read a run that
is still training: a checkpoint being written is skipped, and one that the writer removes or
replaces while it is read is looked at again, never failed (only damage of a checkpoint that
stays put fails). See `jaxckpt.checkpoint.discovery`. A remote checkpoint (a URL) is read whole,
every byte against its CRC-32: its listing gives no sizes to compare, so `--no-checksums` is
refused for one (exit 2) rather than reported as a check it is not.
"""

from __future__ import annotations

from pathlib import Path

from jaxckpt.checkpoint import layout
from jaxckpt.checkpoint.discovery import (DEBRIS_MARKS, MANIFEST, NOT_A_CHECKPOINT, REMOVED,
                                          UNCOMMITTED, WHY, check_live, scan)
from jaxckpt.cli import remote_args
from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.errors import UsageError


def main(argv: list[str]) -> int:
  """`jaxckpt verify CKPT|WORKDIR [--no-checksums]`: exit 0 when all is intact, else 1."""
  parser = ArgumentParser(
      prog='jaxckpt verify',
      description='Check every file of a checkpoint '
      '(or of every checkpoint of a run) against its manifest.')
  parser.add_argument(
      'path',
      help='a checkpoints/step_<n> directory, a run directory, or its '
      'checkpoints/ directory; or the URL of a remote run or checkpoint (every byte is read)')
  parser.add_argument(
      '--no-checksums',
      dest='checksums',
      action='store_false',
      help='compare sizes only (fast; misses flipped bits); a local checkpoint or run only')
  args = parser.parse_args(argv)
  if remote_args.is_url(args.path):
    if not args.checksums:
      raise UsageError(
          'E-USAGE-001', f'jaxckpt verify: --no-checksums with the URL {args.path}: a remote '
          "checkpoint is verified by reading every byte (its objects' sizes are not listed)",
          'leave out --no-checksums to verify it whole, or verify a local copy sizes only')
    return remote_args.verify(args.path)
  path = Path(args.path)
  if not path.is_dir():
    raise UsageError(
        NOT_A_CHECKPOINT, f'{path} does not exist'
        if not path.exists() else f'{path} is a file, not a checkpoint or run directory',
        'pass a checkpoints/step_<n> directory or a run directory')
  named = (path / MANIFEST).is_file()
  if named:
    status, lines = check_live(path, checksums=args.checksums)
    results = [(status, path, lines)]
  elif layout.parse_step(path.name) is not None or any(m in path.name for m in DEBRIS_MARKS):
    named, results = True, [(UNCOMMITTED, path, [WHY[UNCOMMITTED]])]
  else:
    root = path / 'checkpoints' if (path / 'checkpoints').is_dir() else path
    results = scan(root, checksums=args.checksums)
  seen, bad = 0, 0
  for status, target, lines in results:
    seen += 1
    if named and status == REMOVED:  # what was named is gone: nothing to verify, nor damaged
      raise UsageError(
          NOT_A_CHECKPOINT, f'{target} was removed while it was being verified (a '
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
