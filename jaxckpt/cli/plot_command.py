"""`jaxckpt plot --workdir=DIR [--out=loss.png]`: the loss history as a PNG (`jaxckpt.records.plot`)."""

from __future__ import annotations

from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.records.plot import plot


def main(argv: list[str]) -> int:
  parser = ArgumentParser(
      prog='jaxckpt plot',
      description='Draw the loss history of a run as a '
      'PNG, with resumes and pivots marked.')
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--out', help='PNG path (default: WORKDIR/loss.png)')
  args = parser.parse_args(argv)
  print(plot(args.workdir, args.out))
  return 0
