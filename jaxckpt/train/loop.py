"""The training loop: `train_and_evaluate(config, workdir)`, read top to bottom.

It starts a run, or continues the one in `workdir` from its newest committed checkpoint: the
same command starts, restarts and continues. Given the same config, a continued run is
bit-identical to one that never stopped: the batch of step k is a pure function of (seed, k), the
learning rate is driven by the optimizer's own step count, and params, Adam m and v and every
counter come back exactly.

Where the rest lives: the model, optimizer and jitted step in `trainer`, choosing and restoring
the resume point in `resume`, the config's validation in `config`, what a checkpoint records
about the run in `identity` and `provenance`, the run directory in `workdir`, and the checkpoint
library itself in `jaxckpt.checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from pathlib import Path
from typing import Any

import jax
import ml_collections
from absl import logging

from jaxckpt.checkpoint import CheckpointError, CheckpointManager, CommitInfo, signals
from jaxckpt.checkpoint.manifest import commit_label
from jaxckpt.errors import JaxckptError, UsageError, exit_code
from jaxckpt.export import during_training
from jaxckpt.hosts import agreement, distributed, peer_start, stepwatch
from jaxckpt.hosts.remote import RemoteRun
from jaxckpt.model import data as data_lib
from jaxckpt.records import identity, phases, tensorboard
from jaxckpt.records import provenance as provenance_lib
from jaxckpt.records.runlog import RunLog
from jaxckpt.records.workdir import checkpoints_dir, exports_dir
from jaxckpt.train import init_from as init_from_lib
from jaxckpt.train import resume as resume_lib
from jaxckpt.train.config import cadence_options, checkpoint_options, validate_config
from jaxckpt.train.save_cadence import SaveCadence, tree_nbytes
from jaxckpt.train.session import Session
from jaxckpt.train.state import (StepsInFlight, Trainer, TrainState, build_trainer, check_finite,
                                 evaluate, generate_samples, make_schedule)


def run_identity(trainer: Trainer,
                 provenance: dict | None = None,
                 *,
                 init_from: dict[str, Any] | None = None) -> dict[str, Any]:
  """What this run is, for every checkpoint's manifest (see `jaxckpt.records.identity`).

  `init_from` is the pin of the file initial weights come from (`init_from.pin`); trainable per
  parameter follows `config.train.frozen`.
  """
  provenance = provenance or {}
  abstract = trainer.abstract_state()
  return identity.build(
      config=trainer.config,
      params=abstract.params,
      opt_state=abstract.opt_state,
      partition_specs=trainer.state_shardings.params,
      mesh_shape=dict(trainer.mesh.shape),
      devices=jax.device_count(),
      processes=jax.process_count(),
      platform=jax.devices()[0].platform,
      knobs=provenance.get('knobs'),
      sources=provenance.get('sources'),
      trainable=identity.trainable_fn(trainer.config.train.get('frozen', ())),
      init_from=init_from,
      versions=provenance_lib.versions())


class _Progress:
  """Turns per-step metrics into loss rows and progress lines without syncing every step."""

  def __init__(self, trainer: Trainer, runlog: RunLog, start_step: int, note=lambda: ''):
    self.trainer, self.runlog, self.note = trainer, runlog, note  # note: the cadence's
    self.schedule = make_schedule(trainer.config.train)
    self.pending: list[tuple[int, dict]] = []
    self.t_start, self.step_start = time.perf_counter(), start_step
    self.tokens_per_step = trainer.config.train.batch_size * trainer.config.model.block_size

  def add(self, step: int, metrics: dict) -> None:
    self.pending.append((step, metrics))

  def flush(self, *, log: bool) -> None:
    if not self.pending:
      return
    fetched = jax.device_get([m for _, m in self.pending])
    steps = [s for s, _ in self.pending]
    now = time.time()
    self.runlog.losses({
        'step': s, 'loss': float(m['loss']), 'lr': float(self.schedule(s - 1)), 'grad_norm': float(
            m['grad_norm']), 'time': now
    } for s, m in zip(steps, fetched))
    self.pending = []
    if log:
      step, loss, total = steps[-1], float(fetched[-1]['loss']), self.trainer.config.train.steps
      elapsed = time.perf_counter() - self.t_start
      rate = (step - self.step_start) / elapsed if elapsed > 0 else 0.0
      eta = (total - step) / rate if rate > 0 else float('nan')
      logging.info('step %d/%d  loss %.4f  lr %.2e  %s tok/s  eta %s%s', step, total, loss,
                   float(self.schedule(step - 1)), f'{rate * self.tokens_per_step:,.0f}',
                   time.strftime('%H:%M:%S', time.gmtime(eta)) if eta == eta else '?', self.note())


def train_and_evaluate(config: ml_collections.ConfigDict,
                       workdir: str | os.PathLike,
                       *,
                       resume: str = 'latest',
                       provenance: dict | None = None,
                       watcher: signals.PreemptionWatcher | None = None,
                       step_timeout_secs: float | None = None) -> TrainState:
  """Train `config` in `workdir`, continuing the run there if there is one. Returns the state.

  `provenance` ({'knobs', 'sources'} from `jaxckpt.records.provenance.provenance`) says where each config
  value came from; it is recorded in every checkpoint's manifest. `watcher` is one `main`
  installed at start-up, for the whole process; without it, signals are watched while this runs.

  Raises `signals.Interrupted` after checkpointing when a stop signal arrived (see
  `jaxckpt.checkpoint.signals`), and `JaxckptError`s for problems the user can fix.
  """
  validate_config(config)
  stepwatch.check(step_timeout_secs)
  workdir = Path(workdir)
  # `startup`: a failure before the first step, of any kind, stops every process at once.
  with watcher or signals.PreemptionWatcher() as watcher, distributed.startup(), \
      _read_inputs(config, resume) as dataset, \
      distributed.run_lock(workdir) as lock, \
      RemoteRun.opened(config, workdir, distributed.current()) as remote:  # before any compile
    ckpt_dir = checkpoints_dir(workdir)
    shared = distributed.shared_workdir(workdir, remote=remote is not None, config=config)
    if not shared and resume not in ('latest', 'none'):
      raise UsageError(
          'E-DIST-007', f"--resume={resume} on a workdir that is each host's own disk (each "
          'holds only its part of a checkpoint)', 'use --resume=latest: the run resumes from '
          'the newest checkpoint of --remote')
    replicas = config.checkpoint.get('replicas', 0)
    # With --remote (or --replicas, checked below), built now: each host's own disk (the peer
    # tier) restores with its shardings, and a download runs beside the first step's compile.
    trainer = build_trainer(config) if remote is not None or replicas else None
    if replicas:
      peer_start.check(
          replicas,
          remote=remote,
          shared=shared,
          count=distributed.current().count,
          workdir=workdir,
          part_bytes=tree_nbytes(trainer.abstract_state()) // distributed.current().count,
          keep=config.checkpoint.keep)
    # A newer remote checkpoint (and its records) comes down into the workdir, by process 0; every
    # process compiles its first step meanwhile, and the others then wait for the download.
    fetched_here = resume == 'latest' and shared

    # By then the remote's newest step is known: a run finished there compiles nothing.
    def compile_first() -> None:
      if not distributed.leader() and trainer.must_compile(remote.start_step):
        logging.info('compiling the train step while process 0 fetches step %d from %s',
                     remote.start_step, remote.store.url)
      trainer.compile_train_step(remote.start_step)

    distributed.together(  # the others wait for process 0's download: bounded by its size
        'remote_synced',
        lambda: remote and remote.sync_down(
            ckpt_dir,
            resume=resume,
            fetch=fetched_here and distributed.leader(),
            meanwhile=compile_first if fetched_here else None),
        timeout=trainer and distributed.download_secs(tree_nbytes(trainer.abstract_state())))
    if shared or resume != 'latest':
      resume_dir = distributed.together('resume_point',
                                        lambda: resume_lib.find_resume_point(resume, ckpt_dir))
    else:  # the newest checkpoint the hosts hold between them, the remote for the rest
      resume_dir = peer_start.resume_point(remote, ckpt_dir, trainer.abstract_state(),
                                           distributed.current().timeout_secs)
    # By seal, not name: hosts can hold different commits of one step (another history's).
    distributed.agree('resume', str(resume_dir and commit_label(resume_dir)),
                      'the checkpoint to resume from')
    trainer = trainer or build_trainer(config)
    logging.info('%s', _describe_start(trainer, resume_dir))
    pin = init_from_lib.pin(
        config.train.get('init_from', ''), config.model, fresh=resume_dir is None)
    runlog = distributed.run_log(workdir)  # process 0 writes the records
    exporter = during_training.Exporter(  # cleans debris; says so when it cannot export here
        exports_dir(workdir),
        config,
        runlog,
        processes=distributed.current().count)
    # Built before this start is recorded: it reads the earlier starts' interruptions.
    cadence = SaveCadence(
        config, runlog, cadence_options(config), epoch=dataset.epoch, state=trainer.abstract_state)

    def on_commit(info: CommitInfo) -> None:
      runlog.event(
          'checkpoint',
          step=info.step,
          path=str(info.path),
          bytes=info.bytes,
          seconds_blocked=round(info.seconds_blocked, 6),
          seconds_to_commit=round(info.seconds_to_commit, 6),
          deleted=list(info.deleted),
          staging=info.staging)
      if info.retention_errors:
        runlog.event('retention_failed', step=info.step, problems=list(info.retention_errors))
      runlog.status(last_checkpoint=info.step, last_checkpoint_path=str(info.path))
      # From the host copy this checkpoint staged, on the save thread; the next save waits.
      # (`session` is bound below, before the first save.) Across processes it holds this
      # process's shards alone: export the checkpoint afterwards (`jaxckpt export`).
      exported = distributed.current().count == 1 and exporter.on_commit(
          session.for_export(info), stopping=watcher.stop_signal is not None)
      if exported:
        runlog.status(last_export=exported['step'])
      if remote is not None:
        remote.on_commit(info)  # the uploader takes it from here
      cadence.committed(info)  # committed: the next automatic save may start (when durable)

    mgr = CheckpointManager(
        ckpt_dir,
        dataclasses.replace(
            checkpoint_options(config), barrier_timeout_secs=distributed.current().timeout_secs),
        on_commit=on_commit)
    if remote is not None:
      remote.attach(runlog, mgr.options, ckpt_dir, resume_dir)
      cadence.durable = remote.chain(cadence.durable)  # durable means uploaded too
      mgr.held = remote.uploader.holding  # a checkpoint being uploaded outlives retention
      nbytes = tree_nbytes(trainer.abstract_state())
      cadence.on_plan = lambda plan, step: remote.cadence.replan(plan, step, nbytes)
      remote.cadence.watch(lambda: cadence.position, lambda: cadence.step_s)
    if lock.previous_holder:
      runlog.event('lock_taken_over', previous=lock.previous_holder)
      logging.info('took over the lock of pid %s (not running)', lock.previous_holder.get('pid'))
    session = Session(
        trainer,
        dataset,
        mgr,
        runlog,
        watcher,
        workdir,
        identity=run_identity(trainer, provenance, init_from=pin),
        remote=remote)
    try:
      state, step = resume_lib.start(session, resume, resume_dir)
      # The staging buffer is faulted in while the first step compiles, not in the first save.
      mgr.prepare(
          trainer.abstract_state(), exclude=session.not_saved if session.file_frozen else None)
      if distributed.leader():  # process 0 writes the records, TensorBoard's too
        tensorboard.mirror(runlog, config, first_step=step)
      if remote is not None:  # the checkpoint it continues from, after any fallback
        remote.started(session.resumed_from, ckpt_dir, step)
      distributed.started()
      with stepwatch.watching(step_timeout_secs, runlog, step):  # a hung step ends the run
        return _loop(session, state, step, cadence)
    except signals.Interrupted:
      raise
    except BaseException as e:
      distributed.explain(e)  # a lost process, not what it broke, is why the run stopped
      try:
        mgr.close()
      except Exception as close_error:  # the original error is the one to raise; say both
        logging.error('while stopping after %s: the checkpoint in flight failed too: %s',
                      type(e).__name__, close_error)
        runlog.event('save_failed', error=f'{type(close_error).__name__}: {close_error}')
      # A refusal before the start (exit 2) ran nothing; after it, a failure ends this start.
      if runlog.started or not (isinstance(e, CheckpointError) and exit_code(e) == 2):
        with contextlib.suppress(JaxckptError):  # a disk that takes no record: `e` stands
          runlog.event('failed', error=f'{type(e).__name__}: {e}')
          runlog.status(state='failed', error=f'{type(e).__name__}: {e}')
      raise
    finally:
      try:
        mgr.close()
      finally:
        runlog.close()  # after the last commit: its timings are in the event file


def _read_inputs(config, resume: str) -> contextlib.nullcontext:
  """The training data (in a `with`: a `nullcontext` of it) and an explicit --resume checked: a
  start they refuse is refused before the workdir and its LOCK are created, and within
  `distributed.startup()`, so the other processes hear of it."""
  if resume not in ('latest', 'none'):
    resume_lib.find_resume_point(resume, Path())  # reads the path given, not the workdir
  return contextlib.nullcontext(data_lib.from_config(config))


def _describe_start(trainer: Trainer, resume_dir: Path | None) -> str:
  """The start-up's second line, once the mesh is built (`main` logs the first)."""
  params = sum(x.size for x in jax.tree.leaves(trainer.abstract_state().params))
  step = re.search(r'\d+', resume_dir.name) if resume_dir is not None else None
  resumes = ('a fresh start' if resume_dir is None else
             f'resuming from step {int(step[0]) if step else "?"} at {resume_dir}, if intact')
  platform = jax.devices()[0].platform
  gpu = ('' if platform != 'gpu'
         else '; GPU ops deterministic' if 'deterministic_ops=true' in os.environ.get(
             'XLA_FLAGS', '') else '; GPU ops not deterministic: a resume is not exact')
  return (f'{params:,} parameters; mesh {dict(trainer.mesh.shape)} over {jax.device_count()} '
          f'{platform} device(s), {jax.process_count()} process(es); {resumes}{gpu}')


def _loop(session: Session, state: TrainState, step: int, cadence: SaveCadence) -> TrainState:
  trainer, dataset, mgr, runlog, watcher = (session.trainer, session.dataset, session.mgr,
                                            session.runlog, session.watcher)
  config, total = trainer.config, trainer.config.train.steps
  uploads = session.remote.cadence.note if session.remote else lambda: ''
  progress = _Progress(trainer, runlog, step, lambda: cadence.note() + uploads())
  first_step = step
  cadence.start(step)  # the interval counts from here
  if step >= total:
    _say_finished(runlog, step, total)
  # The step this run continues from is on disk when it came from this workdir's own checkpoint.
  restored_here = (
      session.resumed_from is not None
      and session.resumed_from.resolve() == mgr.step_dir(step).resolve())
  saved = {step} if restored_here else set()
  heldout: dict[int, float] = {}  # step -> held-out loss, for the checkpoint of that step
  sample_every = config.samples.every if config.samples.every >= 0 else mgr.options.every_steps

  def save(step: int) -> None:
    cadence.saving(step)
    cadence.poll(mgr, step, wait=True)  # the save in flight: a failure is counted, this retries
    if config.train.guard_finite:
      check_finite(trainer, state, step)
    with cadence.aside():  # rows the next progress line writes anyway: not the save's cost
      progress.flush(log=False)  # the loss history covers every step a checkpoint covers
    counters = {
        'step': step, 'data_position': step, 'epoch': dataset.epoch(step),
        'tokens_seen': step * progress.tokens_per_step
    }
    bandit_state = session.bandit.snapshot()
    run_state = {'seed': config.seed, **counters, 'bandit': bandit_state}
    if distributed.leader():
      phases.write_bandit_mirror(session.workdir, step, bandit_state)
    if session.remote is not None:
      # The records that travel with this checkpoint; the last one's are taken after the end.
      session.remote.capture(step, last=step == total or agree.stop_signal is not None)
    try:
      mgr.save(
          step,
          state,
          run_state,
          metadata={
              **session.identity,
              'counters': counters,
              'finished': step == total,
              # The held-out loss of this very step, when the run evaluated it: what
              # --keep_best ranks by (a checkpoint without one never counts as best).
              'metrics': {'heldout_loss': heldout[step]} if step in heldout else {}
          },
          exclude=session.not_saved if session.file_frozen else None)
    except CheckpointError as e:
      if mgr.mode_used != 'sync' or e.code != 'E-CKPT-001':
        raise
      cadence.failed_inline(e)  # written inline and failed: retried as a background failure is
    saved.add(step)
    cadence.saved(step)

  # Across processes: the same saves and the same stop on every one (`jaxckpt.hosts.agreement`).
  agree = agreement.Agreement(watcher, step, clocked=mgr.options.every_secs > 0)
  # A stop within two step times, whatever log_every is (`StepsInFlight`).
  in_flight = StepsInFlight(config.train.get('max_steps_in_flight', 2))
  if step < total and not trainer.step_compiled:  # minutes for a large model on a CPU
    logging.info('compiling the train step...')
    trainer.compile_train_step(step)  # here: a stop signal meanwhile stops before a step
  agree.stop_at_start()  # a stop signal on any process while starting: none trains a step
  while step < total and agree.stop_signal is None:
    arm = session.bandit.choose(step)
    state, metrics = trainer.train_step(state, trainer.put_batch(dataset.batch(step, arm)))
    step += 1
    watcher.position = step  # the step a signal arriving now is noted at
    in_flight.dispatched(metrics['loss'])
    stepwatch.beat(step)
    progress.add(step, metrics)
    cadence.poll(mgr, step)  # a background save that failed is heard here, at once
    cadence.after_step(step, metrics)
    session.bandit.record(step, arm, metrics['loss'])
    if step % config.train.log_every == 0 or step == total:
      progress.flush(log=True)
      runlog.status(step=step)
    if config.train.eval_every and step % config.train.eval_every == 0:
      with stepwatch.paused('the evaluation'):
        heldout[step] = evaluate(trainer, state.params, dataset)
      runlog.event('eval', step=step, heldout_loss=heldout[step])
      logging.info('step %d  held-out loss %.4f', step, heldout[step])
    if sample_every and (step % sample_every == 0 or step == total):
      with stepwatch.paused('the samples'):
        samples = generate_samples(trainer, state.params, step)  # on every process: computes
      if distributed.leader():
        phases.write_samples(session.workdir, session.bandit.state['phase'], step, samples,
                             config.samples.keep)
    requested = watcher.save_requested  # a SIGUSR1 this boundary may take
    if agree.save_now(step, total, lambda: mgr.should_save(step), lambda: cadence.due(step)):
      with stepwatch.paused():
        save(step)
      if requested and not watcher.save_requested:
        _on_request(runlog, watcher, step)
  with stepwatch.paused():
    if step not in saved and (step == total or step > first_step):
      save(step)  # resumed at the end, or stopped: the step reached must be on disk
    while not cadence.poll(mgr, step, wait=True):  # a failed last save is retried once
      save(step)
  progress.flush(log=False)
  if step < total:  # only a stop signal ends the loop early
    latency, detail = {}, ''
    if watcher.stop_time is not None:  # the signal came to this process (not only an agreement)
      latency = {
          'signal_step': watcher.stop_position,
          'seconds_from_signal': round(watcher.seconds_since_stop(), 3)
      }
      if watcher.stop_position is not None:  # None: during start-up, nothing new to save
        detail = (f'the signal arrived at step {watcher.stop_position}; checkpoint committed '
                  f'{latency["seconds_from_signal"]:.1f} s after it')
    runlog.event(
        'interrupted',
        step=step,
        signal=agree.stop_name,
        message=f'interrupted by {agree.stop_name} at step {step}',
        **latency)
    runlog.status(state='interrupted', step=step, signal=agree.stop_name)
    raise signals.Interrupted(agree.stop_signal, step, detail)
  if watcher.stop_signal is not None:
    logging.info('%s arrived after the last step; the run is finished', watcher.stop_name)
  runlog.event('finished', step=step)
  runlog.status(state='finished', step=step, last_checkpoint=mgr.latest_step())
  if step > first_step:  # a start with nothing to train said so (`_say_finished`)
    logging.info('finished at step %d: %s is committed', step, mgr.step_dir(step))
  return state


def _on_request(runlog: RunLog, watcher: signals.PreemptionWatcher, step: int) -> None:
  """A SIGUSR1 was taken by the checkpoint of `step`: one line and an event say so."""
  waited = time.monotonic() - (watcher.save_request_time or time.monotonic())
  runlog.event(
      'checkpoint_requested', step=step, signal='SIGUSR1', seconds_from_signal=round(waited, 3))
  logging.info('SIGUSR1: checkpoint of step %d started %.1f s after the signal', step, waited)


def _say_finished(runlog: RunLog, step: int, total: int) -> None:
  """A start with nothing to train: say why, and how to go on."""
  if step > total:
    note = (f'nothing trained: the run is at step {step}, past --config.train.steps={total}; '
            f'to train further, pass --config.train.steps above {step}')
    logging.warning('%s', note)
  else:
    note = (f'the run is finished at step {step} (--config.train.steps={total}); to continue '
            f'it, pass --config.train.steps above {step}')
    logging.info('%s', note)
  runlog.event('nothing_to_train', step=step, total_steps=total, message=note)
  runlog.status(note=note)
