"""Goodput with the peer tier (`--replicas=1`) against the remote alone, in long simulated runs.

    python -m benchmarks.tiers               # the docs table (a few seconds on 2 cores)
    python -m benchmarks.tiers --seed=1      # other failures
    python -m benchmarks.tiers --days=200    # shorter runs, noisier
    python -m benchmarks.tiers --upload_cost_s=0.5 --remote_restore_s=120 --restart_s=30

Pure Python and numpy: no JAX, no disk, in the manner of `benchmarks.cadence` (whose failure
draws and andrea_120m profile it reuses). A run of a many-host job meets two kinds of failure,
each with exponential gaps: one host lost with its disk (mean M_host) and the whole job lost, or
R+1 neighbouring hosts, which the peers cannot cover (mean M_job). Each scenario runs for about
`--days` of wall time (the expected count of failures at the combined rate, drawn with
`cadence.gaps`, each a host loss with probability M_job / (M_host + M_job)); every policy faces
the same failures. Goodput = training kept at the end / wall time; the rest goes to checkpoints
(the loop's pauses), lost work (trained, then thrown away by a failure) and restarts.

Policies, their intervals from `jaxckpt.checkpoint.cadence.plan` (Daly, in whole steps):

  * remote only (a run without `--replicas`): one checkpoint every T = plan(δ + δ_up, M), M the
    combined mean; each is uploaded and protects only once the upload is committed; every
    failure goes back to the newest uploaded checkpoint and every host downloads it.
  * two tiers, one cadence (`--replicas=1 --remote_every=1`): the same T, every checkpoint
    written with the neighbour's part and uploaded; a host loss goes back to the newest locally
    committed checkpoint and restarts from the peers, a job loss as remote only.
  * two tiers, two cadences (`--replicas=1 --remote_every=auto`): a local + peer checkpoint
    every T_local = plan(2δ, M_host) and an upload of every k-th, k = round(T_remote / T_local)
    with T_remote = plan(δ_up, M_job). The next upload is due k local saves after the newest
    uploaded one, counted across restarts from the peers (the trainer also uploads the
    checkpoint a restart continues from: one δ_up more per restart, not simulated).

Costs (andrea_120m, 1.46 GB; `Costs`; the upload's cost, the remote restore and the restart
overhead have flags, being the least certain):
  * δ = 0.23 s and 0.45 s to commit per local part: `benchmarks.cadence`'s andrea_120m profile
    (measured here: save() blocks 0.082 s, commits in 0.45 s; 40% of the write as slowdown).
    With `--replicas=1` a host writes two parts (its own and its neighbour's, a data-parallel
    state sends nothing over the interconnect): assumed twice that, 0.46 s and 0.9 s.
  * δ_up = 2.86 s, what an upload costs the loop: 0.303 s measured for andrea_12m's 154 MB
    (`remote_tokens.json`, the S3 server on the same 2 cores, so pessimistic), scaled to
    1.46 GB. Committed remotely 6.41 s after save() (`remote.json`), 0.45 s later with two parts.
  * restarts: 60 s each (process start + compile, as `benchmarks.cadence` assumes for an H200),
    plus the state back on the devices: 7.53 s from the peers, 14.96 s when every host
    downloads from the remote (`peers.json`, medians of 2); a host loss is noticed
    `cadence.HEARTBEAT_S` = 60 s later (E-DIST-006), a whole-job loss at once. Not counted: the
    time to get a replacement VM (the same for every policy).
  * steps of 0.15 s (assumed for one H200), for the whole-step rounding of the intervals.

Simplifications: the schedule restarts at each resume (the first save T after it); a failure
during a restart starts a new one; a save's pause cut short by a failure counts as far as it ran.
Writes benchmarks/results/tiers.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from benchmarks import cadence as sim
from benchmarks.common import print_table, write_results
from jaxckpt.checkpoint import cadence

HOUR, DAY = 3600.0, 86400.0
WEEK = 7 * DAY
PROFILE = sim.PROFILES['andrea_120m']
# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16k GPUs (Llama 3 paper,
# section 3.3.4). Most were one GPU or host; taken here as 90% single-host losses, 10% beyond
# what the peers cover (an assumption: the paper does not say how many took more than one host).
LLAMA3 = {'interruptions': 419, 'days': 54.0, 'host_share': 0.9}


@dataclasses.dataclass(frozen=True)
class Costs:
  part_delta_s: float = PROFILE.delta_s  # one local part: what a save costs the loop
  part_durable_s: float = PROFILE.durable_s  # one local part: save() to committed
  upload_delta_s: float = 0.303 * 1_455_792_768 / 154e6  # an upload's cost to the loop
  upload_durable_s: float = 6.41  # save() to committed remotely (one part)
  restart_s: float = PROFILE.restart_s  # process start + compile, every restart
  heartbeat_s: float = sim.HEARTBEAT_S  # a lost host is noticed this long after
  peer_restore_s: float = 7.53  # the state on every device, from the peers
  remote_restore_s: float = 14.96  # the state on every device, every host downloading
  step_s: float = PROFILE.step_s


@dataclasses.dataclass(frozen=True)
class Policy:
  name: str
  interval_s: float  # training between two local saves
  every: int  # every this many saves is uploaded
  delta_s: float  # a save's pause, without the upload's
  upload_delta_s: float  # the upload's pause, on an uploaded save
  local_durable_s: float | None  # from a save to a host loss it survives (None: no peer tier)
  upload_durable_s: float
  host_restore_s: float  # the state back on the devices after a host loss
  job_restore_s: float


def policies(m_host: float, m_job: float, c: Costs) -> dict[str, Policy]:
  mtbi = 1 / (1 / m_host + 1 / m_job)
  delta_two, durable_two = 2 * c.part_delta_s, 2 * c.part_durable_s  # own part + neighbour's
  upload_two = c.upload_durable_s + durable_two - c.part_durable_s
  one = cadence.plan(
      c.part_delta_s + c.upload_delta_s, mtbi, c.step_s, durable_s=c.upload_durable_s).interval_s
  local = cadence.plan(delta_two, m_host, c.step_s, durable_s=durable_two).interval_s
  remote = cadence.plan(c.upload_delta_s, m_job, c.step_s, durable_s=upload_two).interval_s
  local = min(local, remote)  # an upload is of a local checkpoint: never rarer than uploads
  every = max(1, round(remote / local), math.ceil(upload_two / local))
  return {
      'remote':
          Policy('remote only', one, 1, c.part_delta_s, c.upload_delta_s, None, c.upload_durable_s,
                 c.remote_restore_s, c.remote_restore_s),
      'one':
          Policy('two tiers, one cadence', one, 1, delta_two, c.upload_delta_s, durable_two,
                 upload_two, c.peer_restore_s, c.remote_restore_s),
      'two':
          Policy('two tiers, two cadences', local, every, delta_two, c.upload_delta_s, durable_two,
                 upload_two, c.peer_restore_s, c.remote_restore_s),
  }


def _begun(x: float, p: Policy) -> int:
  """Saves begun by `x` s into a start whose first upload is due at save `every` (none if x < 0).

  Save j (1-based, j - 1 = q·k + m, 0 <= m < k) begins at T + q·C + m·(T + δ), a group of k saves
  (the last one uploaded) lasting C = k·(T + δ) + δ_up.
  """
  if x < p.interval_s:
    return 0
  cycle = p.interval_s + p.delta_s
  group = p.every * cycle + p.upload_delta_s
  q = math.floor((x - p.interval_s) / group)
  m = min(p.every - 1, math.floor((x - p.interval_s - q * group) / cycle))
  return q * p.every + m + 1


def _uploaded(x: float, p: Policy) -> int:
  """Uploaded saves committed remotely by `x` s into a start (the k-th, 2k-th, ... saves)."""
  cycle = p.interval_s + p.delta_s
  group = p.every * cycle + p.upload_delta_s
  first = p.interval_s + (p.every - 1) * cycle + p.upload_durable_s
  return max(0, math.floor((x - first) / group) + 1)


def simulate(gap, host, p: Policy, c: Costs) -> dict:
  """Wall time shares of one policy over the gaps between failures (`host`: a host loss)."""
  pos = local = remote = 0.0  # training kept: restored from, newest on the peers, uploaded
  trained = paused = restarting = 0.0
  after_host = False  # the first start is a launch: a job's restart without a heartbeat
  for g, h in zip(gap.tolist(), host.tolist()):
    restart = c.restart_s + (c.heartbeat_s + p.host_restore_s if after_host else p.job_restore_s)
    run = max(0.0, g - restart)
    restarting += min(g, restart)
    # Uploads due k saves after the newest uploaded one: this start's first after `due` saves.
    due = p.every - min(p.every - 1, round((pos - remote) / p.interval_s))
    offset = (p.every - due) * (p.interval_s + p.delta_s)  # as if `every - due` saves were done
    shift = p.every - due
    begun = _begun(run + offset, p) - shift if run > 0 else 0
    pauses = begun * p.delta_s + (begun + shift) // p.every * p.upload_delta_s
    train = max(begun * p.interval_s, run - pauses)
    trained += train
    paused += run - train
    if p.local_durable_s is not None:
      done = max(0, _begun(run + offset - p.local_durable_s, p) - shift) if run > 0 else 0
      local = max(local, pos + done * p.interval_s)
    ups = _uploaded(run + offset, p) if run > 0 else 0
    if ups:
      remote = pos + (ups * p.every - shift) * p.interval_s
    pos = local if h and p.local_durable_s is not None else remote
    local = pos  # the restored checkpoint is on every disk again; a newer one is gone
    after_host = bool(h)
  wall = float(gap.sum())
  return {
      'goodput_pct': 100 * pos / wall, 'ckpt_pct': 100 * paused / wall,
      'lost_pct': 100 * (trained - pos) / wall, 'restart_pct': 100 * restarting / wall
  }


def scenario(name: str, m_host: float, m_job: float, days: float, seed: int, c: Costs) -> dict:
  mtbi = 1 / (1 / m_host + 1 / m_job)
  n = max(1, round(days * DAY / mtbi))
  gap = sim.gaps(mtbi, n, seed)
  host = sim.host_losses(n, m_job / (m_host + m_job), seed)
  plans = policies(m_host, m_job, c)
  row = {
      'scenario': name, 'm_host_h': round(m_host / HOUR, 2), 'm_job_d': round(m_job / DAY, 2),
      'host_losses': int(host.sum()), 'job_losses': int(n - host.sum()),
      'days': round(float(gap.sum()) / DAY, 1), 'remote_T_s': round(plans['remote'].interval_s, 2),
      'local_T_s': round(plans['two'].interval_s, 2), 'upload_every': plans['two'].every,
      'upload_T_s': round(plans['two'].interval_s * plans['two'].every, 2)
  }
  for key, policy in plans.items():
    for field, value in simulate(gap, host, policy, c).items():
      row[f'{key}_{field}'] = value
  row['one_gain_pts'] = row['one_goodput_pct'] - row['remote_goodput_pct']
  row['two_gain_pts'] = row['two_goodput_pct'] - row['one_goodput_pct']
  return row


def scenarios() -> list[tuple[str, float, float]]:
  grid = [(f'{h}h / {label}', h * HOUR, job)
          for h in (1, 3, 12)
          for label, job in (('1d', DAY), ('3d', 3 * DAY), ('1w', WEEK))]
  mtbi = LLAMA3['days'] * DAY / LLAMA3['interruptions']
  share = LLAMA3['host_share']
  return grid + [('llama3', mtbi / share, mtbi / (1 - share))]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--days', type=float, default=1000.0, help='wall time per scenario')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument(
      '--upload_cost_s',
      type=float,
      default=Costs.upload_delta_s,
      help="an upload's cost to the training loop")
  parser.add_argument(
      '--restart_s',
      type=float,
      default=Costs.restart_s,
      help='process start + compile, every restart')
  parser.add_argument(
      '--remote_restore_s',
      type=float,
      default=Costs.remote_restore_s,
      help='the state back on every device when every host downloads')
  args = parser.parse_args(argv)
  c = Costs(
      upload_delta_s=args.upload_cost_s,
      restart_s=args.restart_s,
      remote_restore_s=args.remote_restore_s)
  rows = [scenario(*s, args.days, args.seed, c) for s in scenarios()]
  print_table(rows, [
      'scenario', 'host_losses', 'job_losses', 'remote_T_s', 'local_T_s', 'upload_T_s',
      'remote_goodput_pct', 'one_goodput_pct', 'two_goodput_pct', 'one_gain_pts', 'two_gain_pts'
  ])
  print()
  print_table(rows, ['scenario'] + [
      f'{k}_{f}' for k in ('remote', 'one', 'two') for f in ('ckpt_pct', 'lost_pct', 'restart_pct')
  ])
  meta = {
      'costs': dataclasses.asdict(c), 'days': args.days, 'seed': args.seed, 'llama3': LLAMA3,
      'policies': {
          'remote': 'remote only: T = plan(delta + upload, M), every failure from the remote',
          'one': 'two tiers, one cadence (--remote_every=1): T as remote, host losses from the peers',
          'two': 'two tiers, two cadences (--remote_every=auto): T_local = plan(2 delta, M_host), '
                 'an upload every k-th, k = round(plan(upload, M_job) / T_local)'
      }
  }
  path = write_results('tiers', rows, meta)
  print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
