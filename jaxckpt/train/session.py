"""One invocation of the trainer: its parts, and the frozen parameters no checkpoint holds."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxckpt.checkpoint import CheckpointManager, CommitInfo, signals
from jaxckpt.model import bandit as bandit_lib
from jaxckpt.model import data as data_lib
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names
from jaxckpt.records import identity
from jaxckpt.records.runlog import RunLog
from jaxckpt.train.state import Trainer


@dataclasses.dataclass
class Session:
  """What one invocation of the trainer works with: built by `train`, filled in by `resume`."""
  trainer: Trainer
  dataset: data_lib.Dataset
  mgr: CheckpointManager
  runlog: RunLog
  watcher: signals.PreemptionWatcher
  workdir: Path
  identity: dict[str, Any]
  bandit: bandit_lib.Bandit | None = None
  resumed_from: Path | None = None  # the checkpoint directory (or .bin) this start restored
  remote: Any = None  # the `remote_run.RemoteRun` of --remote, if any
  # The frozen parameters read from init_from, by dotted name. No checkpoint holds them (a resume
  # reads the pinned file again); the exporter gets them from here.
  file_frozen: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def frozen_params(self) -> dict[str, jax.ShapeDtypeStruct]:
    """{dotted name: shape and dtype} of the parameters `config.train.frozen` names."""
    trainable = identity.trainable_fn(self.trainer.config.train.get('frozen', ()))
    params = self.trainer.abstract_state().params
    return {
        n: x
        for n, x in model_lib.flatten_params(params, self.trainer.config.model).items()
        if not trainable(n)
    }

  def not_saved(self, leaf: str) -> bool:
    """The `exclude` of `CheckpointManager.save`: frozen parameters the init_from file holds."""
    return names.dotted_of_params_leaf(leaf) in self.file_frozen

  def for_export(self, info: CommitInfo) -> CommitInfo:
    """`info` with what a checkpoint leaves out put back, for the exporter.

    That is the frozen parameters the init_from file holds, and zero Adam moments for every
    frozen parameter: they have none, and zeros are what Adam starts from should a later run
    train them.
    """
    if not self.frozen_params:
      return info
    extra = {names.leaf_of_param(n): x for n, x in self.file_frozen.items()}
    if any((names.param_of_leaf(leaf) or ('',))[0] == 'm' for leaf in info.staged):
      for name, x in self.frozen_params.items():
        zeros = np.zeros(x.shape, x.dtype)
        for moment in ('mu', 'nu'):
          extra[names.leaf_of_param(name, f'opt_state/frozen/{moment}')] = zeros
    return dataclasses.replace(info, staged={**info.staged, **extra})
