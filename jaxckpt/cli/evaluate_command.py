"""`jaxckpt evaluate --workdir=DIR [--follow]`: held-out loss of each committed checkpoint of a
run, recorded in `WORKDIR/evaluated.json` (`jaxckpt.evaluate`); for a remote run,
`--workdir=URL --out=FILE` keeps them in FILE."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from jaxckpt.checkpoint import atomic, layout
from jaxckpt.checkpoint.remote import objects
from jaxckpt.cli import config_arg, remote_args
from jaxckpt.cli.parser import ArgumentParser, configure_logging
from jaxckpt.errors import JaxckptError, UsageError
from jaxckpt.evaluate import Evaluator, read_results, read_results_file
from jaxckpt.records.workdir import EVALUATED, EvaluatorLock, checkpoints_dir

MAX_POLL_SECS = 3600  # an hour between looks: longer is a typo, not a cadence


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
      help='seconds between looks for new checkpoints (with --follow; default: %(default)g)')
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
  if not (math.isfinite(args.poll_secs) and 0 < args.poll_secs <= MAX_POLL_SECS):
    parser.error(f'--poll_secs={args.poll_secs:g}: give a number of seconds above 0 and at most '
                 f'{MAX_POLL_SECS}')
  if remote_args.is_url(args.workdir):
    if args.follow:
      parser.error('--follow watches a local run directory, not a URL')
  elif args.out is not None:
    parser.error(f'--out is for a remote --workdir; the results of a local run are '
                 f'{Path(args.workdir) / EVALUATED}')
  # Before anything is downloaded or created: a --config that does not load is a usage error.
  config = None if args.config is None else config_arg.load(args.config)
  if remote_args.is_url(args.workdir):
    return _evaluate_remote(args, config)
  return _evaluate(Path(args.workdir), args, config)


def _evaluate_remote(args, config) -> int:
  """Evaluates a downloaded copy of the remote run; its results outlive the copy in --out."""
  run = remote_args.split(args.workdir)[0].rstrip('/')
  out = None if args.out is None else _out_file(Path(args.out))
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
      return _evaluate(
          local, args, config, shown=out, say=lambda s: s.replace(f'{local}/', f'{run}/'))
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


def _out_file(out: Path) -> Path:
  """The file `--out` names (DIR/evaluated.json for a directory), checked before anything is
  downloaded or evaluated: its directory is there and can be written, and it is no directory."""
  out = out / EVALUATED if out.is_dir() else out
  parent = out.parent
  why = (f'its directory {parent} does not exist'
         if not parent.exists() else f'{parent} is not a directory'
         if not parent.is_dir() else f'{out} is a directory' if out.is_dir() else
         f'{parent} cannot be written' if not os.access(parent, os.W_OK | os.X_OK) else None)
  if why is not None:
    raise UsageError('E-EVAL-007', f'--out={out}: {why}',
                     'pass an --out file in a directory that exists and can be written')
  return out


def _evaluate(workdir: Path, args, config, shown: Path | None = None, say=lambda s: s) -> int:
  if workdir.exists() and not workdir.is_dir():
    raise UsageError('E-EVAL-003', f'{workdir} is a file, not a run directory',
                     'pass the --workdir of a run: the directory that holds its checkpoints/')
  if not workdir.is_dir():
    if not args.follow:
      raise UsageError(
          'E-EVAL-003', f'{workdir} does not exist', 'pass the --workdir of a run '
          '(or --follow to wait for a run to start there)')
    try:
      workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way (DIR/loss.jsonl/sub), or no permission
      raise UsageError('E-EVAL-003', f'{workdir} cannot be created: {e.strerror or e}',
                       'pass the --workdir of a run, or a directory --follow can create') from None
  # A directory no trainer has saved a checkpoint in: nothing to evaluate, and no lock left
  # behind in it. --follow waits for its first checkpoint instead (and says so).
  local = not remote_args.is_url(args.workdir)
  if local and not args.follow and not checkpoints_dir(workdir).is_dir():
    raise UsageError(
        'E-EVAL-003', f'{workdir} is not a run: it has no checkpoints/',
        'pass the --workdir of a run that has saved a checkpoint '
        '(or --follow to wait for its first one)')
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
      else:
        ev.run_once()
    except KeyboardInterrupt:  # what was evaluated is recorded; a restart continues from there
      print(
          f'jaxckpt: evaluate stopped; {len(ev.results)} checkpoint(s) recorded in '
          f'{shown or workdir / EVALUATED}',
          file=sys.stderr,
          flush=True)
      return 130
    failed = _not_evaluated(ev)
    found = len(set(layout.committed_steps(ev.mgr.directory)) | set(failed))
  if failed:  # each was named above, with why; a script sees the failure in the exit status
    raise JaxckptError(
        'E-EVAL-006', f'{len(failed)} of {found} committed checkpoint(s) could not be evaluated '
        f'(step{"s" if len(failed) > 1 else ""} {", ".join(map(str, failed))})',
        'the "not evaluated" lines above say why; '
        '`jaxckpt verify` on the run names each damaged file')
  if args.follow:
    print(f'the run in {workdir} is finished; all its checkpoints are evaluated', flush=True)
  return 0


def _not_evaluated(ev: Evaluator) -> list[int]:
  """The steps the evaluator found damaged and has no result for (a step a resumed run wrote
  again and that was evaluated since is not one of them)."""
  return sorted(step for step in ev.damaged if str(step) not in ev.results)
