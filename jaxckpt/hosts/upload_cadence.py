"""Which local checkpoints go to the remote: `--remote_every`, the second cadence of `--replicas`.

Without `--replicas` the remote holds the only copy that survives a lost host, so every
checkpoint is handed to the uploader (which sends the newest when it falls behind). With
`--replicas` a lost host comes back from its peers, and the remote has only to cover what they
cannot: the whole job, or R+1 neighbouring hosts, lost at once (mean time `--remote_mtbi`).

- `--remote_every=K`: every K-th checkpoint is uploaded.
- `--remote_every=auto` (the default): K = 1, except with `--replicas` and
  `--checkpoint_every=auto`: K = round(T_remote / T_local), T_local the local cadence's interval
  and T_remote Daly's (`cadence.plan`) for δ_up, what an upload costs the loop, and M =
  `--remote_mtbi`, never shorter than the last upload took. δ_up is measured as the local one
  is: the loop's time from the step boundary before an upload starts to the one after it ends,
  less the steps it ran at the clean step time and less what the local saves in that window
  cost (`SaveCadence.position`), smoothed; a guess from the state's size until an upload is
  measured (`PRIOR_UPLOAD_COST_BYTES_PER_S`). Each plan is a `cadence` event with
  `tier: "remote"` (the local one's say `tier: "local"`).
- Whatever K is, the checkpoint a start continues from, the last of each invocation (its last
  step, a stop) and a step kept for good (`--keep_every`) are uploaded.

Across processes (K > 1, or planned) process 0 decides each commit and posts the answer in the
job's key-value store (one count, whatever a save that failed on one process did to the
others'), and every other process uploads its part of exactly those steps, waiting for the
answer at most the job's timeout (then it uploads: a part too many is tidied by the remote
retention, a part missing would hold the commit back). K = 1, the last checkpoint and a step
kept for good (`keep_every`) need no word.
"""

from __future__ import annotations

from typing import Any, Callable

from absl import logging

from jaxckpt.checkpoint import ArgumentError, cadence
from jaxckpt.errors import ConfigError, JaxckptError
from jaxckpt.hosts import distributed

# δ_up before it is measured: the loop time one upload cost andrea_12m (0.303 s for 154 MB, the
# S3 server on the same 2 cores: `benchmarks/results/remote_tokens.json`), per byte of state.
PRIOR_UPLOAD_COST_BYTES_PER_S = 5e8
DEFAULT_REMOTE_MTBI = '3d'
_DECIDED = 'jaxckpt/run/upload/'


def parse_remote_every(value: Any) -> int | str:
  """`--remote_every`: a whole number K >= 1 (every K-th checkpoint) or 'auto'."""
  if isinstance(value, str) and value.strip().lower() == cadence.AUTO:
    return cadence.AUTO
  try:
    k = int(value) if not isinstance(value, (bool, float)) else None
  except ValueError:
    k = None
  if k is None or k < 1:
    raise ConfigError('E-CONFIG-004', f'--remote_every={value!r} is not a whole number >= 1 or '
                      'auto', 'upload every K-th checkpoint with --remote_every=K, or use auto')
  return k


def parse_remote_mtbi(value: Any) -> float:
  """`--remote_mtbi`: a duration (90s, 15m, 6h, 3d, 2w), in seconds."""
  try:
    return cadence.parse_duration(value)
  except ArgumentError as e:
    raise ConfigError(e.code, f'--remote_mtbi: {e.what}', e.fix) from None


class UploadCadence:
  """`take(step)` at each local commit: whether it goes to the remote."""

  def __init__(self, config, cluster: distributed.Cluster, runlog=None):
    c = config.checkpoint
    every = parse_remote_every(c.get('remote_every', cadence.AUTO))
    self.mtbi_s = parse_remote_mtbi(c.get('remote_mtbi', DEFAULT_REMOTE_MTBI))
    self.planned = (
        every == cadence.AUTO and c.get('replicas', 0) > 0
        and cadence.parse_every(c.every) == cadence.AUTO)
    self.k = every if isinstance(every, int) else 1
    self.cluster, self.runlog = cluster, runlog
    self.upload_s = 0.0  # how long the last upload took: a floor for T_remote
    self.plan: cadence.Plan | None = None
    self._since = 0  # commits since the last one that went up
    self._posted: list[int] = []  # the steps process 0 answered for, the last two
    self.delta_s: float | None = None  # δ_up, measured (None: not yet)
    # (time, step, loop seconds the local saves cost so far) at the loop's last step boundary,
    # and its clean step time: `watch`.
    self._position: Callable[[], tuple[float, int, float]] | None = None
    self._step_s: Callable[[], float | None] = lambda: None
    self._began: tuple[float, int, float] | None = None  # the position as an upload started

  def started(self) -> None:
    """The checkpoint the run continues from was handed over: K counts from it."""
    self._since = 0

  def take(self, step: int, *, always: bool = False) -> bool:
    """Whether local commit `step` is uploaded; the same answer on every process. `always`: the
    caller knows it goes up (the last of an invocation, a step kept for good), on every process."""
    if always or (self.k == 1 and not self.planned):
      self._since = 0
      return True
    many = self.cluster.count > 1  # then process 0 answers for every process: one count
    if many and not self.cluster.leader:
      return self._asked(step)
    self._since += 1
    up = self._since >= self.k
    if up:
      self._since = 0
    if many:
      try:
        client = self.cluster.client()
        client.key_value_set(f'{_DECIDED}{step}', '1' if up else '0', allow_overwrite=True)
        self._posted.append(step)
        if len(self._posted) > 2:  # the others read it at their commit of that step, long ago
          client.key_value_delete(f'{_DECIDED}{self._posted.pop(0)}')
      except Exception as e:  # pylint: disable=broad-except  # they wait, then upload anyway
        logging.warning('could not tell the other processes whether step %d is uploaded: %s', step,
                        e)
    return up

  def note(self) -> str:
    """For the progress line, when not every checkpoint goes up."""
    return f'  upload every {self.k} checkpoints' if self.k > 1 else ''

  def _asked(self, step: int) -> bool:
    try:
      return distributed.wait_word(self.cluster, f'{_DECIDED}{step}',
                                   f'whether step {step} is uploaded (process 0)') == '1'
    except JaxckptError as e:
      logging.warning("%s: uploading this process's part of step %d all the same", e.line(), step)
      return True

  def watch(self, position: Callable[[], tuple[float, int, float]],
            step_s: Callable[[], float | None]) -> None:
    """Measure δ_up against the loop's step boundaries (the local cadence's `position`)."""
    self._position, self._step_s = position, step_s

  def upload_started(self) -> None:
    self._began = self._position() if self._position is not None else None

  def uploaded(self, seconds: float) -> None:
    """An upload ended after `seconds`: the floor of T_remote, and a sample of δ_up."""
    self.upload_s = max(0.0, float(seconds))
    began, self._began = self._began, None
    step_s = self._step_s()
    if began is None or self._position is None or not step_s:
      return
    (t0, s0, spent0), (t1, s1, spent1) = began, self._position()
    if s1 <= s0:
      return  # no step ended while it ran: nothing to compare
    sample = cadence.write_slowdown(t1 - t0, s1 - s0, step_s) - (spent1 - spent0)
    self.delta_s = cadence.smooth(self.delta_s, max(0.0, sample))

  def replan(self, local: cadence.Plan, step: int, state_bytes: int) -> None:
    """After each plan of the local cadence (auto): K for its interval, a `cadence` event."""
    if not self.planned or (self.cluster.count > 1 and not self.cluster.leader):
      return
    measured = self.delta_s is not None
    delta = self.delta_s if measured else state_bytes / PRIOR_UPLOAD_COST_BYTES_PER_S
    self.plan = cadence.plan(delta, self.mtbi_s, local.step_s, durable_s=self.upload_s)
    self.k = max(1, round(self.plan.interval_s / max(local.interval_s, 1e-9)))
    if self.runlog is not None:
      self.runlog.event(
          'cadence',
          step=step,
          tier='remote',
          every_checkpoints=self.k,
          upload_s=round(self.upload_s, 6),
          delta_measured=measured,
          **self.plan.as_dict())
    logging.info(
        'remote cadence: every %d checkpoint(s), about %s (%s): δ_up %.3g s%s, M %s, '
        'last upload %.3g s', self.k, cadence.human(self.k * local.interval_s), self.plan.bound,
        delta, '' if measured else ' (a guess)', cadence.human(self.mtbi_s), self.upload_s)
