"""`jaxckpt evaluate`: the held-out loss of each committed checkpoint, in its own process.

    jaxckpt evaluate --workdir=runs/tiny             every checkpoint not yet evaluated, then exit
    jaxckpt evaluate --workdir=runs/tiny --follow    ... and keep watching for new commits; stop
                                                     after the checkpoint of the run's last step
    jaxckpt evaluate --workdir=s3://bucket/run --out=evaluated.json   a remote run; results kept

Results go to `WORKDIR/evaluated.json` (for a remote run, the `--out` file),
`{"<step>": {heldout_loss, evaluated_at, path, committed_at}}`, rewritten atomically after each
checkpoint, so each checkpoint is evaluated once, across restarts of the evaluator too (a step
whose checkpoint was re-written by a resumed run, with a new `committed_at`, is evaluated
again). The evaluator reads the weights alone (never the optimizer state) of committed
checkpoints alone (never a temporary directory), never writes or deletes a checkpoint, and
takes no lock the trainer needs; one evaluator per workdir (`evaluated.json.lock`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from jaxckpt.checkpoint import atomic, named_leaves
from jaxckpt.errors import CheckpointError, ConfigError, UsageError
from jaxckpt.export import frozen
from jaxckpt.export.offline import model_config_problem
from jaxckpt.model import gpt as model_lib
from jaxckpt.records.workdir import EVALUATED, STATUS, checkpoints_dir


def _is_params(name: str) -> bool:
  return name.startswith('params/')


def read_results(workdir: str | os.PathLike) -> dict[str, dict[str, Any]]:
  return read_results_file(Path(workdir) / EVALUATED)


def read_results_file(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
  """The results in an `evaluated.json` file ({} when there is none)."""
  fix = 'move it away; the evaluator then evaluates every checkpoint again'
  try:
    results = json.loads(Path(path).read_bytes())
  except FileNotFoundError:
    return {}
  except OSError as e:  # a directory, no permission, a failing disk
    raise UsageError('E-EVAL-002', f'{path} cannot be read: {e.strerror or e}', fix) from None
  except (ValueError, RecursionError) as e:  # written atomically: only a foreign hand damages it
    raise UsageError('E-EVAL-002', f'{path} is not valid JSON ({str(e)[:80]})', fix) from None
  # Keys are steps (sorted as numbers when the file is rewritten), values objects.
  if not isinstance(results, dict) or not all(
      isinstance(v, dict) and re.fullmatch(r'[0-9]{1,20}', k) for k, v in results.items()):
    raise UsageError('E-EVAL-002', f'{path} is not an evaluated.json ({{"<step>": {{...}}}})', fix)
  return results


class Evaluator:
  """Evaluates the committed checkpoints of one run that `evaluated.json` does not have yet.

  Each checkpoint is evaluated with the config recorded in its manifest.

  Args:
    workdir: the run's directory (checkpoints under `workdir/checkpoints`).
    config: a ConfigDict supplying the fields a checkpoint's config lacks (older versions).
    log, warn: where progress lines and warnings go.
  """

  def __init__(self,
               workdir: str | os.PathLike,
               *,
               config=None,
               log: Callable[[str], None] = print,
               warn: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)):
    from jaxckpt.checkpoint import CheckpointManager  # jax: only once we evaluate
    _check_config(config)
    self.workdir = Path(workdir)
    self.mgr = CheckpointManager(checkpoints_dir(self.workdir), writer=False)
    self.config, self.log, self.warn = config, log, warn
    self.results = read_results(self.workdir)
    self._trainers: dict[str, Any] = {}
    self._failed: set[tuple[int, Any]] = set()  # (step, committed_at) of damaged ones: warned once

  # -------------------------------------------------------------------------- the model
  def _trainer_and_data(self, saved_config: dict[str, Any]):
    import ml_collections

    from jaxckpt.model import data as data_lib
    base = self.config.to_dict() if self.config is not None else {}
    config = ml_collections.ConfigDict(_merge(base, saved_config))
    problem = model_config_problem(config.get('model', {}), complete=False)
    if problem:  # each part was checked: only the two together can be wrong
      raise ConfigError('E-CONFIG-001',
                        f"the checkpoint's model config with --config's fields: {problem}",
                        "pass a --config whose model fits the checkpoint's")
    key = _eval_key(config)
    if key not in self._trainers:
      self._trainers.clear()  # one model in memory at a time
      try:
        self._trainers[key] = (_build_trainer(config), data_lib.from_config(config))
      except (AttributeError, KeyError) as e:
        raise UsageError(
            'E-EVAL-004', f"the checkpoint's config lacks a field this jaxckpt "
            f'needs ({e}); it was written by an older version',
            'pass --config=configs/<its config>.py: the file supplies the fields '
            'the checkpoint does not have') from e
    return self._trainers[key]

  # ------------------------------------------------------------------------ the results
  @property
  def damaged(self) -> set[int]:
    """The steps passed over as damaged (each warned of once)."""
    return {step for step, _ in self._failed}

  def _skip(self, step: int, committed_at: Any, why: str) -> None:
    if (step, committed_at) not in self._failed:
      self._failed.add((step, committed_at))
      self.warn(f'jaxckpt: step {step}: not evaluated: {why}')

  def pending(self) -> list[tuple[int, Path, dict[str, Any]]]:
    """(step, directory, manifest) of the committed checkpoints not evaluated yet, ascending."""
    out = []
    for step, path in _committed(self.mgr.directory).items():
      try:
        meta = self.mgr.read_manifest(path)
      except (CheckpointError, OSError) as e:
        if path.exists():  # else deleted by retention since it was listed
          self._skip(step, None, str(e))
        continue
      done = self.results.get(str(step))
      if done is not None and done.get('committed_at') == meta.get('committed_at'):
        continue
      if (step, meta.get('committed_at')) not in self._failed:
        out.append((step, path, meta))
    return out

  def evaluate(self, step: int, path: Path, meta: dict[str, Any]) -> float | None:
    """The held-out loss of one checkpoint, recorded; None when it vanished or is damaged."""
    from jaxckpt.train import state as trainer_lib
    problem = _saved_config_problem(meta.get('config'))
    if problem:  # a foreign or hand-edited manifest: that checkpoint cannot be evaluated
      self._skip(step, meta.get('committed_at'), f'E-CKPT-004: {path}/manifest.json: {problem}')
      return None
    trainer, dataset = self._trainer_and_data(meta.get('config') or {})
    abstract = trainer.abstract_state().params
    excluded = {t['name'] for t in meta.get('excluded') or []}
    # Flat targets by checkpoint name, without what the checkpoint left out (frozen, from file).
    target = {n: x for n, x in named_leaves({'params': abstract}).items() if n not in excluded}
    try:
      flat, _ = self.mgr.restore(path, target, only=_is_params)
      from_file = frozen.read_excluded(path, meta)
    # What reading files that vanish can raise: jaxckpt's own errors, the OS's, and tensorstore's
    # (ValueError, for an orbax checkpoint). Anything else is a bug, raised whatever happened.
    except (CheckpointError, OSError, ValueError) as e:
      if not path.exists():  # retention renames before it deletes: gone, not damaged
        self.warn(f'jaxckpt: step {step}: {path} was deleted (retention) before it could be '
                  'evaluated; skipped')
        return None
      if not isinstance(e, CheckpointError):
        raise
      # What and where only: the restore's fix (resume from another checkpoint) is a trainer's;
      # the run's end (E-EVAL-006) says what to do about a damaged checkpoint.
      self._skip(step, meta.get('committed_at'), f'{e.code}: {e.what}')
      return None
    dotted = {'.'.join(n.split('/')[1:]): x for n, x in flat.items()}
    params = model_lib.unflatten_params({**dotted, **from_file}, abstract)
    loss = trainer_lib.evaluate(trainer, params, dataset)
    self.results[str(step)] = {
        'heldout_loss': loss, 'evaluated_at': time.time(), 'path': str(path),
        'committed_at': meta.get('committed_at')
    }
    atomic.write_json_durably(self.workdir / EVALUATED,
                              dict(sorted(self.results.items(), key=lambda kv: int(kv[0]))))
    self.log(f'step {step}: heldout_loss {loss:.6f}  ({path})')
    return loss

  def run_once(self) -> tuple[list[int], bool]:
    """Evaluate everything pending. Returns (steps evaluated, whether the run is finished and
    its last checkpoint evaluated)."""
    done = []
    for step, path, meta in self.pending():
      if self.evaluate(step, path, meta) is not None:
        done.append(step)
    return done, self.finished()

  def finished(self) -> bool:
    """The newest committed checkpoint says `finished` and has been evaluated."""
    steps = _committed(self.mgr.directory)
    if not steps:
      return False
    step = max(steps)
    try:
      meta = self.mgr.read_manifest(steps[step])
    except (CheckpointError, OSError):
      # A manifest that cannot be read says nothing: the run's status says whether it ended
      # there (a finished run writes no other checkpoint to wait for).
      return (step, None) in self._failed and self._ended_at(step)
    done = self.results.get(str(step))
    evaluated = done is not None and done.get('committed_at') == meta.get('committed_at')
    # A damaged last checkpoint is done with too (warned of, and named at the end): waiting for
    # it would wait forever, as a finished run writes no other.
    return bool(meta.get('finished')) and (evaluated or
                                           (step, meta.get('committed_at')) in self._failed)

  def _ended_at(self, step: int) -> bool:
    """The run's `status.json` says it finished at `step`."""
    try:
      status = json.loads((self.workdir / STATUS).read_bytes()[:1 << 20])
    except (OSError, ValueError, RecursionError):
      return False
    return isinstance(status,
                      dict) and status.get('state') == 'finished' and status.get('step') == step

  def follow(self, poll_secs: float = 2.0, sleep: Callable[[float], None] = time.sleep) -> None:
    """Evaluate new commits as they appear; return after the run's finished checkpoint."""
    waiting_said = False
    while True:
      _, finished = self.run_once()
      if finished:
        return
      if not waiting_said:
        self.log(f'waiting for new checkpoints in {self.mgr.directory} (every {poll_secs:g} s)')
        waiting_said = True
      sleep(poll_secs)


def _check_config(config) -> None:
  """A --config (the fields a checkpoint's config lacks): a ConfigDict, its model's fields usable
  (UsageError, exit 2, before anything is read)."""
  if config is None:
    return
  if not hasattr(config, 'to_dict'):
    raise UsageError(
        'E-USAGE-001', f'--config: get_config() returned {type(config).__name__}, '
        'not a ConfigDict', 'pass a configs/<name>.py file')
  problem = model_config_problem(config.get('model', {}), complete=False)
  if problem:
    raise ConfigError('E-CONFIG-001', f'--config: {problem}', 'fix config.model in the file')


def _saved_config_problem(saved: Any) -> str | None:
  """What is wrong with a manifest's `config`, or None (fields it lacks come from --config)."""
  if saved is None:
    return None
  if not isinstance(saved, dict):
    return f'config is {type(saved).__name__}, not an object'
  for section in ('model', 'data', 'train', 'mesh'):
    if section in saved and not isinstance(saved[section], dict):
      return f'config.{section} is {type(saved[section]).__name__}, not an object'
  return model_config_problem(saved.get('model', {}), complete=False)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
  """`base` with every field of `over` (recursively) put over it."""
  out = dict(base)
  for k, v in over.items():
    out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def _committed(ckpt_dir: Path) -> dict[int, Path]:
  from jaxckpt.checkpoint import layout
  return layout.committed_steps(ckpt_dir)


def _eval_key(config) -> str:
  """What the evaluated loss depends on: a knob like train.steps must not rebuild or recompile."""
  d = config.to_dict()
  t = d.get('train', {})
  return json.dumps([
      d.get('model'),
      d.get('data'),
      d.get('mesh'),
      d.get('seed'),
      t.get('batch_size'),
      t.get('eval_batches')
  ],
                    sort_keys=True,
                    default=str)


def _build_trainer(config):
  """A trainer on this machine's devices: the run's mesh when it fits, else one device."""
  import jax

  from jaxckpt.train import state as trainer_lib
  if _mesh_fits_here(config):
    return trainer_lib.build_trainer(config)
  config.mesh.data, config.mesh.model = 1, 1
  return trainer_lib.build_trainer(config, devices=jax.devices()[:1])


def _mesh_fits_here(config) -> bool:
  """Whether the run's mesh can be made from this process's devices and splits its model and
  batch evenly: false for a run written on more devices than this process has, or whose `-1`
  axis spans more devices here than its batch or model splits over."""
  from jaxckpt.model import sharding
  try:
    sharding.check_divisible(config.model, config.train.batch_size, sharding.make_mesh(config.mesh))
  except ConfigError:  # E-CONFIG-002 or -003, the only errors of these two checks
    return False
  return True
