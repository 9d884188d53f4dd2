"""Training: the state, the jitted step, and the loop that checkpoints and resumes.

`train_and_evaluate(config, workdir)` starts a run, or continues the one in `workdir` from its
newest committed checkpoint: the same command starts, restarts and continues. Given the same
config, a continued run is bit-identical to one that never stopped: the batch of step k is a pure
function of (seed, k), the learning rate is driven by the optimizer's own step count, and params,
Adam m and v and every counter come back exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

import jaxckpt
from jaxckpt import data as data_lib
from jaxckpt import model as model_lib
from jaxckpt import sharding
from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, CommitInfo, layout, signals
from jaxckpt.errors import ConfigError, ResumeError
from jaxckpt.runlog import RunLog


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any


def make_schedule(train_cfg) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train_cfg.lr, warmup_steps=train_cfg.warmup_steps,
      decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
      end_value=train_cfg.lr * train_cfg.min_lr_ratio)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  # Matrices decay, biases and LayerNorm parameters do not (GPT-2 / nanoGPT practice).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(train_cfg.grad_clip),
      optax.adamw(make_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                  weight_decay=train_cfg.weight_decay, mask=decay_mask))


@dataclasses.dataclass
class Trainer:
  """The model, optimizer, mesh and compiled functions for one config."""
  config: ml_collections.ConfigDict
  mesh: jax.sharding.Mesh
  model: model_lib.GPT
  tx: optax.GradientTransformation
  state_shardings: Any
  init_fn: Callable[[jax.Array], TrainState]
  train_step: Callable[[TrainState, tuple], tuple[TrainState, dict]]
  eval_step: Callable[[Any, tuple], jax.Array]

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: the target a checkpoint is restored into."""
    shapes = jax.eval_shape(self.init_fn, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings)

  def put_batch(self, batch: tuple[np.ndarray, np.ndarray]) -> tuple[jax.Array, jax.Array]:
    sh = sharding.batch_sharding(self.mesh)
    # Every process builds the same global batch and hands each device its slice.
    return tuple(jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx])
                 for x in batch)


def build_trainer(config, devices=None) -> Trainer:
  mesh = sharding.make_mesh(config.mesh, devices)
  sharding.check_divisible(config.model, config.train.batch_size, mesh)
  model = model_lib.from_config(config.model)
  tx = make_optimizer(config.train)
  dummy = jnp.zeros((1, config.model.block_size), jnp.int32)

  def boxed_init(rng):
    params = model.init(rng, dummy)['params']
    return TrainState(params=params, opt_state=tx.init(params))

  state_shardings = sharding.shardings_for(jax.eval_shape(boxed_init, jax.random.key(0)), mesh)
  init_fn = jax.jit(lambda rng: nn.unbox(boxed_init(rng)), out_shardings=state_shardings)

  def loss_fn(params, batch):
    x, y = batch
    logits = model.apply({'params': params}, x)  # (B, T, V)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def train_step(state: TrainState, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state), {'loss': loss, 'grad_norm': optax.tree.norm(grads)}

  batch_sh = (sharding.batch_sharding(mesh),) * 2
  replicated = sharding.replicated(mesh)
  return Trainer(
      config=config, mesh=mesh, model=model, tx=tx, state_shardings=state_shardings,
      init_fn=init_fn,
      train_step=jax.jit(train_step, in_shardings=(state_shardings, batch_sh),
                         out_shardings=(state_shardings, replicated), donate_argnums=0),
      eval_step=jax.jit(loss_fn, in_shardings=(state_shardings.params, batch_sh),
                        out_shardings=replicated))


def validate_config(config) -> None:
  """Check the config once, at the start, with errors that name the field."""
  m, t = config.model, config.train
  positive = {'model.n_layer': m.n_layer, 'model.n_head': m.n_head, 'model.n_embd': m.n_embd,
              'model.block_size': m.block_size, 'model.vocab_size': m.vocab_size,
              'train.steps': t.steps, 'train.batch_size': t.batch_size, 'train.lr': t.lr,
              'train.log_every': t.log_every}
  for field, value in positive.items():
    if not value > 0:
      raise ConfigError('E-CONFIG-001', f'{field}={value} must be positive', f'set --config.{field}')
  if m.n_embd % m.n_head:
    raise ConfigError('E-CONFIG-001', f'model.n_embd={m.n_embd} is not a multiple of '
                      f'model.n_head={m.n_head}', 'change one of them')
  if not 0 < config.data.heldout_fraction < 1:
    raise ConfigError('E-CONFIG-001', f'data.heldout_fraction={config.data.heldout_fraction} '
                      'must be between 0 and 1', 'set --config.data.heldout_fraction')
  if m.dtype not in ('float32', 'bfloat16'):
    raise ConfigError('E-CONFIG-001', f'model.dtype={m.dtype!r} is not float32 or bfloat16',
                      'set --config.model.dtype')
  checkpoint_options(config)  # validates mode and counts


def checkpoint_options(config) -> CheckpointOptions:
  c = config.checkpoint
  return CheckpointOptions(every_steps=c.every, every_secs=c.secs, mode=c.mode, keep=c.keep,
                           keep_every=c.keep_every)


def find_resume_point(resume: str, ckpt_dir: Path) -> Path | None:
  """The committed checkpoint directory to continue from, or None for a fresh start.

  `latest`: the newest committed checkpoint, or a fresh start when there is none.
  `none`: a fresh start, refused when checkpoints exist (it would fork the run's history).
  anything else: the path of a committed `step_<n>` directory.
  """
  if resume in ('latest', 'none'):
    steps = layout.committed_steps(ckpt_dir)
    if resume == 'latest':
      return steps[max(steps)] if steps else None
    if steps:
      raise ResumeError('E-RESUME-001', f'--resume=none but {ckpt_dir} already holds committed '
                        f'checkpoints (steps {min(steps)}..{max(steps)}); starting fresh would '
                        'silently fork the run\'s history', 'use --resume=latest to continue, '
                        'or a new --workdir to start over')
    return None
  path = Path(resume)
  if not (path / layout.MANIFEST).is_file() or layout.parse_step(path.name) is None:
    raise ResumeError('E-RESUME-003', f'--resume={resume} is not a committed checkpoint '
                      '(a step_<n> directory with a manifest.json)',
                      'use --resume=latest, --resume=none, or the path of a step_<n> directory')
  return path


_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'tensorstore', 'numpy')


@functools.cache
def versions() -> dict[str, str]:
  out = {'jaxckpt': jaxckpt.__version__, 'python': platform.python_version()}
  for name in _PACKAGES:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = 'not installed'
  return out


def _identity(config, mesh, finished: bool) -> dict[str, Any]:
  return {'config': config.to_dict(), 'seed': config.seed, 'finished': finished,
          'mesh': dict(mesh.shape), 'devices': jax.device_count(),
          'processes': jax.process_count(), 'platform': jax.devices()[0].platform,
          'versions': versions()}


class _Progress:
  """Turns per-step metrics into loss rows and progress lines without syncing every step."""

  def __init__(self, trainer: Trainer, runlog: RunLog, start_step: int):
    self.trainer, self.runlog = trainer, runlog
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
    self.runlog.losses({'step': s, 'loss': float(m['loss']), 'lr': float(self.schedule(s - 1)),
                        'grad_norm': float(m['grad_norm']), 'time': now}
                       for s, m in zip(steps, fetched))
    self.pending = []
    if log:
      step, loss, total = steps[-1], float(fetched[-1]['loss']), self.trainer.config.train.steps
      elapsed = time.perf_counter() - self.t_start
      rate = (step - self.step_start) / elapsed if elapsed > 0 else 0.0
      eta = (total - step) / rate if rate > 0 else float('nan')
      logging.info('step %d/%d  loss %.4f  lr %.2e  %s tok/s  eta %s', step, total, loss,
                   float(self.schedule(step - 1)), f'{rate * self.tokens_per_step:,.0f}',
                   time.strftime('%H:%M:%S', time.gmtime(eta)) if eta == eta else '?')


def evaluate(trainer: Trainer, params, dataset: data_lib.Dataset) -> float:
  losses = [trainer.eval_step(params, trainer.put_batch(b))
            for b in dataset.heldout_batches(trainer.config.train.eval_batches)]
  return float(np.mean(jax.device_get(losses)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                       resume: str = 'latest') -> TrainState:
  """Train `config` in `workdir`, continuing the run there if there is one. Returns the state.

  Raises `signals.Interrupted` after checkpointing when a stop signal arrived (see
  `jaxckpt.checkpoint.signals`), and `JaxckptError`s for problems the user can fix.
  """
  with signals.PreemptionWatcher() as watcher:
    validate_config(config)
    workdir = Path(workdir)
    ckpt_dir = workdir / 'checkpoints'
    resume_dir = find_resume_point(resume, ckpt_dir)
    dataset = data_lib.from_config(config)
    trainer = build_trainer(config)
    runlog = RunLog(workdir)

    def on_commit(info: CommitInfo) -> None:
      runlog.event('checkpoint', step=info.step, path=str(info.path), bytes=info.bytes,
                   seconds_blocked=round(info.seconds_blocked, 6),
                   seconds_to_commit=round(info.seconds_to_commit, 6),
                   deleted=list(info.deleted))
      runlog.status(last_checkpoint=info.step, last_checkpoint_path=str(info.path))

    mgr = CheckpointManager(ckpt_dir, checkpoint_options(config), on_commit=on_commit)
    step = None
    try:
      state, step = _start(trainer, mgr, resume_dir, runlog)
      return _loop(trainer, dataset, mgr, runlog, watcher, state, step)
    except signals.Interrupted:
      raise
    except BaseException as e:
      try:
        mgr.close()
      except Exception:  # the original error is the one to report
        pass
      runlog.event('failed', error=f'{type(e).__name__}: {e}')
      runlog.status(state='failed', error=f'{type(e).__name__}: {e}')
      raise
    finally:
      mgr.close()


def _start(trainer: Trainer, mgr: CheckpointManager, resume_dir: Path | None,
           runlog: RunLog) -> tuple[TrainState, int]:
  """The initial state: fresh, or restored from `resume_dir`."""
  config = trainer.config
  if resume_dir is None:
    state, step = trainer.init_fn(jax.random.key(config.seed)), 0
  else:
    state, run_state = mgr.restore(resume_dir, trainer.abstract_state())
    step = int(run_state['step'])
  runlog.event('started', step=step, segment=runlog.segment, devices=jax.device_count(),
               mesh=dict(trainer.mesh.shape))
  if resume_dir is not None:
    runlog.event('resumed', step=step, path=str(resume_dir))
    logging.info('resumed from %s (step %d)', resume_dir, step)
  if mgr.removed_debris:
    runlog.event('cleaned', paths=[str(p) for p in mgr.removed_debris])
    logging.info('removed %d incomplete checkpoint(s)', len(mgr.removed_debris))
  runlog.status(state='running', step=step, total_steps=config.train.steps,
                last_checkpoint=mgr.latest_step(), error=None)
  return state, step


def _loop(trainer: Trainer, dataset: data_lib.Dataset, mgr: CheckpointManager, runlog: RunLog,
          watcher: signals.PreemptionWatcher, state: TrainState, step: int) -> TrainState:
  config, total = trainer.config, trainer.config.train.steps
  progress = _Progress(trainer, runlog, step)
  first_step = step
  saved = {s for s in (mgr.latest_step(),) if s is not None}

  def save(step: int) -> None:
    progress.flush(log=False)  # the loss history covers every step a checkpoint covers
    run_state = {'seed': config.seed, 'data_position': step, 'epoch': dataset.epoch(step),
                 'tokens_seen': step * progress.tokens_per_step}
    mgr.save(step, state, run_state, metadata=_identity(config, trainer.mesh, step == total))
    saved.add(step)

  while step < total and watcher.stop_signal is None:
    state, metrics = trainer.train_step(state, trainer.put_batch(dataset.batch(step)))
    step += 1
    progress.add(step, metrics)
    if step % config.train.log_every == 0 or step == total:
      progress.flush(log=True)
      runlog.status(step=step)
    if config.train.eval_every and step % config.train.eval_every == 0:
      runlog.event('eval', step=step, heldout_loss=evaluate(trainer, state.params, dataset))
    if (step == total or mgr.should_save(step) or watcher.take_save_request()
        or watcher.stop_signal is not None):
      save(step)
  if step not in saved and (step == total or step > first_step):
    save(step)  # resumed at the end, or stopped: the step reached must be on disk
  mgr.wait_until_finished()
  progress.flush(log=False)
  if step < total:  # only a stop signal ends the loop early
    runlog.event('interrupted', step=step, signal=watcher.stop_name,
                 message=f'interrupted by {watcher.stop_name} at step {step}')
    runlog.status(state='interrupted', step=step, signal=watcher.stop_name)
    raise signals.Interrupted(watcher.stop_signal, step)
  if watcher.stop_signal is not None:
    logging.info('%s arrived after the last step; the run is finished', watcher.stop_name)
  runlog.event('finished', step=step)
  runlog.status(state='finished', step=step, last_checkpoint=mgr.latest_step())
  return state
