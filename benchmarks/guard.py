"""The finite guard's cost: one NaN/inf reduction over the state, next to a training step.

    python -m benchmarks.guard [--config=12m|tiny] [--repeats=20]

The guard runs once per checkpoint, so its share of training time is
(guard seconds) / (checkpoint interval x step seconds).
"""

import argparse
import time

import jax

from benchmarks.common import median, print_table, write_results
from configs import andrea_12m, tiny
from jaxckpt.model import data as data_lib
from jaxckpt.train import state as trainer_lib

CONFIGS = {'tiny': tiny, '12m': andrea_12m}


def measure(name: str, repeats: int) -> list[dict]:
  config = CONFIGS[name].get_config()
  with config.unlocked():
    config.train.batch_size = 8
  trainer = trainer_lib.build_trainer(config)
  state = trainer.init_fn(jax.random.key(0))
  batch = trainer.put_batch(data_lib.from_config(config).batch(0))
  jax.block_until_ready(trainer.nonfinite_counts(state))  # compile both before timing
  state, metrics = trainer.train_step(state, batch)
  jax.block_until_ready(metrics)
  steps, guards = [], []
  for _ in range(repeats):
    t = time.perf_counter()
    state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    steps.append(time.perf_counter() - t)
    t = time.perf_counter()
    trainer_lib.check_finite(trainer, state, 1)
    guards.append(time.perf_counter() - t)
  step_s, guard_s = median(steps), median(guards)
  every = config.checkpoint.every
  return [{
      'config': name, 'step_s': step_s, 'guard_s': guard_s, 'guard_per_step': guard_s / step_s,
      'checkpoint_every': every, 'share_of_training': guard_s / (every * step_s)
  }]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='12m', choices=sorted(CONFIGS))
  parser.add_argument('--repeats', type=int, default=20)
  args = parser.parse_args(argv)
  rows = measure(args.config, args.repeats)
  print(print_table(rows))
  write_results('guard', rows, {'repeats': args.repeats})


if __name__ == '__main__':
  main()
