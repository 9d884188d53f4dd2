"""`jaxckpt plot --workdir=DIR [--out=loss.png]`: the loss history as a PNG (`jaxckpt.records.plot`)."""

from __future__ import annotations

from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.records.plot import plot


def main(argv: list[str]) -> int:
  parser = ArgumentParser(
      prog='jaxckpt plot',
      description='Draw the loss history of a run as a '
      'PNG, with resumes and pivots marked.')
  parser.add_argument(
      '--workdir',
      required=True,
      help='the run directory: its loss.jsonl is drawn, with the resumes and pivots of its '
      'events.jsonl and the held-out losses (its eval events and evaluated.json)')
  parser.add_argument(
      '--out',
      help='the file to write (default: WORKDIR/loss.png); its suffix names the format (.png, '
      '.pdf, .svg, ...), a name without one gets .png, and a directory (or a name ending in /) '
      'gets loss.png in it')
  args = parser.parse_args(argv)
  if not args.workdir.strip():  # `--workdir=$RUN` with RUN unset: not the current directory
    parser.error('--workdir is empty')
  print(plot(args.workdir, args.out))  # the path written
  return 0
