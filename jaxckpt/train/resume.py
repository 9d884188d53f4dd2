"""Where a start continues from, and the state it continues with.

`find_resume_point` turns `--resume` (latest | none | PATH | FILE.bin) into a checkpoint to
continue from, or None for a fresh start; `start` builds the initial state and bandit: fresh
(with `init_from`'s weights when configured), restored from a checkpoint after the identity
check, or read from a `.bin`. A checkpoint found damaged while it is restored is passed over for
the next newest, as `latest` passes over one whose manifest or sizes are wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import jax
import numpy as np
from absl import logging

from jaxckpt.checkpoint import (ArgumentError, CheckpointError, discovery, layout, manifest,
                                named_leaves)
from jaxckpt.errors import ResumeError
from jaxckpt.hosts import distributed
from jaxckpt.model import bandit as bandit_lib
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names
from jaxckpt.records import identity, phases
from jaxckpt.records.provenance import DATA_KEY
from jaxckpt.records.runlog import RunLog
from jaxckpt.train import init_from as init_from_lib
from jaxckpt.train.bin_resume import restore_from_bin
from jaxckpt.train.session import Session
from jaxckpt.train.state import TrainState, make_schedule


def find_resume_point(resume: str,
                      ckpt_dir: Path,
                      known_bad: Mapping[Path, str] | None = None) -> Path | None:
  """The committed checkpoint directory (or `.bin` file) to continue from; None: a fresh start.

  `latest`: the newest committed checkpoint, or a fresh start when there is none.
  `none`: a fresh start, refused when checkpoints exist (it would fork the run's history).
  `PATH.bin`: a raw `step_NNNNNN.bin` export (weights, Adam m and v; see `jaxckpt.train.bin_resume`).
  anything else: the path of a committed `step_<n>` directory.

  The checkpoint's files are checked here for presence, sizes and the manifest's seal; their
  checksums are checked by the restore, while it reads them: the data is read once, not twice.
  `known_bad` ({path: problem}) are checkpoints that failed that check: `latest` passes over them.
  """
  if resume.endswith('.bin'):
    if not Path(resume).is_file():
      raise ResumeError('E-BIN-003', f'cannot read --resume={resume}: no such file',
                        'check the path of the .bin file')
    return Path(resume)
  if resume == 'latest':
    # The newest checkpoint that passes verification; a damaged newer one is passed over.
    try:
      path, skipped = discovery.latest_intact_or_raise(
          ckpt_dir, checksums=False, known_bad=known_bad)
    except CheckpointError as e:
      if e.code != 'E-RESUME-004':  # none intact (E-RESUME-002, an unlistable location, passes)
        raise
      raise ResumeError(
          e.code, e.what, 'see `jaxckpt verify` on the workdir; restore the '
          'files, or start over in a new --workdir') from None
    for bad, problem in skipped:
      if bad not in (known_bad or {}):  # those were warned about when they failed
        logging.warning('passing over %s: %s', bad, problem)
    return path
  if resume == 'none':
    steps = layout.committed_steps(ckpt_dir)
    if steps:
      raise ResumeError(
          'E-RESUME-001', f'--resume=none but {ckpt_dir} already holds committed '
          f'checkpoints (steps {min(steps)}..{max(steps)}); starting fresh would '
          "silently fork the run's history", 'use --resume=latest to continue, '
          'or a new --workdir to start over')
    return None
  # An explicit PATH that fails is an error, here or (a checksum) when it is loaded.
  try:
    return discovery.intact_or_raise(resume, checksums=False)
  except ArgumentError as e:
    raise ResumeError(
        e.code, f'--resume={resume} is not a committed checkpoint (a step_<n> '
        'directory with a manifest.json)', 'use --resume=latest, --resume=none, '
        'or the path of a step_<n> directory') from None
  except CheckpointError as e:
    raise CheckpointError(
        e.code, e.what, 'resume from another checkpoint (`jaxckpt verify '
        'WORKDIR` lists the intact ones), or --resume=latest to take the newest '
        'intact one') from None


def start(session: Session, resume: str, resume_dir: Path | None) -> tuple[TrainState, int]:
  """(initial state, step) of this start, from `resume_dir` (`find_resume_point(resume)`).

  With --resume=latest, a checkpoint whose data fails its checksum while it is being restored is
  passed over (with a warning) for the next newest, as a damaged manifest would be.
  """
  # Every process builds the same global batch from its own copy of the data: the same files.
  data = {
      k: v for k, v in (session.identity.get('sources') or {}).items() if k.startswith(DATA_KEY)
  }
  distributed.agree('data', json.dumps(data, sort_keys=True),
                    "the training data (each source's files: count, sizes, both ends)",
                    'give every host the same data files (the same paths, sizes and bytes)')
  known_bad: dict[Path, str] = {}
  while True:
    try:
      started, problem = _start_from(session, resume_dir), None
    except CheckpointError as e:
      # Damage found while reading: data that fails its checksum, a state file whose header lies.
      if resume != 'latest' or resume_dir is None or e.code not in ('E-CKPT-003', 'E-CKPT-012'):
        raise
      started, problem = None, e.what
    # Across processes each one read its own shards: all pass over what any one found damaged.
    problem = distributed.first_problem(f'resume/{len(known_bad)}', problem)
    if problem is None:
      return started
    # Keyed as `latest` lists them (under the manager's absolute directory): a relative
    # --workdir's checkpoint is not read a second time under its other name.
    bad = resume_dir.absolute()
    replaced = None if bad in known_bad else _from_remote(session, resume_dir)
    known_bad[bad] = problem
    if replaced is None:
      logging.warning('passing over %s: %s', resume_dir, problem)
    # Across processes: one that cannot choose stops them all, and all must choose the same.
    resume_dir = replaced or distributed.together(
        f'resume/{len(known_bad)}/point',
        lambda: find_resume_point(resume, session.mgr.directory, known_bad))
    distributed.agree(f'resume/{len(known_bad)}/seal',
                      str(resume_dir and manifest.commit_label(resume_dir)),
                      'the checkpoint to resume from, past a damaged one')


def _from_remote(session: Session, path: Path) -> Path | None:
  """The remote's intact copy of the damaged local checkpoint `path`, downloaded over it, or
  None (no --remote, or none there). One process only: across processes each holds its own
  shards, and a damaged one falls back to an older checkpoint, as without --remote."""
  if session.remote is None or distributed.current().count > 1:
    return None
  return session.remote.replace_damaged(path, session.mgr.directory)


_RETENTION_KNOBS = ('checkpoint.keep', 'checkpoint.keep_every', 'checkpoint.keep_best')


def _is_retention(change: str) -> bool:
  """Whether a line of `identity.compare` is a changed --keep, --keep_every or --keep_best."""
  return change.startswith('knob ') and change.split(' ')[1] in _RETENTION_KNOBS


_SCHEDULE = ('lr', 'warmup_steps', 'steps', 'min_lr_ratio')  # train.* that make_schedule reads


def _report_schedule_change(runlog: RunLog, meta: Any, config, step: int) -> None:
  """A continuation whose learning-rate schedule is not the checkpoint's (a larger train.steps
  re-stretches the cosine): one warning and a `schedule_changed` event, with the lr of the next
  step under both. The checkpoint's config is read from its manifest: numbers, or nothing."""
  recorded = meta.get('config') if isinstance(meta, dict) else None
  old = recorded.get('train') if isinstance(recorded, dict) else None
  if not isinstance(old, dict):
    return
  new = {f: config.train[f] for f in _SCHEDULE}
  old = {f: old.get(f, new[f]) for f in _SCHEDULE}
  if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in old.values()):
    return
  changed = {f: [old[f], new[f]] for f in _SCHEDULE if old[f] != new[f]}
  if not changed:
    return
  lr = lambda train: float(make_schedule(SimpleNamespace(**train))(step))  # of step + 1
  try:
    before, after = lr(old), lr(new)
  except (ArithmeticError, TypeError, ValueError):  # numbers no schedule takes: say what changed
    before = after = None
  runlog.event('schedule_changed', step=step, changes=changed, lr_before=before, lr_after=after)
  what = ', '.join(f'train.{f} {a} -> {b}' for f, (a, b) in changed.items())
  if before is None:
    logging.warning('the learning-rate schedule changed since the checkpoint (%s)', what)
    return
  logging.warning(
      'the learning-rate schedule changed since the checkpoint (%s): the lr of step %d was '
      "%.2e under the checkpoint's schedule and is %.2e now", what, step + 1, before, after)


def _start_from(session: Session, resume_dir: Path | None) -> tuple[TrainState, int]:
  """The initial state and bandit: fresh, or restored from `resume_dir`."""
  config, runlog, mgr = session.trainer.config, session.runlog, session.mgr
  changes: list[str] = []
  loaded = None  # the init_from event's fields
  if resume_dir is None:
    state, step, run_state = session.trainer.init_fn(jax.random.key(config.seed)), 0, {}
    if session.identity.get('init_from'):
      state, loaded = _init_from_file(session, state)
  elif resume_dir.suffix == '.bin':
    state, run_state = restore_from_bin(session.trainer, resume_dir, mgr.directory, runlog)
    step = int(run_state['step'])
  else:
    # Refuse what does not fit before loading anything; record what changed and is allowed.
    meta = mgr.read_manifest(resume_dir)
    init_from_lib.check_resume(meta, session.identity.get('init_from'), str(resume_dir))
    # init_from pins were just compared, in their per-file form (`jaxckpt.export.weights`).
    changes = identity.compare(meta, session.identity, where=str(resume_dir)).lines
    state, run_state, loaded = _restore(session, resume_dir, meta)
    step = int(run_state['step'])
  runlog.event(
      'started',
      step=step,
      segment=runlog.segment,
      devices=jax.device_count(),
      processes=jax.process_count(),
      mesh=dict(session.trainer.mesh.shape))
  if resume_dir is not None:
    # With --replicas, where each process's bytes came from: its disk, its peers, the remote.
    sources = getattr(session.remote, 'restored', None)
    runlog.event(
        'resumed',
        step=step,
        path=str(resume_dir),
        changes=changes,
        **({'sources': sources} if sources and sources['step'] == step else {}))
    logging.info('resumed from %s (step %d)', resume_dir, step)
    if resume_dir.suffix != '.bin':  # a .bin records no config
      _report_schedule_change(runlog, meta, config, step)
    retention = [line for line in changes if _is_retention(line)]
    for line in changes:
      if line not in retention:
        logging.info('changed since the checkpoint: %s', line)
    if retention:  # one line and one event; what is kept already stays kept (`checkpoint.policy`)
      retention = [line[len('knob checkpoint.'):] for line in retention]  # 'keep_every 10 -> 0'
      runlog.event('retention_changed', step=step, changes=retention)
      logging.info(
          'retention changed since the checkpoint: %s; checkpoints whose manifests say they '
          'are kept stay kept (`jaxckpt delete CKPT --kept` deletes one)', '; '.join(retention))
  if loaded is not None:
    _report_init_from(runlog, step, loaded)
  if mgr.removed_debris:
    runlog.event('cleaned', paths=[str(p) for p in mgr.removed_debris])
    logging.info('removed %d incomplete checkpoint(s)', len(mgr.removed_debris))
  session.bandit = _start_bandit(session, run_state.get('bandit'))
  session.resumed_from = resume_dir
  # The cadence counts from here: steps replayed past an older checkpoint are saved again,
  # replacing what an earlier history (or a damaged checkpoint passed over) left at those steps.
  mgr.continue_from(step)
  runlog.status(
      state='running',
      step=step,
      total_steps=config.train.steps,
      processes=jax.process_count(),
      last_checkpoint=mgr.latest_step(),
      phase=session.bandit.state['phase'],
      error=None)
  return state, step


def _restore(session: Session, resume_dir: Path,
             meta: dict[str, Any]) -> tuple[TrainState, dict[str, Any], dict[str, Any] | None]:
  """Restore `resume_dir`: (state, run_state, the init_from event's fields or None).

  The parameters its manifest lists as `excluded` (frozen, from init_from) are read from the
  pinned file, which `identity.compare` has just found unchanged.
  """
  abstract = session.trainer.abstract_state()
  new_pin = session.identity.get('init_from')
  pin = new_pin or meta.get('init_from')  # the config may drop init_from; the file still counts
  left_out = [t['name'] for t in meta.get('excluded') or []]
  arrays = {}
  if pin is not None and (left_out or (new_pin and session.frozen_params)):
    arrays = _read_init_file(session, pin)
  if new_pin:  # else the checkpoints this run writes hold every parameter
    session.file_frozen = {n: x for n, x in arrays.items() if n in session.frozen_params}
  compile_step = _compile_beside(session.trainer, resume_dir, meta)
  if not left_out:
    state, run_state = session.mgr.restore(resume_dir, abstract, meanwhile=compile_step)
    return state, run_state, None
  leaves = named_leaves(abstract)
  dotted = lambda leaf: (names.param_of_leaf(leaf) or ('', leaf))[1]
  unreadable = [n for n in left_out if n not in leaves or dotted(n) not in arrays]
  if unreadable:
    raise ResumeError(
        'E-LOAD-001', f'{resume_dir} does not hold {", ".join(unreadable[:5])} '
        'and its pinned init_from file does not either', 'resume from a checkpoint '
        'that holds them, or start a new --workdir')
  restored, run_state = session.mgr.restore(
      resume_dir, {n: x for n, x in leaves.items() if n not in left_out}, meanwhile=compile_step)
  for name in left_out:
    value = arrays[dotted(name)]
    restored[name] = jax.make_array_from_callback(
        value.shape, leaves[name].sharding, lambda idx, value=value: value[idx])
  state = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(abstract), [restored[n] for n in leaves])
  read = {dotted(n) for n in left_out}
  return state, run_state, {
      **init_from_lib.summary(pin),
      'read': [n for n in model_lib.parameter_names(session.trainer.config.model) if n in read]
  }


def _compile_beside(trainer, resume_dir: Path, meta: dict[str, Any]):
  """What the restore runs beside its read: the first step's compile, so that a restart waits
  for the longer of the two, not both. None when there is nothing to compile: the step is
  compiled already (while the checkpoint came down), or the run is finished."""
  if not trainer.must_compile(layout.parse_step(resume_dir.name)):
    return None
  # A checkpoint of jaxckpt's own format is read beside the compile (each process its own byte
  # ranges); one of orbax's after it.
  beside = meta.get('storage') != 'orbax'
  logging.info('compiling the train step%s...', ' while the checkpoint is read' if beside else '')
  return trainer.compile_train_step


def _read_init_file(session: Session, pin: dict[str, Any]) -> dict[str, np.ndarray]:
  # The pin was made (a fresh start) or checked against the files (a resume) moments ago.
  return init_from_lib.read(
      pin, session.trainer.abstract_state().params, session.trainer.config.model, verify=False)


def _init_from_file(session: Session, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
  """A fresh state with the parameters the init_from file holds loaded; the event's fields."""
  pin = session.identity['init_from']
  arrays = _read_init_file(session, pin)
  state = state.replace(params=init_from_lib.load_params(state.params, arrays))
  session.file_frozen = {n: x for n, x in arrays.items() if n in session.frozen_params}
  fresh = [n for n in model_lib.parameter_names(session.trainer.config.model) if n not in arrays]
  return state, {
      **init_from_lib.summary(pin), 'loaded': list(arrays), 'fresh_init': fresh,
      'frozen': list(session.frozen_params), 'not_checkpointed': list(session.file_frozen)
  }


def _report_init_from(runlog: RunLog, step: int, fields: dict[str, Any]) -> None:
  """One `init_from` event and a log line or three: what came from the file, what did not."""
  runlog.event('init_from', step=step, **fields)
  if 'read' in fields:
    logging.info('read %d frozen parameter(s) the checkpoint does not hold from init_from %s: %s',
                 len(fields['read']), fields['path'], ', '.join(fields['read']))
    return
  loaded, fresh = fields['loaded'], fields['fresh_init']
  logging.info('initialized %d of %d parameters from init_from %s (%s)', len(loaded),
               len(loaded) + len(fresh), fields['path'], init_from_lib.versions(fields))
  if fresh:
    logging.info('not in init_from, fresh init: %s', ', '.join(fresh))
  if fields['not_checkpointed']:
    logging.info('frozen and read from init_from on every resume, not checkpointed: %s',
                 ', '.join(fields['not_checkpointed']))


def _start_bandit(session: Session, saved: dict | None) -> bandit_lib.Bandit:
  """The bandit for this start: restored, fitted to the config's sources and the phase."""
  config, arms = session.trainer.config, session.dataset.names
  phase = phases.current_phase(session.workdir)
  if saved is None:
    return bandit_lib.Bandit(config.bandit, arms, config.seed, bandit_lib.fresh_state(arms, phase))
  state, dropped, added, reset = bandit_lib.reconcile(saved, arms, phase)
  if reset:
    session.runlog.event('bandit_reset', phase=phase, reason='pivot')
    logging.info('phase %d: a fresh bandit over %s', phase, ', '.join(arms))
  if dropped:
    # The zombie-arm guard: a source that left the config can never be sampled again.
    session.runlog.event('bandit_arms_dropped', arms=dropped)
    logging.warning('dropped bandit arm(s) whose data source is no longer configured: %s',
                    ', '.join(dropped))
  if added:
    session.runlog.event('bandit_arms_added', arms=added)
    logging.info('new data source(s) joined the bandit: %s', ', '.join(added))
  return bandit_lib.Bandit(config.bandit, arms, config.seed, state)
