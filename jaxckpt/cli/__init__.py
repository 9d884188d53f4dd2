"""The `jaxckpt` command: tools that work on a run directory or a checkpoint.

    jaxckpt inspect  CKPT|URL [--json]      identity, step and every tensor, without loading arrays
    jaxckpt verify   CKPT|WORKDIR|URL       every file against its manifest
    jaxckpt export   CKPT|URL|FILE.bin --format=safetensors|hf|bin --out=PATH
    jaxckpt evaluate --workdir=DIR|URL [--follow]
    jaxckpt pivot    --workdir=DIR          archive the phase's satellites; the next start is a new phase
    jaxckpt delete   CKPT [--kept]          delete one checkpoint (--kept: one its manifest keeps)
    jaxckpt plot     --workdir=DIR [--out=loss.png]

Each subcommand lives in its own module (`jaxckpt/cli/<name>_command.py`, a `main(argv)`), and is
imported only when used: jax is slow to import, and `inspect` never needs it. A URL is a remote
run or checkpoint (s3://, gs://, file://; `remote_args`). The trainer's own entry point is
`python -m jaxckpt.main`.
"""

from __future__ import annotations

import importlib
import sys

from jaxckpt.cli import parser

COMMANDS = ('inspect', 'verify', 'export', 'evaluate', 'pivot', 'plot', 'delete')


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ('-h', '--help', 'help'):
    print(__doc__.strip())
    return 0
  if argv[0] not in COMMANDS:
    print(
        f'jaxckpt: E-USAGE-002: unknown command {argv[0]!r}; one of: {", ".join(COMMANDS)}',
        file=sys.stderr)
    return 2
  command = importlib.import_module(f'{__name__}.{argv[0]}_command').main
  return parser.run_reporting_errors(lambda: command(argv[1:]))
