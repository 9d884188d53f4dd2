"""`jaxckpt evaluate --workdir=DIR [--follow]`: held-out loss of each committed checkpoint of a
run, recorded in `WORKDIR/evaluated.json` (`jaxckpt.evaluate`); for a remote run,
`--workdir=URL --out=FILE` keeps them in FILE."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxckpt.checkpoint import atomic
from jaxckpt.checkpoint.remote import objects
from jaxckpt.cli import remote_args
from jaxckpt.cli.parser import ArgumentParser, configure_logging
from jaxckpt.errors import UsageError
from jaxckpt.evaluate import Evaluator, read_results, read_results_file
from jaxckpt.records.provenance import load_config_file
from jaxckpt.records.workdir import EVALUATED, EvaluatorLock


def main(argv: list[str]) -> int:
  """`jaxckpt evaluate --workdir=DIR [--follow] [--poll_secs=2] [--config=PATH] [--out=FILE]`."""
  parser = ArgumentParser(
      prog='jaxckpt evaluate',
      description='Held-out loss of each committed '
      'checkpoint of a run, recorded in WORKDIR/evaluated.json.')
  parser.add_argument(
      '--workdir',
      required=True,
      help='the run directory, or the URL of a remote run (its '
      'checkpoints are downloaded to a temporary directory and evaluated there; see --out)')
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
  parser.add_argument(
      '--out',
      default=None,
      help='with a URL --workdir: the file (or directory, for DIR/evaluated.json) the results '
      'are kept in; one that exists is continued: only the checkpoints it lacks are evaluated. '
      "Default: the results are printed only. A local run's go to WORKDIR/evaluated.json")
  args = parser.parse_args(argv)
  if args.poll_secs <= 0:
    parser.error('--poll_secs must be positive')
  if remote_args.is_url(args.workdir):
    if args.follow:
      parser.error('--follow watches a local run directory, not a URL')
    return _evaluate_remote(args)
  if args.out is not None:
    parser.error(f'--out is for a remote --workdir; the results of a local run are '
                 f'{Path(args.workdir) / EVALUATED}')
  return _evaluate(Path(args.workdir), args)


def _evaluate_remote(args) -> int:
  """Evaluates a downloaded copy of the remote run; its results outlive the copy in --out."""
  run = remote_args.split(args.workdir)[0].rstrip('/')
  out = None if args.out is None else Path(args.out)
  if out is not None and out.is_dir():
    out = out / EVALUATED
  earlier = {} if out is None else read_results_file(out)
  for step, result in earlier.items():  # a file of another run's results is not continued
    if not str(result.get('path', '')).startswith(f'{run}/'):
      raise UsageError(
          'E-EVAL-005', f'{out} holds the results of another run (step {step}: '
          f'{result.get("path")})', 'pass another --out, or move that file away')
  with remote_args.local_run(args.workdir) as local:
    if earlier:
      atomic.write_json_durably(local / EVALUATED, earlier)
    try:
      # Progress names the remote checkpoints, not their temporary copies.
      return _evaluate(local, args, shown=out, say=lambda s: s.replace(f'{local}/', f'{run}/'))
    finally:  # also after a stop or a failure: what was evaluated is kept
      results = read_results(local)
      if out is not None:
        atomic.write_json_durably(
            out, {
                step: {**r, 'path': f'{run}/{objects.step_prefix(int(step)).rstrip("/")}'}
                for step, r in results.items()
            })
        print(f'{len(results)} checkpoint(s) of {run} recorded in {out}', flush=True)
      elif results:
        print(
            f'jaxckpt: the results of {run} are printed above only: pass --out=evaluated.json '
            'to keep them in a file',
            file=sys.stderr,
            flush=True)


def _evaluate(workdir: Path, args, shown: Path | None = None, say=lambda s: s) -> int:
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
    ev = Evaluator(
        workdir,
        config=config,
        log=lambda s: print(say(s), flush=True),
        warn=lambda s: print(say(s), file=sys.stderr, flush=True))
    try:
      if args.follow:
        ev.follow(args.poll_secs)
        print(f'the run in {workdir} is finished; all its checkpoints are evaluated', flush=True)
      else:
        ev.run_once()
    except KeyboardInterrupt:  # what was evaluated is recorded; a restart continues from there
      print(
          f'jaxckpt: evaluate stopped; {len(ev.results)} checkpoint(s) recorded in '
          f'{shown or workdir / EVALUATED}',
          file=sys.stderr,
          flush=True)
      return 130
  return 0
