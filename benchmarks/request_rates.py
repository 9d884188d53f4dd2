"""Request rates against an object store's limits: 1000 hosts uploading (and reading back) a 1 TB
checkpoint, simulated with the project's part size, parts in flight and retry policy.

    python -m benchmarks.request_rates [--hosts=1000] [--tb=1] [--stream_mbps=100] [--seed=0]

The stores' published limits: S3 takes about 3,500 PUT/s and 5,500 GET/s per prefix partition
(a new prefix is one partition until S3 splits it under sustained load) and answers
`503 SlowDown` past them; GCS starts a bucket at about 1,000 object writes/s and doubles that
every 20 minutes of sustained load, and takes about one write per second to one object name.
The store here accepts at most its limit in each 1-second window and answers 503 to the rest.

Each host is one uploader as the code runs it (`transfer.run_bounded`, `store.Request`): up to
PARALLEL parts in flight, settled oldest first; a part answered 503 is resent by the one
uploading thread when it is the oldest, after `Retries` (1 s doubling to 30 s, jittered x1-1.5),
for up to `slow_secs` (120 s) before its upload fails (E-STORE-015). `ramp` rows add what the
uploader does not do today: a window per host that starts at 1 part in flight, doubles after a
window's worth of parts without a 503 and halves on one (at most PARALLEL). `paced` rows are
what the uploader does (`pacing`, `--remote_rate=auto`): each host sends its requests, resends
included, evenly spaced at its share of the store's documented limit x SHARE (limit x 0.9 /
hosts a second), from a random phase.

A part of PART_BYTES takes `PART_BYTES / stream_mbps` plus 30 ms to send; a 503 comes back in
20 ms. Every part is its own object, written once when accepted: no object name is written
twice within a second. The lease and each step's commit (`remote.json`) are written at most
once a second per process (`store.paced`), so their rate is at most one a second each.
"""

import argparse
import heapq
import math
import random
from collections import Counter, deque

from benchmarks.common import print_table, write_results
from jaxckpt.checkpoint.remote.objects import PARALLEL, PART_BYTES
from jaxckpt.checkpoint.remote.pacing import SHARE, Retries

LIMITS = {  # requests accepted per second at time t (seconds since the burst began)
    's3_put': lambda t: 3500,
    's3_get': lambda t: 5500,
    'gcs_write': lambda t: 1000 * 2**int(t // 1200),
}
REQUEST_SECS, REJECT_SECS = 0.03, 0.02


class Store:
  """Accepts at most `limit(t)` requests in each 1-second window; counts what it is sent."""

  def __init__(self, limit):
    self.limit, self.sent, self.accepted, self.rejected = limit, Counter(), Counter(), 0

  def send(self, t: float) -> bool:
    second = int(t)
    self.sent[second] += 1
    if self.accepted[second] < self.limit(t):
      self.accepted[second] += 1
      return True
    self.rejected += 1
    return False


def host(store: Store, parts: int, part_secs: float, policy: Retries, rng: random.Random, mode: str,
         pace: float, stats: dict):
  """One uploader thread as a generator: yields the times it waits until."""
  now = yield
  ramp = mode == 'ramp'
  window = 1 if ramp else PARALLEL
  clean = 0  # parts settled since the window last changed, with no 503
  pending: deque = deque()  # [first sent, its answer's time, accepted]
  todo = parts
  spacing = 1.0 / pace
  slot = now + (rng.uniform(0.0, spacing) if mode == 'paced' else 0.0)  # `pacing.Rate`

  def send(t):
    ok = store.send(t)
    return t + (REQUEST_SECS + part_secs if ok else REJECT_SECS), ok

  while todo or pending:
    while todo and len(pending) < window:
      if mode == 'paced':  # the request waits for its slot (the thread sends nothing meanwhile)
        if slot > now:
          now = yield slot
        slot = max(now, slot) + spacing
      pending.append([now, *send(now)])
      todo -= 1
    head = pending[0]
    tries = 1
    now = yield head[1]
    while not head[2]:  # 503: wait as `Store._call` does, then resend
      wait = min(policy.slow_max, policy.slow_first * 2**(tries - 1)) * rng.uniform(1.0, 1.5)
      if now + wait > head[0] + policy.slow_secs:
        stats['failed'] += 1  # E-STORE-015; the uploader retries the upload later
        head[0] = now
        tries = 0
      now = yield now + wait
      if mode == 'paced':
        if slot > now:
          now = yield slot
        slot = max(now, slot) + spacing
      head[1], head[2] = send(now)
      tries += 1
      stats['max_tries'] = max(stats['max_tries'], tries)
      now = yield head[1]
      if ramp:
        window, clean = max(1, window // 2), 0
    pending.popleft()
    if ramp:
      clean += 1
      if clean >= window:
        window, clean = min(PARALLEL, window * 2), 0
  stats['done'] = max(stats['done'], now)


def simulate(kind: str, hosts: int, total_bytes: int, stream_mbps: float, mode: str,
             seed: int) -> dict:
  rng = random.Random(seed)
  store = Store(LIMITS[kind])
  per_host = math.ceil(total_bytes / hosts / PART_BYTES)
  part_secs = PART_BYTES / (stream_mbps * 1e6)
  stats = {'failed': 0, 'max_tries': 1, 'done': 0.0}
  events = []
  for h in range(hosts):
    g = host(store, per_host, part_secs, Retries(), random.Random(rng.random()), mode,
             LIMITS[kind](0) * SHARE / hosts, stats)
    next(g)
    heapq.heappush(events, (rng.uniform(0, 0.1), h, g))  # hosts start within 100 ms
  while events:
    t, h, g = heapq.heappop(events)
    try:
      heapq.heappush(events, (g.send(t), h, g))
    except StopIteration:
      pass
  secs = stats['done']
  limit = LIMITS[kind]
  return {
      'store': kind,
      'mode': {'ramp': 'ramp 1..8',
               'paced': f'paced, {SHARE:g} x limit / hosts'}.get(mode, f'{PARALLEL} in flight'),
      'hosts': hosts,
      'requests': sum(store.accepted.values()),
      'rejected_503': store.rejected,
      'limit_per_s': limit(0),
      'peak_accepted_per_s': max(store.accepted.values()),
      'peak_sent_per_s': max(store.sent.values()),
      'mean_sent_per_s': round(sum(store.sent.values()) / max(1.0, secs), 1),
      'offered_per_s': round(hosts * PARALLEL / (REQUEST_SECS + part_secs)),
      'seconds': round(secs, 1),
      'seconds_at_limit': round(per_host * hosts / limit(0), 1),
      'max_tries': stats['max_tries'],
      'failed_uploads': stats['failed'],
  }


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument('--hosts', type=int, default=1000)
  ap.add_argument('--tb', type=float, default=1.0)
  ap.add_argument('--stream_mbps', type=float, default=100.0, help='MB/s of one part upload')
  ap.add_argument('--seed', type=int, default=0)
  args = ap.parse_args()
  total = int(args.tb * 1e12)
  rows = [
      simulate(kind, args.hosts, total, args.stream_mbps, mode, args.seed)
      for kind in ('s3_put', 's3_get', 'gcs_write')
      for mode in ('burst', 'ramp', 'paced')
  ]
  # GCS's ramp: the sustained rate that would take every host's parts unthrottled.
  unthrottled = rows[0]['offered_per_s']
  doublings = max(0, math.ceil(math.log2(unthrottled / 1000)))
  meta = {
      'part_bytes': PART_BYTES, 'parallel': PARALLEL, 'retries': Retries()._asdict(),
      'total_bytes': total, 'stream_mbps': args.stream_mbps, 'seed': args.seed,
      'gcs_minutes_to_ramp_to_unthrottled': 20 * doublings, 'gcs_unthrottled_per_s': unthrottled,
      'paced_writes_per_s': {'LEASE': 1, 'remote.json': 1}
  }
  print_table(rows, [
      'store', 'mode', 'requests', 'rejected_503', 'limit_per_s', 'peak_accepted_per_s',
      'peak_sent_per_s', 'mean_sent_per_s', 'seconds', 'seconds_at_limit', 'max_tries',
      'failed_uploads'
  ])
  print(f'GCS: {unthrottled} writes/s would go unthrottled after {doublings} doublings '
        f'({20 * doublings} minutes of sustained load); one upload lasts under a minute.')
  print(write_results('request_rates', rows, meta))


if __name__ == '__main__':
  main()
