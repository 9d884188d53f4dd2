"""Resume training from a raw `step_NNNNNN.bin` (weights, Adam m and v; `--resume=FILE.bin`).

    python -m jaxckpt.main --config=configs/tiny.py --workdir=runs/b \
        --resume=runs/a/exports/step_000200.bin

A `.bin` holds the step, the weights and Adam's m and v, nothing else. What it cannot carry and
what happens about it:

- the optimizer's step counts (Adam's bias correction, the learning-rate schedule): set to the
  header's step, which is what they are after that many steps;
- the RNG key and the data position: in this trainer both are functions of (seed, step), so they
  are recomputed from the config's seed and the header's step;
- the run counters (tokens seen, epoch) and the data-source bandit's state: taken from the run
  state of the matching checkpoint (`checkpoints/step_<8 digits>/run_state.json` of this workdir,
  or of the run whose `exports/` holds the `.bin`) when one is committed; otherwise the counters
  are recomputed from the step and the bandit, if any, starts fresh.

With the matching run state the continuation is bit-identical to the run that wrote the `.bin`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from jaxckpt.checkpoint import atomic, layout
from jaxckpt.checkpoint.tree import leaf_name
from jaxckpt.errors import ResumeError
from jaxckpt.export import flatbin
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names

NOT_IN_BIN = ('rng_key', 'data_position', 'run_counters', 'bandit_state')


def matching_run_state(bin_path: Path, ckpt_dir: Path, step: int,
                       seed: int) -> tuple[Path, dict[str, Any]] | None:
  """(path, run state) of a committed checkpoint of `step` from the same seed, or None.

  Looked for in this run's `ckpt_dir`, then in the run whose `exports/` holds the `.bin`.
  """
  dirs = [ckpt_dir]
  if bin_path.resolve().parent.name == 'exports':
    dirs.append(bin_path.resolve().parent.parent / 'checkpoints')
  for d in dirs:
    step_dir = d / layout.step_dirname(step)
    if not (step_dir / layout.MANIFEST).is_file() or not (step_dir / layout.RUN_STATE).is_file():
      continue
    run_state = atomic.read_json(step_dir / layout.RUN_STATE)
    if run_state.get('step') == step and run_state.get('seed', seed) == seed:
      return step_dir / layout.RUN_STATE, run_state
    logging.warning('%s is not the run state of this .bin (step %s, seed %s); not used',
                    step_dir / layout.RUN_STATE, run_state.get('step'), run_state.get('seed'))
  return None


def restore_from_bin(trainer, bin_path: Path, ckpt_dir: Path, runlog) -> tuple[Any, dict]:
  """(state, run_state) for `trainer` from a `.bin`, placed on the trainer's shardings.

  The state is built by `trainer.init_fn`; then every parameter, Adam mu and nu leaf is replaced
  by the file's, and every optax `count` by the header's step.

  Raises:
    ResumeError (E-BIN-001): the file's size is not 8 + 12n for this model (both sizes named).
    ResumeError (E-BIN-004): the optimizer state has no Adam moments to put m and v into.
  """
  config = trainer.config
  bin_path = Path(bin_path)
  step, params, m, v = flatbin.read_bin(bin_path, model_lib.param_shapes(config.model))
  arrays = {'params': params, 'm': m, 'v': v}
  replaced = {'params': 0, 'm': 0, 'v': 0, 'count': 0}

  def replace(path, leaf):
    name = leaf_name(path)
    which = names.param_of_leaf(name)
    if which is not None:
      value = arrays[which[0]][which[1]]
      replaced[which[0]] += 1
    elif name.startswith('opt_state/') and name.rsplit('/', 1)[-1] == 'count':
      value = np.full(leaf.shape, step)
      replaced['count'] += 1
    else:
      return leaf
    return jax.device_put(np.asarray(value, dtype=leaf.dtype).reshape(leaf.shape), leaf.sharding)

  state = jax.tree_util.tree_map_with_path(replace, trainer.init_fn(jax.random.key(config.seed)))
  # Frozen parameters have no moments (the .bin holds zeros for them); none at all is an error.
  if not replaced['m'] or not replaced['v']:
    raise ResumeError(
        'E-BIN-004', f'{bin_path}: the optimizer state has no Adam moments (mu/nu) '
        'to restore m and v into', 'resume a .bin with an optax Adam optimizer')

  found = matching_run_state(bin_path, ckpt_dir, step, config.seed)
  if found is not None:
    run_state_path, run_state = found[0], {**found[1], 'step': step}
    fate = (f'the run counters and bandit state were taken from {run_state_path}, so the '
            'continuation is bit-exact')
  else:
    run_state_path = None
    tokens_per_step = config.train.batch_size * config.model.block_size
    run_state = {
        'step': step, 'seed': config.seed, 'data_position': step,
        'tokens_seen': step * tokens_per_step
    }
    fate = (f'no committed checkpoint of step {step} was found ({layout.step_dirname(step)}/'
            f'{layout.RUN_STATE}), so the run counters were recomputed from the step and the '
            'data-source bandit, if any, starts fresh')
  message = (f'resumed weights, Adam m and v and the optimizer step counts (step {step}) from '
             f'{bin_path}. A .bin does not carry the RNG key, the data position, the run counters '
             f'or the bandit state: the RNG and the data position are derived from (seed '
             f'{config.seed}, step {step}) in this trainer and were recomputed; {fate}')
  logging.warning('%s', message)
  runlog.event(
      'resumed_from_bin',
      step=step,
      path=str(bin_path),
      restored=['params', 'adam_m', 'adam_v', 'optimizer_count'],
      counts_set=replaced['count'],
      not_in_bin=list(NOT_IN_BIN),
      recomputed=['rng_key', 'data_position'] + ([] if found else ['run_counters']),
      run_state=None if run_state_path is None else str(run_state_path),
      message=message)
  return state, run_state
