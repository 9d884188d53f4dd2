"""`jaxckpt evaluate --workdir=DIR [--follow]`: held-out loss of each committed checkpoint of a
run, recorded in `WORKDIR/evaluated.json` (`jaxckpt.evaluate`)."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxckpt.cli import remote_args
from jaxckpt.cli.parser import ArgumentParser, configure_logging
from jaxckpt.errors import UsageError
from jaxckpt.evaluate import Evaluator
from jaxckpt.records.provenance import load_config_file
from jaxckpt.records.workdir import EVALUATED, EvaluatorLock


def main(argv: list[str]) -> int:
  """`jaxckpt evaluate --workdir=DIR [--follow] [--poll_secs=2] [--config=PATH]`."""
  parser = ArgumentParser(
      prog='jaxckpt evaluate',
      description='Held-out loss of each committed '
      'checkpoint of a run, recorded in WORKDIR/evaluated.json.')
  parser.add_argument(
      '--workdir',
      required=True,
      help='the run directory, or the URL of a remote run (its '
      'checkpoints are downloaded to a temporary directory and evaluated there)')
  parser.add_argument(
      '--follow',
      action='store_true',
      help='keep watching for new '
      "checkpoints; stop after the one of the run's last step")
  parser.add_argument(
      '--poll_secs',
      type=float,
      default=2.0,
      help='seconds between looks for '
      'new checkpoints (with --follow)')
  parser.add_argument(
      '--config',
      default=None,
      help="a config file that supplies the fields a "
      "checkpoint's own config lacks (one written by an older jaxckpt)")
  args = parser.parse_args(argv)
  if args.poll_secs <= 0:
    parser.error('--poll_secs must be positive')
  if remote_args.is_url(args.workdir):
    if args.follow:
      parser.error('--follow watches a local run directory, not a URL')
    with remote_args.local_run(args.workdir) as local:
      return _evaluate(local, args)
  return _evaluate(Path(args.workdir), args)


def _evaluate(workdir: Path, args) -> int:
  if not workdir.is_dir():
    if not args.follow:
      raise UsageError(
          'E-EVAL-003', f'{workdir} does not exist', 'pass the --workdir of a run '
          '(or --follow to wait for a run to start there)')
    workdir.mkdir(parents=True, exist_ok=True)
  config = None
  if args.config is not None:
    config = load_config_file(args.config)
  configure_logging()
  with EvaluatorLock(workdir):
    ev = Evaluator(workdir, config=config, log=lambda s: print(s, flush=True))
    try:
      if args.follow:
        ev.follow(args.poll_secs)
        print(f'the run in {workdir} is finished; all its checkpoints are evaluated', flush=True)
      else:
        ev.run_once()
    except KeyboardInterrupt:  # what was evaluated is recorded; a restart continues from there
      print(
          f'jaxckpt: evaluate stopped; {len(ev.results)} checkpoint(s) recorded in '
          f'{workdir / EVALUATED}',
          file=sys.stderr,
          flush=True)
      return 130
  return 0
