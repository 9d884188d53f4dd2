"""The `jaxckpt` command: tools that work on a run directory or a checkpoint.

Developer notes (not printed: `USAGE` is what a user sees). Each subcommand lives in its own
module (`jaxckpt/cli/<name>_command.py`, a `main(argv)`), and is imported only when used: jax is
slow to import, and `inspect` never needs it. A URL is a remote run or checkpoint (s3://, gs://,
file://; `remote_args`). The trainer's own entry point is `python -m jaxckpt.main`; `python -m
jaxckpt` and `python -m jaxckpt.cli` run this command, as the `jaxckpt` console script does.
"""

from __future__ import annotations

import importlib
import sys

from jaxckpt.cli import parser

COMMANDS = ('inspect', 'verify', 'export', 'evaluate', 'pivot', 'plot', 'delete')

USAGE = """\
usage: jaxckpt <command> [flags]

Tools for a run directory or a checkpoint (CKPT: a checkpoints/step_<n> directory; URL: an
s3://, gs:// or file:// run or checkpoint).

commands:
  inspect   CKPT|URL [--json]                   identity, step and every tensor (no array loaded)
  verify    CKPT|WORKDIR|URL [--no-checksums]   every file against its manifest
  export    CKPT|URL|FILE.bin --format=safetensors|hf|bin --out=PATH   weights for other tools
  evaluate  --workdir=DIR|URL [--follow]        the held-out loss of each committed checkpoint
  pivot     --workdir=DIR                       archive a stopped run's samples and bandit state
  plot      --workdir=DIR [--out=loss.png]      the loss history as a PNG
  delete    CKPT [--kept] [--newest]            delete one committed checkpoint of a stopped run

`jaxckpt <command> --help` lists a command's flags. The trainer: `python -m jaxckpt.main --help`.
"""


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ('-h', '--help', 'help'):
    print(USAGE, end='')
    return 0
  if not argv:  # no command: what there is to run, and a usage error's status
    print(USAGE, end='', file=sys.stderr)
    return 2
  if argv[0] not in COMMANDS:
    print(
        f'jaxckpt: E-USAGE-002: unknown command {argv[0]!r}; one of: {", ".join(COMMANDS)}',
        file=sys.stderr)
    return 2
  command = importlib.import_module(f'{__name__}.{argv[0]}_command').main
  return parser.run_reporting_errors(lambda: command(argv[1:]))
