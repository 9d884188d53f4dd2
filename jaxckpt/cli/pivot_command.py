"""`jaxckpt pivot --workdir=DIR`: archive a stopped run's phase satellites (`jaxckpt.records.phases`)."""

from __future__ import annotations

from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.records.phases import pivot
from jaxckpt.records.workdir import ARCHIVE


def main(argv: list[str]) -> int:
  parser = ArgumentParser(
      prog='jaxckpt pivot',
      description='Archive the samples and bandit '
      'state of a stopped run; its next start is a new phase.')
  parser.add_argument('--workdir', required=True, help='the stopped run to pivot')
  args = parser.parse_args(argv)
  if not args.workdir.strip():  # `--workdir=$RUN` with RUN unset: not the current directory
    parser.error('--workdir is empty')
  phase, archived = pivot(args.workdir)
  print(f'pivoted {args.workdir} to phase {phase}; archived '
        f'{", ".join(archived) or "nothing"} to {ARCHIVE}/phase-{phase - 1}/. The next start '
        'resumes weights, Adam state, step and loss history with a fresh bandit.')
  return 0
