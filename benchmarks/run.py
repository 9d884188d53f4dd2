"""Run every jaxckpt benchmark in sequence, each in its own process.

    python -m benchmarks.run            # andrea_12m and andrea_120m (~25 min on 2 cores)
    python -m benchmarks.run --quick    # andrea_12m only, fewer repeats (~6 min)

One process per benchmark, so that one's memory (a 1.46 GB state, staging buffers, page cache)
is gone before the next one measures. Results land in benchmarks/results/ (<name>.json and
PNGs); a benchmark that fails is reported and the others still run. The numbers are only as
good as the quiet they ran in: each JSON records the share of the CPU other processes used.
"""

import argparse
import subprocess
import sys
import time

# jaxckpt's default storage (auto: its raw flat file on one process) and, side by side, orbax
# as the array writer, so that the gain of the raw store is measured, not assumed.
FULL = [
    ('checkpoint', ['--config=both', '--repeats=3', '--storage=both']),
    ('overhead', ['--repeats=2']),
    ('fixed_cost', ['--repeats=10']),
    ('memory', ['--config=120m', '--repeats=2', '--storage=both']),
    ('profile_save', ['--config=120m', '--saves=3']),
    ('profile_save', ['--config=120m', '--saves=3', '--storage=orbax',
                      '--name=profile_save-orbax']),
]
QUICK = [
    ('checkpoint', ['--config=12m', '--repeats=2', '--storage=both']),
    ('overhead', ['--repeats=1']),
    ('fixed_cost', ['--repeats=5']),
    ('memory', ['--config=12m', '--repeats=1', '--storage=both']),
    ('profile_save', ['--config=12m', '--saves=2']),
]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='andrea_12m only, fewer repeats')
  parser.add_argument('--only', default='', help='comma list of benchmarks to run')
  args = parser.parse_args(argv)

  plan = QUICK if args.quick else FULL
  if args.only:
    wanted = set(args.only.split(','))
    plan = [(name, flags) for name, flags in plan if name in wanted]
  failed = []
  for name, flags in plan:
    command = [sys.executable, '-m', f'benchmarks.{name}', *flags]
    print(f"\n=== {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    code = subprocess.call(command)
    print(f'=== {name}: exit {code} after {time.perf_counter() - start:.0f} s', flush=True)
    if code:
      failed.append(name)
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
