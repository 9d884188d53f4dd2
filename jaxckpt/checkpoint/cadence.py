"""How often to checkpoint, from what a checkpoint costs and how often the run is interrupted.

Checkpoint too rarely and an interruption throws away hours; too often and the saves eat the
training. Given δ, the seconds one checkpoint costs the training loop, and M, the mean time
between interruptions, the interval that wastes least is Young's `sqrt(2·δ·M)`, refined by
Daly's higher-order estimate (`daly_interval`). A caller measures δ (`write_slowdown`,
`smooth`), learns M from its own history (`blend_mtbi`) and asks `plan` for the interval, in
seconds and in steps. Small pure functions: the caller keeps the state and the clock.

    options = CadenceOptions(mtbi_s=parse_duration('6h'))
    mtbi = blend_mtbi(options.mtbi_s, interruptions=2, exposure_s=3_600.0)
    p = plan(delta_s=0.23, mtbi_s=mtbi, step_s=0.15, options=options, durable_s=0.45)
    p.interval_steps  # save every this many steps; re-plan as δ and M change
"""

from __future__ import annotations

import dataclasses
import math
import re

from .errors import ArgumentError

AUTO = 'auto'
DEFAULT_MTBI_S = 6 * 3600.0  # see CadenceOptions
# The prior weighs as much as this many interruptions seen over this many times M0: once the run
# has run longer than that, its own history outweighs it (see `blend_mtbi`).
PRIOR_WEIGHT = 2.0
# Each new measurement of δ moves the estimate this far (an exponential moving average): one
# slow save (a busy disk, a first-touch of the staging buffer) moves δ by 30% of its excess and
# the interval (about √δ) by less: a save 10x as slow as the estimate makes the interval 1.9x.
DELTA_WEIGHT = 0.3
# A save always costs something (a commit's fsyncs): a δ measured below this is taken as this,
# not as free (with δ = 0, Daly's interval is 0: a checkpoint at every step).
MIN_DELTA_S = 1e-4
# The most steps an interval may hold: a bound of 1e308 s is no bound, not an overflow.
MAX_STEPS = 1 << 62
# Until a save is measured, δ is guessed as the state written at this rate: a local NVMe disk
# writes faster, so the guess errs long, and the first measured save corrects it.
PRIOR_BYTES_PER_S = 2e9
_UNITS = {'': 1.0, 's': 1.0, 'm': 60.0, 'h': 3600.0, 'd': 86400.0, 'w': 7 * 86400.0}
_DURATION = re.compile(r'\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*')


def parse_duration(value: str | float | int) -> float:
  """Seconds of a duration: a number of seconds, or `90s`, `15m`, `6h`, `30d`, `2w`."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    seconds = float(value)
  else:
    match = _DURATION.fullmatch(str(value).lower())
    if match is None:
      raise ArgumentError('E-CONFIG-004', f'{value!r} is not a duration',
                          'give seconds or a number with a unit: 90s, 15m, 6h, 30d, 2w')
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
  if not 0 < seconds < math.inf:
    raise ArgumentError('E-CONFIG-004', f'duration {value!r} is not positive',
                        'give a positive duration: 90s, 15m, 6h, 30d')
  return seconds


def parse_every(value: str | int) -> int | str:
  """A step cadence: a whole number of steps (0: off) or 'auto'."""
  if isinstance(value, str) and value.strip().lower() == AUTO:
    return AUTO
  if isinstance(value, bool) or not isinstance(value, (int, str)):
    raise ArgumentError('E-CONFIG-004', f'checkpoint every {value!r} is not a step count or '
                        f'{AUTO!r}', f'use a whole number of steps (0: off) or {AUTO}')
  try:
    steps = int(value)
  except ValueError:
    raise ArgumentError('E-CONFIG-004', f'checkpoint every {value!r} is not a step count or '
                        f'{AUTO!r}', f'use a whole number of steps (0: off) or {AUTO}') from None
  if steps < 0:
    raise ArgumentError('E-CONFIG-004', f'checkpoint every {steps} is negative',
                        f'use 0 to turn it off, or {AUTO}')
  return steps


def daly_interval(delta_s: float, mtbi_s: float) -> float:
  """Seconds of work between checkpoints that waste least (Daly's higher-order estimate).

  `T = sqrt(2δM)·[1 + (1/3)·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ` for δ < 2M, else M: Young's
  `sqrt(2δM)` with Daly's corrections, which matter once δ is no longer small against M.
  Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", 2006.
  """
  if mtbi_s <= 0:
    raise ArgumentError('E-CONFIG-004', f'mean time between interruptions {mtbi_s} is not '
                        'positive', 'give a positive duration')
  delta_s = max(0.0, delta_s)
  if delta_s >= 2 * mtbi_s:
    return mtbi_s
  x = delta_s / (2 * mtbi_s)
  return math.sqrt(2 * delta_s * mtbi_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta_s


def blend_mtbi(prior_s: float,
               interruptions: int,
               exposure_s: float,
               prior_weight: float = PRIOR_WEIGHT) -> float:
  """The mean time between interruptions, from a prior and the run's own history.

  `exposure_s` is the run's running time so far, over which it was interrupted `interruptions`
  times. The prior is read as evidence: k0 = `prior_weight` interruptions seen over k0·M0 of
  running time. Pooled with the run's own n interruptions over its exposure E,
  `M = (k0·M0 + E) / (k0 + n)`: the conjugate (Gamma-Poisson) estimate of an interruption rate,
  weighed by how much evidence each side has. Before the first interruption M = M0 + E / k0 (a
  run that survives grows M); as evidence grows M tends to the run's own E / n, however far off
  the prior was (a prior of 6 h and one interruption in 1000 h: M = 337 h, not 6 h).
  """
  exposure_s = max(0.0, exposure_s)
  return (prior_weight * prior_s + exposure_s) / (prior_weight + max(0, interruptions))


def smooth(previous: float | None, sample: float, weight: float = DELTA_WEIGHT) -> float:
  """An exponential moving average; the first sample (previous None) is taken as it is."""
  return sample if previous is None else previous + weight * (sample - previous)


def write_slowdown(window_s: float, steps: int, step_s: float) -> float:
  """Seconds the loop lost to a background write: `steps` ran in `window_s` while the write was
  in flight, where `step_s` is their time without one (never negative: noise is not a gain)."""
  return max(0.0, window_s - steps * step_s)


def prior_delta(state_bytes: int) -> float:
  """δ before any save is measured: the state written at `PRIOR_BYTES_PER_S`."""
  return state_bytes / PRIOR_BYTES_PER_S


def epoch_ended(epoch_before: float, epoch_after: float, every: int) -> bool:
  """Whether a step that took the run from `epoch_before` to `epoch_after` epochs ended an
  epoch that is a multiple of `every` (0: never)."""
  return every > 0 and math.floor(epoch_after / every) > math.floor(epoch_before / every)


@dataclasses.dataclass(frozen=True)
class CadenceOptions:
  """What an automatic cadence is told.

  mtbi_s: the prior mean time between interruptions. Six hours by default: the geometric middle
    of what preemptible machines see (spot capacity reclaimed within the hour on a bad day, a
    day or more on a good one; Google's preemptible VMs stop after 24 h at the latest). Waste
    grows slowly around the optimum: an M off by 4x costs 25% more waste than the right one,
    and the run's own history outweighs the prior once it has run longer than
    `prior_weight`·M0 (12 h by default).
  min_secs, max_secs: bounds on the interval (0: none). Whatever they say, a checkpoint is never
    started before the previous one is durable.
  prior_weight: the prior counts as this many interruptions (see `blend_mtbi`).
  """
  mtbi_s: float = DEFAULT_MTBI_S
  min_secs: float = 0.0
  max_secs: float = 0.0
  prior_weight: float = PRIOR_WEIGHT

  def __post_init__(self):
    if not 0 < self.mtbi_s < math.inf:
      raise ArgumentError('E-CONFIG-004', f'checkpoint mtbi {self.mtbi_s} s is not positive',
                          'give a positive duration: 90s, 15m, 6h, 30d')
    for field in ('min_secs', 'max_secs'):
      if not 0 <= getattr(self, field) < math.inf:
        raise ArgumentError('E-CONFIG-004', f'checkpoint {field}={getattr(self, field)} is '
                            'negative or infinite', 'use 0 for no bound')
    if self.max_secs and self.min_secs > self.max_secs:
      raise ArgumentError(
          'E-CONFIG-004', f'checkpoint min_secs={self.min_secs} is above '
          f'max_secs={self.max_secs}', 'lower min_secs or raise max_secs')
    if not self.prior_weight > 0:
      raise ArgumentError('E-CONFIG-004', f'prior_weight={self.prior_weight} is not positive',
                          'use a positive number of pseudo-interruptions')


@dataclasses.dataclass(frozen=True)
class Plan:
  """One choice of interval, with what it is expected to cost."""
  delta_s: float  # what one checkpoint costs the loop
  mtbi_s: float  # mean time between interruptions
  step_s: float  # one training step
  interval_s: float  # seconds of training between checkpoints
  interval_steps: int  # the same in steps: what the loop counts
  bound: str  # what set the interval: daly, min, max or durable
  overhead_pct: float  # share of wall time spent on checkpoints
  lost_s: float  # expected work lost per interruption

  def as_dict(self) -> dict:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in vars(self).items()}


def plan(delta_s: float,
         mtbi_s: float,
         step_s: float,
         options: CadenceOptions = CadenceOptions(),
         durable_s: float = 0.0) -> Plan:
  """The interval for δ = `delta_s` and M = `mtbi_s`, bounded and turned into steps.

  δ is taken as at least `MIN_DELTA_S`, and an interval holds at most `MAX_STEPS` steps.
  `durable_s` is how long the last checkpoint took from its start to being durable: a floor, as
  the next one never starts before. The expected work lost per interruption is half a cycle
  (interval + δ) plus `durable_s`: an interruption while the newest checkpoint is not yet durable
  falls back one more cycle.
  """
  interval, bound = daly_interval(max(delta_s, MIN_DELTA_S), mtbi_s), 'daly'
  if options.max_secs and interval > options.max_secs:
    interval, bound = options.max_secs, 'max'
  if interval < options.min_secs:
    interval, bound = options.min_secs, 'min'
  if interval < durable_s:
    interval, bound = durable_s, 'durable'
  if step_s > 0:  # in whole steps, on the right side of a bound
    rounding = {'daly': round, 'max': math.floor}.get(bound, math.ceil)
    ratio = interval / step_s
    steps = MAX_STEPS if not ratio < MAX_STEPS else max(1, int(rounding(ratio)))
    interval = steps * step_s  # what the loop will really run
  else:
    steps = 1
  cycle = interval + max(0.0, delta_s)
  return Plan(
      delta_s=delta_s,
      mtbi_s=mtbi_s,
      step_s=step_s,
      interval_s=interval,
      interval_steps=steps,
      bound=bound,
      overhead_pct=100.0 * max(0.0, delta_s) / cycle if cycle > 0 else 0.0,
      lost_s=cycle / 2 + durable_s)


def human(seconds: float) -> str:
  """`0.31s`, `57m`, `6.0h`, `30d`: a duration as a person reads it."""
  for unit, size in (('d', 86400), ('h', 3600), ('m', 60)):
    if seconds >= 2 * size:
      return f'{seconds / size:.3g}{unit}'
  return f'{seconds:.3g}s'
