"""Training: the state, the jitted step, and the loop that checkpoints and resumes.

`train_and_evaluate(config, workdir)` starts a run, or continues the one in `workdir` from its
newest committed checkpoint: the same command starts, restarts and continues. Given the same
config, a continued run is bit-identical to one that never stopped: the batch of step k is a pure
function of (seed, k), the learning rate is driven by the optimizer's own step count, and params,
Adam m and v and every counter come back exactly.

`config.train.init_from` starts a run from a safetensors file (an export of another run), pinned
in every manifest; `config.train.frozen` names parameters the optimizer never touches. A frozen
parameter the file holds is not checkpointed: each resume reads it from the pinned file again.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

import jaxckpt
from jaxckpt import bandit as bandit_lib
from jaxckpt import data as data_lib
from jaxckpt import model as model_lib
from jaxckpt import identity, inspection, phases, sharding
from jaxckpt import init_from as init_from_lib
from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, CommitInfo, layout, signals
from jaxckpt.checkpoint.lock import WorkdirLock
from jaxckpt.checkpoint.manager import named_leaves
from jaxckpt.errors import CheckpointError, ConfigError, JaxckptError, ResumeError
from jaxckpt.export import during_training
from jaxckpt.export.offline import param_of_leaf
from jaxckpt.bin_resume import restore_from_bin
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
  """Global-norm clipping and AdamW; parameters matching `train_cfg.frozen` are left out of both.

  Frozen parameters get a zero update and no optimizer state (no Adam m and v), and their
  gradients do not count towards the clipping norm. Without frozen parameters the state has the
  plain chain's structure (`1/0/mu`, ...); with them it is an `optax.partition` of the two.
  """
  # Matrices decay, biases and LayerNorm parameters do not (GPT-2 / nanoGPT practice).
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(train_cfg.grad_clip),
      optax.adamw(make_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                  weight_decay=train_cfg.weight_decay, mask=decay_mask))
  frozen = tuple(train_cfg.get('frozen', ()))
  if not frozen:
    return tx
  trainable = identity.trainable_fn(frozen)
  labels = lambda params: model_lib.map_named(
      lambda name, _: 'trainable' if trainable(name) else 'frozen', params)
  return optax.partition({'trainable': tx, 'frozen': optax.set_to_zero()}, labels)


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
  nonfinite_counts: Callable[[TrainState], Any]
  sample: Callable[[Any, jax.Array, jax.Array], jax.Array]

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

  trainable = identity.trainable_fn(config.train.get('frozen', ()))

  def train_loss(params, batch):
    # No gradient flows into a frozen parameter: XLA drops work it never needs (an embedding's
    # scatter-add), and the reported grad_norm is the one clipping sees.
    params = model_lib.map_named(lambda n, p: p if trainable(n) else jax.lax.stop_gradient(p), params)
    return loss_fn(params, batch)

  def train_step(state: TrainState, batch):
    loss, grads = jax.value_and_grad(train_loss)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A frozen parameter keeps its exact bytes (p + 0.0 would turn -0.0 into +0.0): a resume
    # reads it again from the init_from file and must find what the loop had.
    params = jax.tree.map(lambda keep, new, old: new if keep else old,
                          model_lib.map_named(lambda n, _: trainable(n), params), params, state.params)
    return TrainState(params, opt_state), {'loss': loss, 'grad_norm': optax.tree.norm(grads)}

  batch_sh = (sharding.batch_sharding(mesh),) * 2
  replicated = sharding.replicated(mesh)
  return Trainer(
      config=config, mesh=mesh, model=model, tx=tx, state_shardings=state_shardings,
      init_fn=init_fn,
      train_step=jax.jit(train_step, in_shardings=(state_shardings, batch_sh),
                         out_shardings=(state_shardings, replicated), donate_argnums=0),
      eval_step=jax.jit(loss_fn, in_shardings=(state_shardings.params, batch_sh),
                        out_shardings=replicated),
      nonfinite_counts=jax.jit(_nonfinite_counts, in_shardings=(state_shardings,),
                               out_shardings=replicated),
      sample=jax.jit(functools.partial(_sample, model, config.samples),
                     in_shardings=(state_shardings.params, replicated, replicated),
                     out_shardings=replicated))


def _sample(model, samples_cfg, params, tokens, rng):
  """Continue each row of `tokens` (n, block) from its prompt, one token per forward pass."""
  start = len(samples_cfg.prompt.encode())
  stop = min(tokens.shape[1], start + samples_cfg.length)

  def body(t, carry):
    tokens, rng = carry
    rng, key = jax.random.split(rng)
    logits = model.apply({'params': params}, tokens)[:, t - 1]  # (n, V)
    token = jax.random.categorical(key, logits / samples_cfg.temperature)
    return tokens.at[:, t].set(token.astype(tokens.dtype)), rng

  return jax.lax.fori_loop(start, stop, body, (tokens, rng))[0]


def generate_samples(trainer: Trainer, params, step: int) -> list[str]:
  """A few short samples from the model, for the audit trail (`samples.json`)."""
  cfg = trainer.config.samples
  prompt = np.frombuffer(cfg.prompt.encode(), np.uint8)
  tokens = np.zeros((cfg.count, trainer.config.model.block_size), np.int32)
  tokens[:, :len(prompt)] = prompt
  rng = jax.random.fold_in(jax.random.key(trainer.config.seed), step)
  out = np.asarray(trainer.sample(params, tokens, rng))
  stop = min(out.shape[1], len(prompt) + cfg.length)
  return [bytes(row[:stop].astype(np.uint8)).decode('utf-8', errors='replace') for row in out]


def _nonfinite_counts(tree):
  def count(x):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.int32(0)
    return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)
  return jax.tree.map(count, tree)


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
  if config.samples.keep < 0:
    raise ConfigError('E-CONFIG-001', f'samples.keep={config.samples.keep} is negative',
                      'set --config.samples.keep to the rounds to keep (0: none)')
  if len(config.samples.prompt.encode()) >= m.block_size:
    raise ConfigError('E-CONFIG-001', 'samples.prompt is as long as model.block_size',
                      'shorten --config.samples.prompt')
  bandit_lib.validate(config.bandit, list(config.data.sources))
  init_from_lib.validate(config)
  checkpoint_options(config)  # validates mode and counts
  during_training.options_from_config(config)  # validates export cadence, formats, retention


def checkpoint_options(config) -> CheckpointOptions:
  c = config.checkpoint
  return CheckpointOptions(every_steps=c.every, every_secs=c.secs, mode=c.mode, keep=c.keep,
                           keep_every=c.keep_every, storage=c.storage)


def find_resume_point(resume: str, ckpt_dir: Path,
                      known_bad: Mapping[Path, str] | None = None) -> Path | None:
  """The committed checkpoint directory (or `.bin` file) to continue from; None: a fresh start.

  `latest`: the newest committed checkpoint, or a fresh start when there is none.
  `none`: a fresh start, refused when checkpoints exist (it would fork the run's history).
  `PATH.bin`: a raw `step_NNNNNN.bin` export (weights, Adam m and v; see `jaxckpt.bin_resume`).
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
    path, skipped = inspection.latest_intact_or_raise(ckpt_dir, checksums=False,
                                                      known_bad=known_bad)
    for bad, problem in skipped:
      if bad not in (known_bad or {}):  # those were warned about when they failed
        logging.warning('passing over %s: %s', bad, problem)
    return path
  if resume == 'none':
    steps = layout.committed_steps(ckpt_dir)
    if steps:
      raise ResumeError('E-RESUME-001', f'--resume=none but {ckpt_dir} already holds committed '
                        f'checkpoints (steps {min(steps)}..{max(steps)}); starting fresh would '
                        'silently fork the run\'s history', 'use --resume=latest to continue, '
                        'or a new --workdir to start over')
    return None
  # An explicit PATH that fails is an error, here or (a checksum) when it is loaded.
  return inspection.verify_or_raise(resume, checksums=False)


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


def run_identity(trainer: Trainer, provenance: dict | None = None, *,
                 init_from: dict[str, Any] | None = None) -> dict[str, Any]:
  """What this run is, for every checkpoint's manifest (see `jaxckpt.identity`).

  `init_from` is the pin of the file initial weights come from (`init_from.pin`); trainable per
  parameter follows `config.train.frozen`.
  """
  provenance = provenance or {}
  abstract = trainer.abstract_state()
  return identity.build(
      config=trainer.config, params=abstract.params, opt_state=abstract.opt_state,
      partition_specs=trainer.state_shardings.params, mesh_shape=dict(trainer.mesh.shape),
      devices=jax.device_count(), processes=jax.process_count(),
      platform=jax.devices()[0].platform, knobs=provenance.get('knobs'),
      sources=provenance.get('sources'),
      trainable=identity.trainable_fn(trainer.config.train.get('frozen', ())),
      init_from=init_from, versions=versions())


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


class NonFiniteError(JaxckptError):
  """A proposed checkpoint holds NaN or inf: nothing of it is committed."""

  def line(self) -> str:
    return self.what


def check_finite(trainer: Trainer, state: TrainState, step: int) -> None:
  """Refuse to commit `state` if any parameter or optimizer state holds NaN or inf.

  One fused reduction on the devices, one scalar per tensor to the host.
  """
  counts = jax.device_get(named_leaves(trainer.nonfinite_counts(state)))
  bad = [(param_of_leaf(leaf) or ('state', leaf), int(n)) for leaf, n in counts.items() if n]
  if not bad:
    return
  # Name a parameter when one is bad: that is where the trouble shows first.
  (kind, name), count = min(bad, key=lambda b: b[0][0] != 'params')
  what = {'params': 'parameter', 'm': 'optimizer state (Adam m) of',
          'v': 'optimizer state (Adam v) of'}.get(kind, 'state')
  raise NonFiniteError('E-GUARD-001', f'step {step}: the proposed {what} {name} has {count} '
                       'values that are not finite; nothing was committed')


def evaluate(trainer: Trainer, params, dataset: data_lib.Dataset) -> float:
  losses = [trainer.eval_step(params, trainer.put_batch(b))
            for b in dataset.heldout_batches(trainer.config.train.eval_batches)]
  return float(np.mean(jax.device_get(losses)))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                       resume: str = 'latest', provenance: dict | None = None,
                       watcher: signals.PreemptionWatcher | None = None) -> TrainState:
  """Train `config` in `workdir`, continuing the run there if there is one. Returns the state.

  `provenance` ({'knobs', 'sources'} from `jaxckpt.identity.provenance`) says where each config
  value came from; it is recorded in every checkpoint's manifest. `watcher` is one `main`
  installed at start-up, for the whole process; without it, signals are watched while this runs.

  Raises `signals.Interrupted` after checkpointing when a stop signal arrived (see
  `jaxckpt.checkpoint.signals`), and `JaxckptError`s for problems the user can fix.
  """
  validate_config(config)
  workdir = Path(workdir)
  with watcher or signals.PreemptionWatcher() as watcher, WorkdirLock(workdir) as lock:
    ckpt_dir = workdir / 'checkpoints'
    resume_dir = find_resume_point(resume, ckpt_dir)
    dataset = data_lib.from_config(config)
    trainer = build_trainer(config)
    pin = init_from_lib.pin(config.train.get('init_from', ''), fresh=resume_dir is None)
    runlog = RunLog(workdir)
    exporter = during_training.Exporter(workdir / 'exports', config, runlog)  # cleans debris

    def on_commit(info: CommitInfo) -> None:
      runlog.event('checkpoint', step=info.step, path=str(info.path), bytes=info.bytes,
                   seconds_blocked=round(info.seconds_blocked, 6),
                   seconds_to_commit=round(info.seconds_to_commit, 6),
                   deleted=list(info.deleted))
      if info.retention_errors:
        runlog.event('retention_failed', step=info.step, problems=list(info.retention_errors))
      runlog.status(last_checkpoint=info.step, last_checkpoint_path=str(info.path))
      # From the host copy this checkpoint staged, on the save thread; the next save waits.
      # (`run` is bound below, before the first save.)
      exported = exporter.on_commit(run.for_export(info),
                                    stopping=watcher.stop_signal is not None)
      if exported:
        runlog.status(last_export=exported['step'])

    mgr = CheckpointManager(ckpt_dir, checkpoint_options(config), on_commit=on_commit)
    if lock.previous_holder:
      runlog.event('lock_taken_over', previous=lock.previous_holder)
      logging.info('took over the lock of pid %s (not running)', lock.previous_holder.get('pid'))
    run = _Run(trainer, dataset, mgr, runlog, watcher, workdir,
               identity=run_identity(trainer, provenance, init_from=pin))
    try:
      state, step = _start_passing_over_damaged(run, resume, resume_dir)
      return _loop(run, state, step)
    except signals.Interrupted:
      raise
    except BaseException as e:
      try:
        mgr.close()
      except Exception as close_error:  # the original error is the one to raise; say both
        logging.error('while stopping after %s: the checkpoint in flight failed too: %s',
                      type(e).__name__, close_error)
        runlog.event('save_failed', error=f'{type(close_error).__name__}: {close_error}')
      runlog.event('failed', error=f'{type(e).__name__}: {e}')
      runlog.status(state='failed', error=f'{type(e).__name__}: {e}')
      raise
    finally:
      mgr.close()


@dataclasses.dataclass
class _Run:
  """What one invocation of the trainer works with."""
  trainer: Trainer
  dataset: data_lib.Dataset
  mgr: CheckpointManager
  runlog: RunLog
  watcher: signals.PreemptionWatcher
  workdir: Path
  identity: dict[str, Any]
  bandit: bandit_lib.Bandit | None = None
  resumed_from: Path | None = None  # the checkpoint directory (or .bin) this start restored
  # The frozen parameters read from init_from, by dotted name. No checkpoint holds them (a resume
  # reads the pinned file again); the exporter gets them from here.
  file_frozen: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def frozen_params(self) -> dict[str, jax.ShapeDtypeStruct]:
    """{dotted name: shape and dtype} of the parameters `config.train.frozen` names."""
    trainable = identity.trainable_fn(self.trainer.config.train.get('frozen', ()))
    params = self.trainer.abstract_state().params
    return {n: x for n, x in model_lib.flatten_params(params, self.trainer.config.model).items()
            if not trainable(n)}

  def not_saved(self, leaf: str) -> bool:
    """The `exclude` of `CheckpointManager.save`: frozen parameters the init_from file holds."""
    which = param_of_leaf(leaf)
    return which is not None and which[0] == 'params' and which[1] in self.file_frozen

  def for_export(self, info: CommitInfo) -> CommitInfo:
    """`info` with what a checkpoint leaves out put back, for the exporter.

    That is the frozen parameters the init_from file holds, and zero Adam moments for every
    frozen parameter: they have none, and zeros are what Adam starts from should a later run
    train them.
    """
    if not self.frozen_params:
      return info
    extra = {'params/' + n.replace('.', '/'): x for n, x in self.file_frozen.items()}
    if any((param_of_leaf(leaf) or ('',))[0] == 'm' for leaf in info.staged):
      for name, x in self.frozen_params.items():
        zeros, path = np.zeros(x.shape, x.dtype), name.replace('.', '/')
        extra[f'opt_state/frozen/mu/{path}'] = extra[f'opt_state/frozen/nu/{path}'] = zeros
    return dataclasses.replace(info, staged={**info.staged, **extra})


def _read_init_file(run: _Run, pin: dict[str, Any]) -> dict[str, np.ndarray]:
  return init_from_lib.read(pin['path'], run.trainer.abstract_state().params,
                            run.trainer.config.model)


def _init_from_file(run: _Run, state: TrainState) -> tuple[TrainState, dict[str, Any]]:
  """A fresh state with the parameters the init_from file holds loaded; the event's fields."""
  pin = run.identity['init_from']
  arrays = _read_init_file(run, pin)
  state = state.replace(params=init_from_lib.load_params(state.params, arrays))
  run.file_frozen = {n: x for n, x in arrays.items() if n in run.frozen_params}
  fresh = [n for n in model_lib.parameter_names(run.trainer.config.model) if n not in arrays]
  return state, {'path': pin['path'], 'sha256': pin['sha256'], 'loaded': list(arrays),
                 'fresh_init': fresh, 'frozen': list(run.frozen_params),
                 'not_checkpointed': list(run.file_frozen)}


def _restore(run: _Run, resume_dir: Path, meta: dict[str, Any]
             ) -> tuple[TrainState, dict[str, Any], dict[str, Any] | None]:
  """Restore `resume_dir`: (state, run_state, the init_from event's fields or None).

  The parameters its manifest lists as `excluded` (frozen, from init_from) are read from the
  pinned file, which `identity.compare` has just found unchanged.
  """
  abstract = run.trainer.abstract_state()
  new_pin = run.identity.get('init_from')
  pin = new_pin or meta.get('init_from')  # the config may drop init_from; the file still counts
  left_out = [t['name'] for t in meta.get('excluded') or []]
  arrays = {}
  if pin is not None and (left_out or (new_pin and run.frozen_params)):
    arrays = _read_init_file(run, pin)
  if new_pin:  # else the checkpoints this run writes hold every parameter
    run.file_frozen = {n: x for n, x in arrays.items() if n in run.frozen_params}
  if not left_out:
    state, run_state = run.mgr.restore(resume_dir, abstract)
    return state, run_state, None
  leaves = named_leaves(abstract)
  dotted = lambda leaf: (param_of_leaf(leaf) or ('', leaf))[1]
  unreadable = [n for n in left_out if n not in leaves or dotted(n) not in arrays]
  if unreadable:
    raise ResumeError('E-LOAD-001', f'{resume_dir} does not hold {", ".join(unreadable[:5])} '
                      'and its pinned init_from file does not either', 'resume from a checkpoint '
                      'that holds them, or start a new --workdir')
  restored, run_state = run.mgr.restore(
      resume_dir, {n: x for n, x in leaves.items() if n not in left_out})
  for name in left_out:
    value = arrays[dotted(name)]
    restored[name] = jax.make_array_from_callback(value.shape, leaves[name].sharding,
                                                  lambda idx, value=value: value[idx])
  state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(abstract),
                                       [restored[n] for n in leaves])
  read = {dotted(n) for n in left_out}
  return state, run_state, {'path': pin['path'], 'sha256': pin['sha256'], 'read': [
      n for n in model_lib.parameter_names(run.trainer.config.model) if n in read]}


def _start_passing_over_damaged(run: _Run, resume: str, resume_dir: Path | None
                                ) -> tuple[TrainState, int]:
  """`_start`; with --resume=latest, a checkpoint whose data fails its checksum while it is being
  restored is passed over (with a warning) for the next newest, as a damaged manifest would be."""
  known_bad: dict[Path, str] = {}
  while True:
    try:
      return _start(run, resume_dir)
    except CheckpointError as e:
      if resume != 'latest' or resume_dir is None or e.code != 'E-CKPT-003':
        raise
      logging.warning('passing over %s: %s', resume_dir, e.what)
      known_bad[resume_dir] = e.what
      resume_dir = find_resume_point(resume, run.mgr.directory, known_bad)


def _start(run: _Run, resume_dir: Path | None) -> tuple[TrainState, int]:
  """The initial state and bandit: fresh, or restored from `resume_dir`."""
  config, runlog, mgr = run.trainer.config, run.runlog, run.mgr
  changes: list[str] = []
  loaded = None  # the init_from event's fields
  if resume_dir is None:
    state, step, run_state = run.trainer.init_fn(jax.random.key(config.seed)), 0, {}
    if run.identity.get('init_from'):
      state, loaded = _init_from_file(run, state)
  elif resume_dir.suffix == '.bin':
    state, run_state = restore_from_bin(run.trainer, resume_dir, mgr.directory, runlog)
    step = int(run_state['step'])
  else:
    # Refuse what does not fit before loading anything; record what changed and is allowed.
    meta = mgr.read_manifest(resume_dir)
    changes = identity.compare(meta, run.identity, where=str(resume_dir)).lines
    state, run_state, loaded = _restore(run, resume_dir, meta)
    step = int(run_state['step'])
  runlog.event('started', step=step, segment=runlog.segment, devices=jax.device_count(),
               mesh=dict(run.trainer.mesh.shape))
  if resume_dir is not None:
    runlog.event('resumed', step=step, path=str(resume_dir), changes=changes)
    logging.info('resumed from %s (step %d)', resume_dir, step)
    for line in changes:
      logging.info('changed since the checkpoint: %s', line)
  if loaded is not None:
    _report_init_from(runlog, step, loaded)
  if mgr.removed_debris:
    runlog.event('cleaned', paths=[str(p) for p in mgr.removed_debris])
    logging.info('removed %d incomplete checkpoint(s)', len(mgr.removed_debris))
  run.bandit = _start_bandit(run, run_state.get('bandit'))
  run.resumed_from = resume_dir
  # The cadence counts from here: steps replayed past an older checkpoint are saved again,
  # replacing what an earlier history (or a damaged checkpoint passed over) left at those steps.
  mgr.continue_from(step)
  runlog.status(state='running', step=step, total_steps=config.train.steps,
                last_checkpoint=mgr.latest_step(), phase=run.bandit.state['phase'], error=None)
  return state, step


def _report_init_from(runlog: RunLog, step: int, fields: dict[str, Any]) -> None:
  """One `init_from` event and a log line or three: what came from the file, what did not."""
  runlog.event('init_from', step=step, **fields)
  if 'read' in fields:
    logging.info('read %d frozen parameter(s) the checkpoint does not hold from init_from %s: %s',
                 len(fields['read']), fields['path'], ', '.join(fields['read']))
    return
  loaded, fresh = fields['loaded'], fields['fresh_init']
  logging.info('initialized %d of %d parameters from init_from %s (sha256 %s)', len(loaded),
               len(loaded) + len(fresh), fields['path'], fields['sha256'][:12])
  if fresh:
    logging.info('not in init_from, fresh init: %s', ', '.join(fresh))
  if fields['not_checkpointed']:
    logging.info('frozen and read from init_from on every resume, not checkpointed: %s',
                 ', '.join(fields['not_checkpointed']))


def _start_bandit(run: _Run, saved: dict | None) -> bandit_lib.Bandit:
  """The bandit for this start: restored, fitted to the config's sources and the phase."""
  config, arms = run.trainer.config, run.dataset.names
  phase = phases.current_phase(run.workdir)
  if saved is None:
    return bandit_lib.Bandit(config.bandit, arms, config.seed,
                             bandit_lib.fresh_state(arms, phase))
  state, dropped, added, reset = bandit_lib.reconcile(saved, arms, phase)
  if reset:
    run.runlog.event('bandit_reset', phase=phase, reason='pivot')
    logging.info('phase %d: a fresh bandit over %s', phase, ', '.join(arms))
  if dropped:
    # The zombie-arm guard: a source that left the config can never be sampled again.
    run.runlog.event('bandit_arms_dropped', arms=dropped)
    logging.warning('dropped bandit arm(s) whose data source is no longer configured: %s',
                    ', '.join(dropped))
  if added:
    run.runlog.event('bandit_arms_added', arms=added)
    logging.info('new data source(s) joined the bandit: %s', ', '.join(added))
  return bandit_lib.Bandit(config.bandit, arms, config.seed, state)


def _loop(run: _Run, state: TrainState, step: int) -> TrainState:
  trainer, dataset, mgr, runlog, watcher = (run.trainer, run.dataset, run.mgr, run.runlog,
                                            run.watcher)
  config, total = trainer.config, trainer.config.train.steps
  progress = _Progress(trainer, runlog, step)
  first_step = step
  # The step this run continues from is on disk when it came from this workdir's own checkpoint.
  restored_here = (run.resumed_from is not None
                   and run.resumed_from.resolve() == mgr.step_dir(step).resolve())
  saved = {step} if restored_here else set()
  sample_every = config.samples.every if config.samples.every >= 0 else config.checkpoint.every

  def save(step: int) -> None:
    if config.train.guard_finite:
      check_finite(trainer, state, step)
    progress.flush(log=False)  # the loss history covers every step a checkpoint covers
    counters = {'step': step, 'data_position': step, 'epoch': dataset.epoch(step),
                'tokens_seen': step * progress.tokens_per_step}
    bandit_state = run.bandit.snapshot()
    run_state = {'seed': config.seed, **counters, 'bandit': bandit_state}
    mgr.save(step, state, run_state,
             metadata={**run.identity, 'counters': counters, 'finished': step == total},
             exclude=run.not_saved if run.file_frozen else None)
    phases.write_bandit_mirror(run.workdir, step, bandit_state)
    saved.add(step)

  while step < total and watcher.stop_signal is None:
    arm = run.bandit.choose(step)
    state, metrics = trainer.train_step(state, trainer.put_batch(dataset.batch(step, arm)))
    step += 1
    progress.add(step, metrics)
    run.bandit.record(step, arm, metrics['loss'])
    if step % config.train.log_every == 0 or step == total:
      progress.flush(log=True)
      runlog.status(step=step)
    if config.train.eval_every and step % config.train.eval_every == 0:
      runlog.event('eval', step=step, heldout_loss=evaluate(trainer, state.params, dataset))
    if sample_every and (step % sample_every == 0 or step == total):
      phases.write_samples(run.workdir, run.bandit.state['phase'], step,
                           generate_samples(trainer, state.params, step), config.samples.keep)
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
