"""A data-source bandit: EXP3 with per-arm probability floors and ceilings.

Each training batch comes from one data source (an arm). The bandit favours sources whose
batches improve the loss most. Its state is part of the checkpoint's run state, so a resumed run
picks exactly the arms the uninterrupted run would have picked.

Determinism: the arm of step k is drawn with a generator seeded by (seed, k); rewards are applied
every `update_every` steps, from the losses of the steps since the last update (kept as `pending`
in the state), so the schedule of updates depends on step numbers only, never on wall time.

The state is JSON: arms, log-weights, pulls, EMA rewards and losses, the phase and its step
counter. A pivot starts a new phase with a fresh bandit; on every resume, arms whose source left
the config are dropped (the "zombie arm" guard) and new sources join.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Sequence

import numpy as np

from jaxckpt.checkpoint.options import finite
from jaxckpt.errors import ConfigError


def probabilities(log_weights: Sequence[float], gamma: float, floors: Sequence[float],
                  ceilings: Sequence[float]) -> np.ndarray:
  """EXP3's mixture of the weights with uniform exploration, held within [floor, ceiling]."""
  if len(log_weights) == 1:
    return np.ones(1)
  w = np.exp(np.asarray(log_weights, np.float64) - np.max(log_weights))
  p = (1 - gamma) * w / w.sum() + gamma / len(w)
  lo, hi = np.asarray(floors, np.float64), np.asarray(ceilings, np.float64)
  # Clip, then spread what the clipped arms gave up or took over the free arms; a few rounds
  # settle it because every round fixes at least one more arm at its bound.
  fixed = np.zeros(len(p), bool)
  for _ in range(len(p) + 1):
    p = np.where(fixed, p, np.clip(p, lo, hi))
    excess = 1.0 - p.sum()
    free = ~fixed & (p > lo if excess < 0 else p < hi)
    if abs(excess) < 1e-12 or not free.any():
      break
    p[free] += excess * p[free] / p[free].sum()
    fixed |= (p <= lo) | (p >= hi)
  return p / p.sum()


class Bandit:
  """Chooses the source of each step's batch and learns from the losses."""

  def __init__(self, cfg, arms: Sequence[str], seed: int, state: Mapping[str, Any] | None = None):
    self.cfg, self.seed = cfg, seed
    if state is None:
      state = fresh_state(arms, phase=0)
    self.state = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in state.items()}
    self._floors = [bound(cfg, 'floor', a) for a in self.state['arms']]
    self._ceilings = [bound(cfg, 'ceiling', a) for a in self.state['arms']]
    self._pending_device: list[tuple[int, Any]] = []  # (arm, loss still on the device)

  @property
  def arms(self) -> list[str]:
    return self.state['arms']

  def probabilities(self) -> np.ndarray:
    return probabilities(self.state['log_weights'], self.cfg.gamma, self._floors, self._ceilings)

  def choose(self, step: int) -> int:
    if len(self.arms) == 1:
      return 0
    u = np.random.default_rng([self.seed, step, 0xB4]).random()
    return int(
        min(np.searchsorted(np.cumsum(self.probabilities()), u, side='right'),
            len(self.arms) - 1))

  def record(self, step: int, arm: int, loss) -> None:
    """Note the loss of `step` (a device scalar is fine); learn every `update_every` steps."""
    self.state['pulls'][arm] += 1
    self.state['phase_steps'] += 1
    if len(self.arms) == 1:
      return  # nothing to learn, and no reason to sync with the device
    self._pending_device.append((arm, loss))
    if step % self.cfg.update_every == 0:
      self.update()

  def _settle(self) -> None:
    """Bring pending device losses to the host (one sync for the whole window)."""
    if self._pending_device:
      import jax
      losses = jax.device_get([l for _, l in self._pending_device])
      self.state['pending'] += [[a, float(l)] for (a, _), l in zip(self._pending_device, losses)]
      self._pending_device = []

  def update(self) -> None:
    self._settle()
    p = self.probabilities()
    for arm, loss in self.state['pending']:
      prev = self.state['ema_loss'][arm]
      # Reward in [0, 1]: relative loss improvement on this arm since its last batches.
      gain = 0.0 if prev is None else (prev - loss) / max(abs(prev), 1e-8)
      reward = 0.5 + 0.5 * math.tanh(10.0 * gain)
      a = self.cfg.ema
      self.state['ema_loss'][arm] = loss if prev is None else a * prev + (1 - a) * loss
      old = self.state['ema_reward'][arm]
      self.state['ema_reward'][arm] = reward if old is None else a * old + (1 - a) * reward
      # Importance-weighted EXP3 update, centred so weights stay bounded.
      self.state['log_weights'][arm] += self.cfg.eta * (reward - 0.5) / p[arm]
    self.state['pending'] = []

  def snapshot(self) -> dict[str, Any]:
    """A copy of the JSON state, pending losses included (it syncs them from the device).

    Deep: `record` and `update` change the state's lists in place from the next step on, and a
    snapshot handed to an async save must keep this step's values.
    """
    self._settle()
    return {**copy.deepcopy(self.state), 'probabilities': [float(x) for x in self.probabilities()]}


def fresh_state(arms: Sequence[str], phase: int) -> dict[str, Any]:
  n = len(arms)
  return {
      'arms': list(arms), 'log_weights': [0.0] * n, 'pulls': [0] * n, 'ema_reward': [None] * n,
      'ema_loss': [None] * n, 'pending': [], 'phase': phase, 'phase_steps': 0
  }


def bound(cfg, which: str, arm: str) -> float:
  per_arm = cfg.get(f'{which}s') or {}
  return float(per_arm.get(arm, cfg.get(which)))


def reconcile(state: Mapping[str, Any], arms: Sequence[str],
              phase: int) -> tuple[dict[str, Any], list[str], list[str], bool]:
  """Fit a restored bandit state to the config's sources and the workdir's phase.

  Returns (state, dropped arms, added arms, reset). A new phase (after a pivot) starts a fresh
  bandit. Otherwise arms whose source is gone are dropped, so they can never be sampled again,
  and new sources join with the mean weight and no history.
  """
  if state.get('phase') != phase:
    return fresh_state(arms, phase), [], [], True
  old = list(state['arms'])
  dropped = [a for a in old if a not in arms]
  added = [a for a in arms if a not in old]
  if old == list(arms):
    return dict(state), [], [], False
  # Laid out in the order of `arms` (the dataset's sources, whose positions `choose` returns):
  # in the saved order with new arms last, a new source sorting before the others would shift
  # every weight, floor and count onto another source.
  kept = [a for a in arms if a in old]
  mean = float(np.mean([state['log_weights'][old.index(a)] for a in kept])) if kept else 0.0
  out = {k: state[k] for k in ('phase', 'phase_steps')}
  for key, value in (('log_weights', mean), ('pulls', 0), ('ema_reward', None), ('ema_loss', None)):
    out[key] = [state[key][old.index(a)] if a in old else value for a in arms]
  out['arms'] = list(arms)
  remap = {old.index(a): i for i, a in enumerate(arms) if a in old}
  out['pending'] = [[remap[a], l] for a, l in state['pending'] if a in remap]
  return out, dropped, added, False


def validate(cfg, arms: Sequence[str]) -> None:
  floors = [bound(cfg, 'floor', a) for a in arms]
  ceilings = [bound(cfg, 'ceiling', a) for a in arms]
  if any(not 0 <= f <= c <= 1 for f, c in zip(floors, ceilings)):
    raise ConfigError('E-CONFIG-005', 'bandit floors/ceilings must satisfy 0 <= floor <= '
                      'ceiling <= 1', 'fix bandit.floor, bandit.ceiling, bandit.floors, '
                      'bandit.ceilings')
  if len(arms) > 1 and (sum(floors) > 1 + 1e-9 or sum(ceilings) < 1 - 1e-9):
    raise ConfigError(
        'E-CONFIG-005', f'bandit floors sum to {sum(floors):.3f} and ceilings to '
        f'{sum(ceilings):.3f} over {len(arms)} sources; no distribution fits',
        'floors must sum to <= 1 and ceilings to >= 1')
  if cfg.update_every <= 0 or not 0 <= cfg.gamma <= 1:
    raise ConfigError('E-CONFIG-005', 'bandit.update_every must be positive and bandit.gamma '
                      'in [0, 1]', 'fix the bandit config')
  # A NaN here turns every probability into NaN and the floors no longer hold.
  eta, ema = cfg.get('eta', 0.0), cfg.get('ema', 0.0)
  if not (finite(eta) is not None and eta >= 0 and finite(ema) is not None and 0 <= ema < 1):
    raise ConfigError(
        'E-CONFIG-005', f'bandit.eta={eta!r} and bandit.ema={ema!r}: eta must be a finite number '
        '>= 0 and ema a number in [0, 1)', 'fix bandit.eta or bandit.ema (defaults: 0.05, 0.9)')
