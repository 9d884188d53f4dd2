"""What coordinating N processes costs each of them: bytes through the key-value store.

    python -m benchmarks.scale --counts=2,4,8,16,32 --repeats=3

Each N is a fresh job of N real `jax.distributed` processes (one CPU device each, gloo, this
machine) that joins through `jaxckpt.hosts.distributed.initialize` (its watchdog running) and
saves a tiny state (a few KB: one array sharded over every process, a few replicated ones, so
each process writes and posts one part) `--repeats` times into one shared directory. Every
process counts the bytes it sends to and receives from the coordinator's key-value store at the
project's own calls (`jaxckpt.checkpoint.traffic`: keys and values), per phase:

  start    five start-up exchanges (`distributed.agree` / `first_problem`, as a trainer's
           start does about five) and opening the manager (`Group.open`)
  save     one save, from save() to committed (median over the repeats); the benchmark's own
           barrier before it is not counted
  own      the same, each process saving into its own directory (each host's own disk: every
           process commits its part under process 0's manifest), of a state of LEAVES arrays
           (andrea_120m's leaf count), each sharded over every process, so that each part record
           is andrea_120m's size (about 5 KB)
  stop     an agreed stop: the last process gets a real SIGTERM while every process's loop
           steps on (10 ms a step), and all stop after the same step (`hosts.agreement`, as a
           trainer's loop does): from the signal until every loop has its outcome
  watchdog the watchdog's rounds, per round (one every `period` s)

For process 0 and for the most expensive other process. `commit_s` is process 0's seconds from
save() until committed (median). Process 0 gathers: its bytes grow with N; every other
process's stay flat. The machine has 2 shared cores: latency at 32 processes is the CPU's.
Prints a table, writes benchmarks/results/scale.json.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COLUMNS = [
    'processes', 'commit_s', 'save_p0_sent', 'save_p0_recv', 'save_other_sent', 'save_other_recv',
    'start_p0_recv', 'start_other_recv', 'own_commit_s', 'own_p0_recv', 'own_other_recv', 'stop_s',
    'stop_p0_recv', 'stop_other_sent', 'stop_other_recv', 'watchdog_p0_recv', 'watchdog_other_recv'
]
STARTS = 5
LEAVES = 449  # the own-disk save's arrays: andrea_120m's leaf count


def worker(process: int, count: int, coordinator: str, directory: str, repeats: int) -> None:
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  from jaxckpt.checkpoint import traffic
  counted = traffic.count_traffic()
  from jaxckpt.hosts import distributed
  cluster = distributed.initialize(
      coordinator, count, process, heartbeat_timeout_seconds=60.0, timeout_secs=600.0)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions
  from jaxckpt.checkpoint.multihost import client
  mesh = Mesh(np.asarray(jax.devices()), ('data',))
  rows = jax.make_array_from_callback((count * 4, 8), NamedSharding(mesh, P('data')),
                                      lambda i: np.ones((4, 8), np.float32)[:, i[1]])
  state = {'rows': rows, 'bias': np.arange(16, dtype=np.float32), 'count': np.int32(7)}
  watchdog = ('jaxckpt-watchdog',)
  before = counted.snapshot(but=watchdog)
  for k in range(STARTS):  # as a trainer's start: every process's answer, agreed
    distributed.agree(f'bench/start/{k}', 'same', 'the benchmark')
  mgr = CheckpointManager(directory, CheckpointOptions(keep=2, barrier_timeout_secs=600))
  mgr.save(0, state, {'step': 0})  # opens the group (`Group.open`), compiles nothing more
  mgr.wait_until_finished()
  start = _delta(before, counted.snapshot(but=watchdog))
  saves = []
  for step in range(1, repeats + 1):
    client().wait_at_barrier(f'bench/{step}', 600_000)  # everyone starts together
    before = counted.snapshot(but=watchdog)
    t0 = time.perf_counter()
    mgr.save(step, state, {'step': step})
    mgr.wait_until_finished()
    saves.append(
        {'seconds': time.perf_counter() - t0, **_delta(before, counted.snapshot(but=watchdog))})
  mgr.close()
  own = _own_disk_saves(process, count, f'{directory}/own{process}', repeats, counted, watchdog)
  stop = _agreed_stop(process, count, cluster, counted, watchdog)
  dog = counted.snapshot(watchdog)
  rounds = max(1, dog['calls'] // (2 if process == 0 else 3))  # its calls a round
  print(
      'RESULT ' + json.dumps({
          'process': process, 'start': start, 'saves': saves, 'own': own, 'stop': stop,
          'heartbeat_secs': cluster.heartbeat_secs,
          'watchdog': {k: v / rounds for k, v in dog.items()}
      }),
      flush=True)
  client().wait_at_barrier('bench/end', 600_000)


def _own_disk_saves(process: int, count: int, directory: str, repeats: int, counted,
                    watchdog) -> list[dict]:
  """Saves into this process's own directory: [{seconds, sent, received}] per save."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions
  from jaxckpt.checkpoint.multihost import client
  sharding = NamedSharding(Mesh(np.asarray(jax.devices()), ('data',)), P('data'))
  state = {
      f'params/leaf_{i:03d}':
          jax.make_array_from_callback((count * 2, 4), sharding, lambda idx: np.ones(
              (2, 4), np.float32)) for i in range(LEAVES)
  }
  saves = []
  with CheckpointManager(directory, CheckpointOptions(keep=2, barrier_timeout_secs=600)) as mgr:
    for step in range(repeats + 1):  # the first opens the group
      client().wait_at_barrier(f'bench/own/{step}', 600_000)
      before, t0 = counted.snapshot(but=watchdog), time.perf_counter()
      mgr.save(step, state, {'step': step})
      mgr.wait_until_finished()
      if step:
        saves.append(
            {'seconds': time.perf_counter() - t0, **_delta(before, counted.snapshot(but=watchdog))})
  return saves


def _agreed_stop(process: int, count: int, cluster, counted, watchdog) -> dict:
  """The last process gets SIGTERM; every loop steps until the agreed stop. Its seconds, step
  and key-value traffic from the signal on."""
  import signal

  from jaxckpt.checkpoint import signals
  from jaxckpt.checkpoint.multihost import client
  from jaxckpt.hosts.agreement import Agreement
  watcher = signals.PreemptionWatcher()
  with watcher:
    agreement = Agreement(watcher, 0, cluster=cluster)
    client().wait_at_barrier('bench/stop', 600_000)
    before, t0, step = counted.snapshot(but=watchdog), time.perf_counter(), 0
    if process == count - 1:
      os.kill(os.getpid(), signal.SIGTERM)
    while agreement.stop_signal is None:
      step += 1
      agreement.save_now(step, 10**9, lambda: False, lambda: False)
      time.sleep(0.01)
    seconds = time.perf_counter() - t0
    after = counted.snapshot(but=watchdog)
    agreement.close()
  return {'seconds': seconds, 'step': step, **_delta(before, after)}


def _delta(a: dict, b: dict) -> dict:
  return {k: b[k] - a[k] for k in a}


def run_count(count: int, repeats: int, scratch: Path) -> dict:
  from tests.conftest import free_port
  directory = scratch / f'n{count}'
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO))
  coordinator = f'127.0.0.1:{free_port()}'
  procs = [
      subprocess.Popen([
          sys.executable, '-m', 'benchmarks.scale', '--worker',
          str(k),
          str(count), coordinator,
          str(directory),
          str(repeats)
      ],
                       cwd=REPO,
                       env=env,
                       stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT,
                       text=True) for k in range(count)
  ]
  outputs = [p.communicate(timeout=1800)[0] for p in procs]
  if any(p.returncode for p in procs):
    raise SystemExit(f'{count} processes failed:\n' + '\n'.join(o[-2000:] for o in outputs))
  shutil.rmtree(directory, ignore_errors=True)
  found = [
      json.loads(line[7:]) for o in outputs for line in o.splitlines() if line.startswith('RESULT ')
  ]
  by = {r['process']: r for r in found}

  def save(k, what, kind='saves'):
    return statistics.median(s[what] for s in by[k][kind])

  others = [k for k in by if k != 0]
  stopped = {r['stop']['step'] for r in by.values()}
  if len(stopped) != 1:
    raise SystemExit(f'{count} processes stopped after different steps: {sorted(stopped)}')
  return {
      'stop_s': max(r['stop']['seconds'] for r in by.values()), 'stop_p0_recv': by[0]['stop']
                                                                                ['received'],
      'stop_other_sent': max(by[k]['stop']['sent'] for k in others
                            ), 'stop_other_recv': max(by[k]['stop']['received'] for k in others),
      'processes': count, 'commit_s': save(0, 'seconds'), 'save_p0_sent': save(0, 'sent'),
      'save_p0_recv': save(0, 'received'), 'save_other_sent': max(save(k, 'sent') for k in others),
      'save_other_recv': max(save(k, 'received') for k in others), 'start_p0_recv': by[0]['start']
                                                                                    ['received'],
      'start_other_recv': max(by[k]['start']['received'] for k in others
                             ), 'own_commit_s': save(0, 'seconds', 'own'),
      'own_p0_recv': save(0, 'received',
                          'own'), 'own_other_recv': max(save(k, 'received', 'own') for k in others),
      'watchdog_p0_recv': round(by[0]['watchdog']['received']), 'watchdog_other_recv': round(
          max(by[k]['watchdog']['received'] for k in others)), 'per_process': {
              k: {'start': r['start'], 'saves': r['saves'], 'own': r['own'], 'stop': r['stop']}
              for k, r in sorted(by.items())
          }
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--counts', default='2,4,8,16,32')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--scratch', default=None)
  args = parser.parse_args()
  from benchmarks.common import print_table, write_results
  scratch = Path(tempfile.mkdtemp(prefix='jaxckpt-scale-', dir=args.scratch))
  load_before = os.getloadavg()[0]
  rows = []
  try:
    for count in map(int, args.counts.split(',')):
      rows.append(run_count(count, args.repeats, scratch))
      print(f'{count} processes: done', flush=True)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(f'bytes through the key-value store per process (sent: keys and values; recv: values); '
        f'save: median of {args.repeats}; other: the most of any process but 0; watchdog: '
        'per round')
  print_table(rows, COLUMNS)
  path = write_results(
      'scale', rows, {
          'repeats': args.repeats, 'start_exchanges': STARTS, 'load_before': load_before,
          'load_after': os.getloadavg()[0], 'cpus': os.cpu_count()
      })
  print(f'wrote {path}')


if __name__ == '__main__':
  if len(sys.argv) > 1 and sys.argv[1] == '--worker':
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]))
  else:
    main()
