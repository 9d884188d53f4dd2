"""Everything a machine with an accelerator should measure, in one run of under 9 minutes.

    bash benchmarks/device_run.sh [OUT]        # installs what it can, then runs this
    python -m benchmarks.device --out OUT      # this alone, in an environment that has jaxckpt's needs

In order, each within its own time budget, each recorded (ok, failed with why, or skipped with
why) in OUT/device.json as soon as it ends:

1. device: what jax runs on (platform, device kind, memory statistics), the package versions.
2. tests: the tests that exercise the device (`tests/test_device_staging.py`, the state file).
3. train: andrea_120m for a few hundred steps with a checkpoint every 50 steps, then with
   checkpoints off; tokens/s of each from the loss history's timestamps, after warm-up.
4. resume: the same run SIGKILLed once step 100 is committed and started again; its final
   checkpoint must equal the uninterrupted run's byte for byte (deterministic GPU ops on).
5. blocking: what `save()` blocks for with host and with device staging, against a device-side
   copy of the state, a device-to-host copy, and orbax's async save, in one process.
6. bound: tokens/s with the loop's bound on steps in flight (2, the default) against without it,
   in alternating blocks of steps in one process (`benchmarks.stop_latency.paired_throughput`):
   the goal is a cost under 1%, which 2 shared CPU cores cannot resolve.
7. deterministic: step 6's loop again in a fresh process with deterministic GPU ops (the
   trainer runs' flag): what that flag alone costs the jitted step, apart from the trainer.
8. restart: a restart's restore and its first compile, one after the other and overlapped, with
   a cold compile and a warm cache (`benchmarks.restore_compile`, one round in fresh processes).
9. transfer: device-to-host copies of the state round after round, each way in a fresh process
   (`benchmarks.device_transfer`): why a run's first checkpoints cost more than later ones.

Nothing here assumes a CPU; on one it runs too (slowly: pass --steps to shrink).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / 'configs' / 'andrea_120m.py')
BUDGET_S = 540  # the whole run: under 9 minutes
STEPS = ('device', 'tests', 'train', 'resume', 'blocking', 'bound', 'deterministic', 'restart',
         'transfer')
# The transfer step's runs: (name, arguments, environment added). `malloc_kept` keeps what glibc
# frees in the heap (arrays up to its 32 MiB mmap limit) instead of handing it back to the kernel.
TRANSFERS = (('stager', ('--how=stager', '--busy'), {}), ('numpy', ('--how=numpy', '--busy'), {}),
             ('pinned', ('--how=pinned', '--busy'), {}), ('malloc_kept', ('--how=numpy',), {
                 'MALLOC_MMAP_THRESHOLD_': str(32 << 20), 'MALLOC_TRIM_THRESHOLD_': str(1 << 40)
             }), ('h2d', ('--how=h2d', '--rounds=4'),
                  {}), ('h2d_pinned', ('--how=h2d_pinned', '--rounds=4'),
                        {}), ('fault', ('--how=fault', '--rounds=3'), {}))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default='device-results')
  parser.add_argument('--steps', type=int, default=300, help='training steps per run')
  parser.add_argument('--config', default=CONFIG)
  parser.add_argument(
      '--only', default='', help='comma-separated steps to run (default: all): ' + ','.join(STEPS))
  args = parser.parse_args(argv)
  out = Path(args.out).absolute()
  out.mkdir(parents=True, exist_ok=True)
  # This process holds the device too (steps 1, 5 and 6): without this, jax would take 75% of an
  # accelerator's memory at its first use and leave the trainers it starts too little.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  env = dict(
      os.environ,
      PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
      JAX_COMPILATION_CACHE_DIR=str(out / 'jax-cache'),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  # Bit-exact resume needs reductions that add in the same order every time.
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') + ' --xla_gpu_deterministic_ops=true').strip()
  report = Report(out / 'device.json', time.monotonic() + BUDGET_S)
  work = Path(tempfile.mkdtemp(prefix='jaxckpt-device-'))
  try:
    only = set(args.only.split(',')) if args.only else None
    if only and only - set(STEPS):
      parser.error(f'--only: no step {", ".join(sorted(only - set(STEPS)))} (steps: '
                   f'{", ".join(STEPS)})')
    steps = [('device', 20, describe_device), ('tests', 120, run_tests, env, out),
             ('train', 200, train_on_off, env, work, args.config, args.steps),
             ('resume', 150, kill_and_resume, env, work, args.config, args.steps),
             ('blocking', 120, blocking, args.config), ('bound', 90, steps_in_flight, args.config),
             ('deterministic', 120, deterministic_loop, env, args.config),
             ('restart', 150, restart, args.config, work),
             ('transfer', 150, transfer, env, args.config)]
    for name, budget, fn, *fn_args in steps:
      if only is not None and name not in only:
        continue
      if name == 'resume':  # compared with the train step's uninterrupted run
        train = report.results.get('train', {})
        fn_args.append(train if 'runs' in train else None)
      report.step(name, budget, fn, *fn_args)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  report.table()
  return 0 if all(r['status'] != 'failed' for r in report.results.values()) else 1


class Report:
  """Each step's result, written to JSON as soon as it ends; a step that cannot fit its budget
  in the time left is skipped, and says so."""

  def __init__(self, path: Path, deadline: float):
    self.path, self.deadline, self.results = path, deadline, {}

  def step(self, name: str, budget_s: float, fn, *args):
    left = self.deadline - time.monotonic()
    if left < budget_s * 0.5:
      self.results[name] = {'status': 'skipped', 'why': f'{left:.0f} s left of the 9 minutes'}
      self._write()
      return None
    t0 = time.monotonic()
    print(f'== {name} (budget {budget_s} s)', flush=True)
    try:
      value = fn(*args)
      self.results[name] = {'status': 'ok', 'seconds': time.monotonic() - t0, **(value or {})}
      return value
    except Skip as e:
      self.results[name] = {'status': 'skipped', 'why': str(e)}
    except Exception as e:  # pylint: disable=broad-except  # recorded; the next step still runs
      self.results[name] = {
          'status': 'failed', 'why': f'{type(e).__name__}: {e}',
          'traceback': traceback.format_exc()[-3000:]
      }
    finally:
      self._write()
    return None

  def _write(self) -> None:
    self.path.write_text(json.dumps(self.results, indent=1, default=str))

  def table(self) -> None:
    print('\nstep      status   what')
    for name, r in self.results.items():
      shown = {k: v for k, v in r.items() if k not in ('status', 'traceback', 'seconds')}
      print(f'{name:<9} {r["status"]:<8} {json.dumps(shown, default=str)[:300]}')
    print(f'\nJSON: {self.path}')


class Skip(Exception):
  """A step that cannot run here, and why."""


def describe_device() -> dict:
  import importlib.metadata

  import jax
  device = jax.devices()[0]
  versions = {}
  for name in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'tensorstore', 'safetensors',
               'ml-collections', 'isal', 'numpy'):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  info = {
      'platform': device.platform, 'device_kind': device.device_kind, 'devices': jax.device_count(),
      'memory_stats': stats, 'versions': versions
  }
  print(json.dumps(info, indent=1, default=str), flush=True)
  return info


def run_tests(env: dict, out: Path) -> dict:
  tests = [
      'tests/test_device_staging.py', 'tests/test_statefile.py', 'tests/test_restore_compile.py'
  ]
  r = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *tests],
                     cwd=REPO,
                     env=env,
                     capture_output=True,
                     text=True,
                     timeout=300)
  (out / 'tests.log').write_text(r.stdout + r.stderr)
  summary = (r.stdout.strip().splitlines() or [''])[-1]
  if r.returncode != 0:
    raise RuntimeError(f'pytest exit {r.returncode}: {summary}')
  return {'tests': tests, 'summary': summary}


def cadence(steps: int) -> int:
  """Steps between checkpoints: 50 for the default 300 steps."""
  return max(1, steps // 6)


def trainer_command(config: str,
                    workdir: Path,
                    steps: int,
                    every: int,
                    *extra: str,
                    log_every: int = 25) -> list[str]:
  return [
      sys.executable, '-m', 'jaxckpt.main', f'--config={config}', f'--workdir={workdir}',
      f'--config.train.steps={steps}', f'--checkpoint_every={every}', '--keep=0',
      f'--config.train.log_every={log_every}', '--config.samples.every=0',
      '--config.export.every=0', *extra
  ]


def tokens_per_second(workdir: Path, config: str, skip: int = 20) -> float:
  """From the loss history's timestamps, leaving out the first steps (compilation)."""
  from jaxckpt.records import provenance
  from jaxckpt.records.runlog import read_loss_history
  cfg = provenance.load_config_file(config)
  rows = read_loss_history(workdir)
  steps = sorted(rows)[skip:-1]  # the last step also waits for the final checkpoint
  elapsed = rows[steps[-1]]['time'] - rows[steps[0]]['time']
  return (steps[-1] - steps[0]) * cfg.train.batch_size * cfg.model.block_size / elapsed


def where_the_time_went(workdir: Path) -> dict:
  """Each checkpoint's blocking and commit times (its events), and the wall time of each stretch
  of steps between two writes of the loss history (a log line or a checkpoint), slowest first:
  a one-time cost shows as one slow stretch, a per-checkpoint one as a slow stretch at each."""
  from jaxckpt.records.runlog import read_jsonl, read_loss_history
  from jaxckpt.records.workdir import EVENTS
  checkpoints = [{k: e.get(k)
                  for k in ('step', 'seconds_blocked', 'seconds_to_commit', 'staging')}
                 for e in read_jsonl(workdir / EVENTS)
                 if e['event'] == 'checkpoint']
  rows = read_loss_history(workdir)
  flushes = sorted({(r['time'], s) for s, r in rows.items()})
  ends = [max(s for t, s in flushes if t == time) for time in sorted({t for t, _ in flushes})]
  stretches = [{
      'steps': f'{a + 1}-{b}', 's_per_step': (rows[b]['time'] - rows[a]['time']) / (b - a)
  } for a, b in zip(ends, ends[1:])]
  return {
      'checkpoints': checkpoints,
      'slowest_stretches': sorted(stretches, key=lambda r: -r['s_per_step'])[:8]
  }


def train_on_off(env: dict, work: Path, config: str, steps: int) -> dict:
  """The same run with checkpoints (staged the trainer's way, then on the host) and without."""
  runs = {}
  for name, every, extra in (('on', cadence(steps), ()), ('off', 0, ()),
                             ('on_host_staging', cadence(steps), ('--checkpoint_staging=host',))):
    workdir = work / f'train-{name}'
    r = subprocess.run(
        trainer_command(config, workdir, steps, every, *extra, log_every=10),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400)
    if r.returncode != 0:
      raise RuntimeError(f'train ({name}) exit {r.returncode}: {r.stderr[-1500:]}')
    runs[name] = {
        'workdir': str(workdir), 'tokens_per_s': tokens_per_second(workdir, config),
        **where_the_time_went(workdir)
    }
    print(name, json.dumps(runs[name], default=str), flush=True)
  ratios = {
      f'tokens_per_s_ratio_{name}_off': runs[name]['tokens_per_s'] / runs['off']['tokens_per_s']
      for name in ('on', 'on_host_staging')
  }
  return {
      'runs': runs, **ratios, 'target': '>= 0.99',
      'met': ratios['tokens_per_s_ratio_on_off'] >= 0.99
  }


def kill_and_resume(env: dict, work: Path, config: str, steps: int, runs: dict | None) -> dict:
  if not runs:
    raise Skip('needs the uninterrupted run of the train step')
  workdir, kill_at = work / 'resume', 2 * cadence(steps)
  command = trainer_command(config, workdir, steps, cadence(steps))
  proc = subprocess.Popen(
      command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  committed = workdir / 'checkpoints' / f'step_{kill_at:08d}' / 'manifest.json'
  deadline = time.monotonic() + 300
  while not committed.exists():
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      raise RuntimeError(f'the run ended or stalled before step {kill_at} committed')
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  r = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  if r.returncode != 0:
    raise RuntimeError(f'resume exit {r.returncode}: {r.stderr[-1500:]}')
  name = f'step_{steps:08d}'
  ours = _state_bytes(workdir / 'checkpoints' / name)
  theirs = _state_bytes(Path(runs['runs']['on']['workdir']) / 'checkpoints' / name)
  same = ours == theirs
  if not same:
    raise RuntimeError(f'{name} after kill+resume differs from the uninterrupted run')
  return {'killed_after_step': kill_at, 'bit_exact': same}


def _state_bytes(step_dir: Path) -> bytes:
  return b''.join(p.read_bytes() for p in sorted((step_dir / 'state').iterdir()))


def steps_in_flight(config: str) -> dict:
  from benchmarks.stop_latency import paired_throughput
  from jaxckpt.records import provenance

  # 4 ABBA rounds of 20-step blocks: 320 steps and one compile, within the step's budget.
  row = paired_throughput(
      Path(config).stem, rounds=4, block_steps=20, config=provenance.load_config_file(config))
  print(json.dumps(row, indent=1, default=str), flush=True)
  return row


def deterministic_loop(env: dict, config: str) -> dict:
  """`steps_in_flight` in a child process with `env`'s XLA_FLAGS (deterministic GPU ops), which
  must be set before the backend starts: against the `bound` step's tokens/s, in this process
  without the flag, it says what the flag costs the step itself."""
  code = ('import json, sys; from benchmarks.device import steps_in_flight; '
          'print("RESULT " + json.dumps(steps_in_flight(sys.argv[1]), default=str))')
  try:
    done = subprocess.run([sys.executable, '-c', code, config],
                          cwd=REPO,
                          env=env,
                          capture_output=True,
                          text=True,
                          timeout=115,
                          check=False)
  except subprocess.TimeoutExpired as e:  # what it printed says how far it got
    tail = e.stderr.decode(errors='replace') if isinstance(e.stderr, bytes) else (e.stderr or '')
    raise RuntimeError(f'still running after 115 s: {tail[-1500:]}') from None
  lines = [l for l in done.stdout.splitlines() if l.startswith('RESULT ')]
  if done.returncode or not lines:
    raise RuntimeError(f'exit {done.returncode}: {done.stderr[-1500:]}')
  return {'xla_flags': env.get('XLA_FLAGS', ''), **json.loads(lines[-1][len('RESULT '):])}


def transfer(env: dict, config: str) -> dict:
  """`benchmarks.device_transfer` once per way in TRANSFERS, each in a fresh process."""
  rows = {}
  for name, args, extra in TRANSFERS:
    command = [sys.executable, '-m', 'benchmarks.device_transfer', f'--config={config}', *args]
    try:
      done = subprocess.run(
          command, cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=100)
    except subprocess.TimeoutExpired:
      rows[name] = {'failed': 'still running after 100 s'}
      continue
    lines = [l for l in done.stdout.splitlines() if l.startswith('RESULT ')]
    rows[name] = json.loads(lines[-1][len('RESULT '):]) if lines and not done.returncode else {
        'failed': f'exit {done.returncode}: {done.stderr[-800:]}'
    }
    print(name, json.dumps(rows[name]), flush=True)
  return rows


def restart(config: str, work: Path) -> dict:
  from benchmarks.restore_compile import measure
  rows, _ = measure(Path(config).stem, 1, False, str(work))
  print(json.dumps(rows, indent=1, default=str), flush=True)
  return {'rows': rows}


def blocking(config: str) -> dict:
  import jax
  import numpy as np
  import orbax.checkpoint as ocp

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions
  from jaxckpt.records import provenance
  from jaxckpt.train.state import build_trainer
  trainer = build_trainer(provenance.load_config_file(config))
  state = trainer.init_fn(jax.random.key(0))
  jax.block_until_ready(state)
  leaves = jax.tree.leaves(state)
  nbytes = sum(x.nbytes for x in leaves)

  def median_of(fn, n=5):
    times = []
    for _ in range(n):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    return float(np.median(times))

  copy = lambda: jax.block_until_ready(
      jax.device_put(leaves, [x.sharding for x in leaves], may_alias=False))
  copy()

  def to_host(n=3):
    # A fresh copy each time: an array keeps its host value after the first device_get, and a
    # second one of the same array is a lookup (3.9 ms for 1.46 GB on an H200), not a transfer.
    times = []
    for _ in range(n):
      fresh = copy()
      t0 = time.perf_counter()
      jax.device_get(fresh)
      times.append(time.perf_counter() - t0)
    return float(np.median(times))

  rows = {'state_bytes': nbytes, 'device_copy_s': median_of(copy), 'device_to_host_s': to_host()}
  scratch = Path(tempfile.mkdtemp(prefix='jaxckpt-blocking-'))
  try:
    for where in ('host', 'device'):
      infos = []
      with CheckpointManager(
          scratch / where,
          CheckpointOptions(mode='async', staging=where, keep=1),
          on_commit=infos.append) as mgr:
        for step in range(1, 5):
          mgr.save(step, state)
          mgr.wait_until_finished()  # blocking alone: no save in flight when the next begins
      rows[f'jaxckpt_{where}_blocked_s'] = float(np.median([i.seconds_blocked for i in infos[1:]]))
      rows[f'jaxckpt_{where}_committed_s'] = float(
          np.median([i.seconds_to_commit for i in infos[1:]]))
    checkpointer = ocp.StandardCheckpointer()
    blocked = []
    for i in range(3):
      t0 = time.perf_counter()
      checkpointer.save(scratch / f'orbax-{i}', state)
      blocked.append(time.perf_counter() - t0)
      checkpointer.wait_until_finished()
    rows['orbax_async_blocked_s'] = float(np.median(blocked[1:]))
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  ours = rows['jaxckpt_device_blocked_s']
  rows['device_blocked_over_device_copy'] = ours / rows['device_copy_s']
  rows['device_blocked_over_orbax_async'] = ours / rows['orbax_async_blocked_s']
  rows['targets'] = {
      '<= 1.2 x device copy': rows['device_blocked_over_device_copy'] <= 1.2,
      '<= 0.1 x orbax async': rows['device_blocked_over_orbax_async'] <= 0.1
  }
  print(json.dumps(rows, indent=1), flush=True)
  return rows


if __name__ == '__main__':
  sys.exit(main())
