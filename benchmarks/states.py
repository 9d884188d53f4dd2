"""The trainer's own train states, for benchmarks that must measure jaxckpt on the real thing.

    from benchmarks.states import train_state
    trainer, state, nbytes = train_state("120m")   # TrainState of jax arrays, 449 leaves, 1.46 GB

`synthetic_state` (common.py) imitates a GPT state as a flat dict; these are the real tree built by
`jaxckpt.trainer_lib.build_trainer(config).init_fn`, with its names, shapes, int32 counters and
shardings, so that per-leaf costs (449 leaves for andrea_120m) are what a training run pays.
"""

import importlib
import sys
from pathlib import Path

import jax
import numpy as np

from jaxckpt.checkpoint.tree import leaf_name, named_leaves
from jaxckpt.train import state as trainer_lib

REPO = Path(__file__).resolve().parent.parent
# Short names used on the command lines of every benchmark -> module under configs/.
CONFIGS = {'tiny': 'tiny', '12m': 'andrea_12m', '120m': 'andrea_120m'}

# Typical magnitudes after some training: params ~ N(0, 0.02), Adam m ~ 1e-3, Adam v ~ 1e-6.
_SCALES = (('/mu/', 1e-3), ('/nu/', 1e-6), ('', 0.02))


def get_config(name: str):
  """The ml_collections config of configs/<module>.py for a short name ("12m") or a module."""
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # configs/ is a namespace package at the repo root
  return importlib.import_module(f'configs.{CONFIGS.get(name, name)}').get_config()


def train_state(name: str, seed: int = 0):
  """(trainer, state, state bytes) for a config, every float leaf filled with random values.

    A fresh state is mostly constants: Adam m and v are zeros and LayerNorm scales ones. Any
    compressing checkpointer (orbax's default zstd) would write them in no time and look far
    better than on a state from a real run, so each float leaf gets normal values of its group's
    magnitude (|.| for v). Tree, names, shapes, dtypes and shardings are the trainer's own.
    """
  trainer = trainer_lib.build_trainer(get_config(name))
  state = trainer.init_fn(jax.random.key(seed))
  rng = np.random.default_rng(seed)

  def fill(path, x):
    if not np.issubdtype(x.dtype, np.floating):
      return x  # the int32 step counters stay as they are
    name = leaf_name(path)
    scale = next(s for key, s in _SCALES if key in name)
    values = rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype)
    values *= scale
    if '/nu/' in name:
      np.abs(values, out=values)
    return jax.device_put(values, x.sharding)

  state = jax.tree_util.tree_map_with_path(fill, state)
  jax.block_until_ready(state)
  return trainer, state, state_bytes(state)


def state_bytes(state) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(state))


def as_numpy(state) -> dict[str, np.ndarray]:
  """{leaf name: a writable numpy copy} in tree order: the form benchmarks.baselines takes.

    A copy, not np.asarray's view of the XLA buffer: the peers then read their own memory, as a
    user converting a state for them would, and torch.from_numpy gets writable arrays.
    """
  return {name: np.array(x) for name, x in named_leaves(state).items()}
