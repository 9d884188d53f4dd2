"""The model's training state, its optimizer and the compiled functions that act on it.

`build_trainer(config)` makes a `Trainer`: the mesh, the GPT, `optax.adamw` behind global-norm
clipping (frozen parameters left out of both), and jitted, sharded functions: `train_step(state,
batch) -> (state, metrics)` (pure; the state is donated), `eval_step`, `sample` and the
non-finite counts the finite guard uses.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jaxckpt.checkpoint import named_leaves
from jaxckpt.errors import JaxckptError
from jaxckpt.model import data as data_lib
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names, sharding
from jaxckpt.records import identity


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any


def make_schedule(train_cfg) -> optax.Schedule:
  """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=train_cfg.lr,
      warmup_steps=train_cfg.warmup_steps,
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
      optax.adamw(
          make_schedule(train_cfg),
          b1=train_cfg.b1,
          b2=train_cfg.b2,
          weight_decay=train_cfg.weight_decay,
          mask=decay_mask))
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
  step_compiled: bool = False  # `compile_train_step` ran: the first step does not compile

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: the target a checkpoint is restored into."""
    shapes = jax.eval_shape(self.init_fn, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                        self.state_shardings)

  def must_compile(self, start: int | None = None) -> bool:
    """Whether a run starting at step `start` (None: not known) has a step left to compile."""
    return not self.step_compiled and (start is None or start < self.config.train.steps)

  def compile_train_step(self, start: int | None = None) -> None:
    """Compile `train_step` for this config's batch now, ahead of the first step (while a
    restore reads the checkpoint): the first call then finds it compiled. The abstract inputs
    carry the shardings the loop's own have; without them the first call compiles again.
    Nothing when `must_compile(start)` is not so (a run finished at `start`)."""
    if not self.must_compile(start):
      return
    sh = sharding.batch_sharding(self.mesh)
    shape = (self.config.train.batch_size, self.config.model.block_size)
    batch = (jax.ShapeDtypeStruct(shape, np.int32, sharding=sh),) * 2
    self.train_step.lower(self.abstract_state(), batch).compile()
    self.step_compiled = True

  def put_batch(self, batch: tuple[np.ndarray, np.ndarray]) -> tuple[jax.Array, jax.Array]:
    sh = sharding.batch_sharding(self.mesh)
    # Every process builds the same global batch and hands each device its slice.
    return tuple(jax.make_array_from_callback(x.shape, sh, lambda idx, x=x: x[idx]) for x in batch)


class StepsInFlight:
  """At most `bound` train steps dispatched and not yet computed (0: no bound).

    Steps are dispatched asynchronously. Unbounded, a loop runs as far ahead of the devices as it
    pleases (up to its next metric fetch, or until XLA's own queue stops it), and a stop signal,
    honoured at the step the loop reached, waits for every one of them. With `bound` 2, the
    default, the loop waits after dispatching step k for step k-1: step k is queued, so the
    devices never idle, and a stop takes at most two step times plus the commit.
    """

  def __init__(self, bound: int):
    self.bound = bound
    self._queue = collections.deque()

  def dispatched(self, result) -> None:
    """Note a step's output (any array of it); wait while more than `bound` - 1 are pending."""
    if not self.bound:
      return
    self._queue.append(result)
    while len(self._queue) >= self.bound:
      jax.block_until_ready(self._queue.popleft())


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
    params = model_lib.map_named(lambda n, p: p
                                 if trainable(n) else jax.lax.stop_gradient(p), params)
    return loss_fn(params, batch)

  def train_step(state: TrainState, batch):
    loss, grads = jax.value_and_grad(train_loss)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A frozen parameter keeps its exact bytes (p + 0.0 would turn -0.0 into +0.0): a resume
    # reads it again from the init_from file and must find what the loop had.
    params = jax.tree.map(lambda keep, new, old: new if keep else old,
                          model_lib.map_named(lambda n, _: trainable(n), params), params,
                          state.params)
    return TrainState(params, opt_state), {'loss': loss, 'grad_norm': optax.tree.norm(grads)}

  batch_sh = (sharding.batch_sharding(mesh),) * 2
  replicated = sharding.replicated(mesh)
  return Trainer(
      config=config,
      mesh=mesh,
      model=model,
      tx=tx,
      state_shardings=state_shardings,
      init_fn=init_fn,
      train_step=jax.jit(
          train_step,
          in_shardings=(state_shardings, batch_sh),
          out_shardings=(state_shardings, replicated),
          donate_argnums=0),
      eval_step=jax.jit(
          loss_fn, in_shardings=(state_shardings.params, batch_sh), out_shardings=replicated),
      nonfinite_counts=jax.jit(
          _nonfinite_counts, in_shardings=(state_shardings,), out_shardings=replicated),
      sample=jax.jit(
          functools.partial(_sample, model, config.samples),
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


class NonFiniteError(JaxckptError):
  """A proposed checkpoint holds NaN or inf: nothing of it is committed."""

  def line(self) -> str:
    return self.what


def check_finite(trainer: Trainer, state: TrainState, step: int) -> None:
  """Refuse to commit `state` if any parameter or optimizer state holds NaN or inf.

  One fused reduction on the devices, one scalar per tensor to the host.
  """
  counts = jax.device_get(named_leaves(trainer.nonfinite_counts(state)))
  bad = [(names.param_of_leaf(leaf) or ('state', leaf), int(n)) for leaf, n in counts.items() if n]
  if not bad:
    return
  # Name a parameter when one is bad: that is where the trouble shows first.
  (kind, name), count = min(bad, key=lambda b: b[0][0] != 'params')
  what = {
      'params': 'parameter', 'm': 'optimizer state (Adam m) of', 'v': 'optimizer state (Adam v) of'
  }.get(kind, 'state')
  raise NonFiniteError(
      'E-GUARD-001', f'step {step}: the proposed {what} {name} has {count} '
      'values that are not finite; nothing was committed')


def evaluate(trainer: Trainer, params, dataset: data_lib.Dataset) -> float:
  losses = [
      trainer.eval_step(params, trainer.put_batch(b))
      for b in dataset.heldout_batches(trainer.config.train.eval_batches)
  ]
  return float(np.mean(jax.device_get(losses)))
