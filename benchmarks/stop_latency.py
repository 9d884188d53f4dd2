"""How long a stop takes, and what bounding the steps in flight costs, through the real trainer.

    python -m benchmarks.stop_latency --configs=tiny,12m --log_every=1,50,1000

A preempted VM gets about 30 s (GCE spot) to 2 min (AWS) between SIGTERM and its end. The
trainer dispatches steps asynchronously; `config.train.max_steps_in_flight` (default 2) makes the
loop wait, after dispatching step k, for step k-1, so that a stop is honoured within two step
times. Each variant is a real `python -m jaxckpt.main` subprocess:

- stop: the trainer runs until it is past its compile and some steps, then gets SIGTERM; timed
  from the signal to the process's exit (the checkpoint of the step reached is committed by
  then), with the `interrupted` event's own `seconds_from_signal` (signal to commit), the step
  the signal arrived at and the step saved. Each `log_every` with the bound (2) and without it
  (0); a run still going `--cap_s` after the signal is killed and reported as `> cap`.
- throughput: tokens/s with the bound against without it, runs alternating so that drift in the
  machine's load falls on both; from `loss.jsonl`'s times (the loop's metric fetches) between
  step `--warmup` and the last step. Target: the bound costs < 1%.

Kept small for a 2-core CPU and said so in the results: tiny at batch 512 (~0.35 s a step, so
that a step is long against its dispatch, as on an accelerator) and andrea_12m at batch 4.
Every subprocess shares one compilation cache (the first run of each config fills it).
Writes benchmarks/results/stop_latency.json (with `--log_every_none`, throughput alone:
stop_latency_throughput.json).

- paired throughput (`--paired`): the same ratio measured in one process, where the spread
  between runs cannot hide a 1% cost: the trainer's own `train_step` in alternating blocks with
  the loop's `StepsInFlight` at 2 and at 0 (stop_latency_paired.json).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, print_table, write_results
from benchmarks.states import get_config

REPO = Path(__file__).resolve().parent.parent
TARGET_RATIO = 0.99
SHAPES = {  # config -> (config file, flags that keep it small here)
    'tiny': ('configs/tiny.py', ('--config.train.batch_size=512',)),
    '12m': ('configs/andrea_12m.py', ('--config.train.batch_size=4',)),
}
COLUMNS = [
    'config', 'op', 'log_every', 'bound', 'exit_s', 'commit_s', 'signal_step', 'saved_step',
    'steps_after_signal', 'tokens_per_s', 'ratio'
]


def _env(cache: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  env.update(
      JAX_PLATFORMS='cpu',
      JAX_COMPILATION_CACHE_DIR=cache,
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='-1',
      PYTHONPATH=str(REPO))
  return env


def _command(name: str, workdir: Path, *flags: str) -> list[str]:
  config, shrink = SHAPES[name]
  return [
      sys.executable, '-m', 'jaxckpt.main', f'--config={REPO / config}', f'--workdir={workdir}',
      '--checkpoint_every=0', '--keep=0', '--config.samples.every=0', '--config.export.every=0',
      *shrink, *flags
  ]


def _events(workdir: Path, name: str) -> list[dict]:
  try:
    lines = (workdir / 'events.jsonl').read_text().splitlines()
  except FileNotFoundError:
    return []
  return [e for e in map(json.loads, lines) if e.get('event') == name]


def stop_run(name: str, log_every: int, bound: int, cache: str, settle_s: float,
             cap_s: float) -> dict:
  """SIGTERM once the run has trained `settle_s` past its start: the time to exit."""
  with tempfile.TemporaryDirectory(prefix='stop-') as tmp:
    workdir = Path(tmp)
    proc = subprocess.Popen(
        _command(name, workdir, '--config.train.steps=1000000',
                 f'--config.train.log_every={log_every}',
                 f'--config.train.max_steps_in_flight={bound}'),
        cwd=REPO,
        env=_env(cache),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True)
    deadline = time.monotonic() + 900
    while not _events(workdir, 'started'):  # restored or fresh, the loop starts right after
      if proc.poll() is not None or time.monotonic() > deadline:
        proc.kill()
        raise SystemExit(f'{name}: the trainer did not start:\n{proc.stderr.read()}')
      time.sleep(0.1)
    time.sleep(settle_s)  # past the first step's compile (cached) and into the steady state
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout=cap_s)
      exit_s = time.monotonic() - t0
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
      exit_s = None
    stop = (_events(workdir, 'interrupted') or [{}])[0]
    return {
        'config': name, 'op': 'stop', 'log_every': log_every, 'bound': bound,
        'exit_s': exit_s if exit_s is not None else f'> {cap_s:g}',
        'commit_s': stop.get('seconds_from_signal'), 'signal_step': stop.get('signal_step'),
        'saved_step': stop.get('step'), 'steps_after_signal':
            (stop['step'] - stop['signal_step']) if stop else None, 'returncode': proc.returncode
    }


def throughput_run(name: str, bound: int, cache: str, steps: int, warmup: int) -> float:
  """Tokens/s between the end of step `warmup` and the last step's metric fetch."""
  config, shrink = SHAPES[name]
  batch = int(shrink[0].split('=')[1])
  with tempfile.TemporaryDirectory(prefix='rate-') as tmp:
    workdir = Path(tmp)
    subprocess.run(
        _command(name, workdir, f'--config.train.steps={steps}', '--config.train.log_every=10',
                 f'--config.train.max_steps_in_flight={bound}'),
        cwd=REPO,
        env=_env(cache),
        check=True,
        capture_output=True)
    rows = {}
    for line in (workdir / 'loss.jsonl').read_text().splitlines():
      row = json.loads(line)
      rows[row['step']] = row['time']
  block = get_config(name).model.block_size
  return (steps - warmup) * batch * block / (rows[steps] - rows[warmup])


def paired_throughput(name: str,
                      rounds: int,
                      block_steps: int,
                      batch: int | None = None,
                      config=None) -> dict:
  """Tokens/s with the bound against without it, in one process: alternating blocks of steps.

    Separate trainer processes differ by ±10% here (memory layout, the other core's load),
    far more than the bound can cost. In one process the trainer's own jitted `train_step` and
    `put_batch` run in blocks of `block_steps`, the loop's `StepsInFlight` at 2 or 0, in ABBA
    order so that drift falls on both; each block starts with nothing in flight and ends when
    its last state is computed. The figure is the median over rounds of bound-2 tokens/s over
    bound-0 tokens/s, next to the same ratio for two bound-0 blocks (the noise floor).
    """
  import jax
  import numpy as np

  from jaxckpt.train import state as trainer_lib

  config = config or get_config(name)
  if batch or name in SHAPES:  # the config's own batch otherwise (an accelerator's run)
    config.train.batch_size = batch or int(SHAPES[name][1][0].split('=')[1])
  trainer = trainer_lib.build_trainer(config)
  state = trainer.init_fn(jax.random.key(0))
  rng = np.random.default_rng(0)
  shape = (config.train.batch_size, config.model.block_size)
  batches = [
      (rng.integers(0, config.model.vocab_size, shape, dtype=np.int32),) * 2 for _ in range(4)
  ]
  tokens = block_steps * shape[0] * shape[1]

  def block(bound: int) -> float:
    nonlocal state
    jax.block_until_ready(state)
    in_flight = trainer_lib.StepsInFlight(bound)
    t0 = time.perf_counter()
    for i in range(block_steps):
      state, metrics = trainer.train_step(state, trainer.put_batch(batches[i % len(batches)]))
      in_flight.dispatched(metrics['loss'])
    jax.block_until_ready(state)
    return tokens / (time.perf_counter() - t0)

  block(2)  # compiles, and the first steps' allocations
  ratios, floor, rates = [], [], {2: [], 0: []}
  for r in range(rounds):
    order = (2, 0, 0, 2) if r % 2 == 0 else (0, 2, 2, 0)
    got = {2: [], 0: []}
    for bound in order:
      got[bound].append(block(bound))
    ratios.append(sum(got[2]) / sum(got[0]))
    # The two unbounded blocks, the earlier over the later in one round and the other way in
    # the next, so that drift does not lean the floor one way.
    floor.append(got[0][0] / got[0][1] if r % 2 == 0 else got[0][1] / got[0][0])
    for bound in (2, 0):
      rates[bound] += got[bound]
    print(
        f'{name} round {r + 1}/{rounds}: bound 2 / bound 0 = {ratios[-1]:.4f}, '
        f'bound 0 / bound 0 = {floor[-1]:.4f}',
        flush=True)
  quartiles = lambda xs: [float(q) for q in np.percentile(xs, [25, 50, 75])]
  return {
      'config': name, 'op': 'paired throughput', 'bound': 2, 'tokens_per_s': median(rates[2]),
      'tokens_per_s_unbounded': median(rates[0]), 'ratio': median(ratios),
      'ratio_quartiles': quartiles(ratios), 'noise_floor_quartiles': quartiles(floor),
      'target': TARGET_RATIO, 'met': median(ratios) >= TARGET_RATIO, 'rounds': rounds,
      'block_steps': block_steps, 'ratios': ratios
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--configs', default='tiny,12m')
  ap.add_argument('--log_every', default='1,50,1000')
  ap.add_argument('--cap_s', type=float, default=120.0, help='a stop slower than this is killed')
  ap.add_argument('--repeats', type=int, default=2, help='throughput pairs per config')
  ap.add_argument('--steps', default='tiny=120,12m=40', help='throughput run length')
  ap.add_argument('--warmup', type=int, default=20)
  ap.add_argument('--log_every_none', action='store_true', help='throughput only: no stop runs')
  ap.add_argument(
      '--paired',
      action='store_true',
      help='tokens/s only, in one process: alternating blocks with the bound and without')
  ap.add_argument('--rounds', type=int, default=12, help='--paired: ABBA rounds per config')
  ap.add_argument('--block_steps', default='tiny=16,12m=8', help='--paired: steps per block')
  args = ap.parse_args(argv)
  names = args.configs.split(',')
  steps = dict(kv.split('=') for kv in args.steps.split(','))
  rows = []
  if args.paired:
    blocks = dict(kv.split('=') for kv in args.block_steps.split(','))
    for name in names:
      rows.append(paired_throughput(name, args.rounds, int(blocks[name])))
    print()
    print_table(rows, ['config', 'op', 'tokens_per_s', 'tokens_per_s_unbounded', 'ratio'])
    path = write_results(
        'stop_latency_paired', rows,
        {'shapes': {k: v[1] for k, v in SHAPES.items()}, 'target': f'ratio >= {TARGET_RATIO}'})
    print(f'wrote {path}')
    return
  with tempfile.TemporaryDirectory(prefix='stop-cache-') as cache:
    for name in names:
      settle = 8.0 if name == 'tiny' else 30.0
      throughput_run(name, 2, cache, args.warmup + 10, args.warmup)  # fills the compile cache
      for log_every in [] if args.log_every_none else map(int, args.log_every.split(',')):
        for bound in (2, 0):
          rows.append(stop_run(name, log_every, bound, cache, settle, args.cap_s))
          print_table(rows[-1:], COLUMNS)
      rates = {2: [], 0: []}
      for _ in range(args.repeats):
        for bound in (2, 0):
          rates[bound].append(throughput_run(name, bound, cache, int(steps[name]), args.warmup))
      ratios = [a / b for a, b in zip(rates[2], rates[0])]
      for bound in (2, 0):
        rows.append({
            'config': name, 'op': 'throughput', 'bound': bound,
            'tokens_per_s': median(rates[bound]), 'runs': rates[bound],
            'ratio': median(ratios) if bound == 2 else 1.0
        })
  print()
  print_table(rows, COLUMNS)
  path = write_results(
      'stop_latency_throughput' if args.log_every_none else 'stop_latency', rows, {
          'shapes': {k: v[1] for k, v in SHAPES.items()}, 'cap_s': args.cap_s,
          'target': f'bounded stop within 2 step times + the commit; tokens/s ratio >= '
                    f'{TARGET_RATIO}', 'steps': steps, 'warmup': args.warmup
      })
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
