"""Shared measurement helpers: synthetic states, timing, page cache, durability, memory, reporting.

A "state" here is an ordered dict {name: np.ndarray}: float32 leaves plus a few int32 scalars,
shaped like a GPT's adamw train state (params, mu, nu, step counters).

    from benchmarks.common import synthetic_state, peak_rss_during, print_table
    state = synthetic_state(12_800_000, n_leaves=449, seed=0)
"""

import ctypes
import datetime
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import psutil

RESULTS_DIR = Path(__file__).resolve().parent / 'results'

# ---------------------------------------------------------------------------------------------
# Synthetic states

# One transformer block as (leaf name, shape in units of the model width d). Kernels are
# (in, out) as in flax. The mix matters: fixed per-leaf costs dominate small leaves, bandwidth
# dominates the big ones, and a real model has both.
_BLOCK = (
    ('ln_1/scale', (1,)),
    ('ln_1/bias', (1,)),
    ('attn/qkv/kernel', (1, 3)),
    ('attn/qkv/bias', (3,)),
    ('attn/proj/kernel', (1, 1)),
    ('attn/proj/bias', (1,)),
    ('ln_2/scale', (1,)),
    ('ln_2/bias', (1,)),
    ('mlp/fc/kernel', (1, 4)),
    ('mlp/fc/bias', (4,)),
    ('mlp/proj/kernel', (4, 1)),
    ('mlp/proj/bias', (1,)),
)
# Share of parameters in the blocks; the embedding takes the rest (GPT-2 small: 85M of 124M).
_BLOCK_SHARE = 0.7
# adamw keeps two int32 counters next to the float leaves: the train step and the optimizer count.
_COUNTERS = ('step', 'opt/count')


def _model_shapes(n_params: int, n_leaves: int) -> list[tuple[str, tuple[int, ...]]]:
  """Names and shapes of a GPT-like parameter tree: n_leaves leaves, ~n_params elements."""
  layout = [(f'h{i // len(_BLOCK):02d}/{name}', units)
            for i, (name,
                    units) in enumerate(itertools.islice(itertools.cycle(_BLOCK), n_leaves - 1))]
  # Block elements are a*d^2 + b*d; pick the width d that gives blocks their share.
  a = sum(math.prod(u) for _, u in layout if len(u) == 2)
  b = sum(u[0] for _, u in layout if len(u) == 1)
  if a:
    budget = _BLOCK_SHARE * n_params
    d = (-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a)
    d = int(d) // 8 * 8 if d >= 8 else max(1, int(d))
  else:
    d = max(1, n_params // (b + 1))  # vectors only (tiny states): one embedding row of d
  block_elems = sum(math.prod(u) * d**len(u) for _, u in layout)
  # The embedding's row count absorbs the remainder, so the total lands within d of the target.
  vocab = max(1, (n_params - block_elems) // d)
  return [('wte/embedding',
           (vocab, d))] + [(name, tuple(k * d for k in units)) for name, units in layout]


def synthetic_state(n_params_target: int, n_leaves: int, seed: int = 0) -> dict[str, np.ndarray]:
  """A random adamw-like state: params, mu and nu of identical shapes plus int32 counters.

    The state holds ~3 x n_params_target float32 elements (12 bytes per parameter): 120.8M
    parameters and 449 leaves give 3 x 149 float leaves + 2 counters, 1.45 GB. Values are normal
    floats, which orbax's zstd shrinks by only ~8% (random mantissas), so compression cannot
    flatter a checkpointer. Under 5 leaves (warm-up states) gives plain params, no optimizer.

    Args:
      n_params_target: model parameters, i.e. elements in the params group alone.
      n_leaves: exact number of leaves in the returned dict.
      seed: numpy Generator seed; the same arguments give the same state.
    """
  rng = np.random.default_rng(seed)
  if n_leaves < len(_COUNTERS) + 3:
    # Too few leaves for the adamw layout (tiny warm-up states): plain float leaves.
    groups, counters = {'params': 1.0}, []
    per_group = n_leaves
  else:
    groups = {'params': 0.02, 'opt/mu': 1e-3, 'opt/nu': 1e-6}  # rough magnitudes of each
    per_group = (n_leaves - len(_COUNTERS)) // 3
    spare = n_leaves - len(_COUNTERS) - 3 * per_group
    counters = list(_COUNTERS) + [f'opt/counter_{i}' for i in range(spare)]

  shapes = _model_shapes(n_params_target, per_group)
  state = {}
  for prefix, scale in groups.items():
    for name, shape in shapes:
      leaf = rng.standard_normal(shape, dtype=np.float32)
      leaf *= scale  # in place: a 1.45 GB state should not need twice the memory
      if prefix == 'opt/nu':
        np.abs(leaf, out=leaf)  # second moments are non-negative
      state[f'{prefix}/{name}'] = leaf
  for name in counters:
    state[name] = np.array(rng.integers(0, 1_000_000), dtype=np.int32)
  return state


def state_nbytes(state: dict[str, np.ndarray]) -> int:
  return sum(a.nbytes for a in state.values())


# ---------------------------------------------------------------------------------------------
# Timing


class Timer:
  """Wall time of a block: `with Timer() as t: ...` then read `t.seconds`."""

  def __enter__(self):
    self._start = time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.seconds = time.perf_counter() - self._start


def child_row(module: str, config: str, variant: str, where: str, env=None) -> dict:
  """Runs `python -m <module> --config=C --child=VARIANT --where=W` (a fresh process measuring one
  variant) and returns the JSON row it prints last; a child that fails ends the benchmark."""
  done = subprocess.run([
      sys.executable, '-m', module, f'--config={config}', f'--child={variant}', f'--where={where}'
  ],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=1800,
                        check=False)
  if done.returncode:
    raise SystemExit(f'{variant}: child failed:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def timed(fn, repeats: int = 3) -> list[float]:
  """Seconds taken by each of `repeats` calls of fn()."""
  seconds = []
  for _ in range(repeats):
    with Timer() as t:
      fn()
    seconds.append(t.seconds)
  return seconds


def median(values) -> float:
  return statistics.median(values)


class OtherLoad:
  """Share of the machine's CPU (0..1) used by other processes while a block ran.

    On a shared 2-vCPU machine a benchmark is only as good as the quiet it ran in, so record
    this next to the results. Kernel threads writing back our files count as "other", so a
    disk-heavy benchmark reads a few percent even on an idle machine.

        with OtherLoad() as load:
            ...
        load.share
    """

  def __enter__(self):
    self._start = (time.perf_counter(), _busy_cpu_seconds(), _own_cpu_seconds())
    return self

  def __exit__(self, *exc):
    wall, busy, own = (now - then for now, then in zip((time.perf_counter(), _busy_cpu_seconds(),
                                                        _own_cpu_seconds()), self._start))
    self.share = min(1.0, max(0.0, (busy - own) / (wall * psutil.cpu_count())))


def _busy_cpu_seconds() -> float:
  times = psutil.cpu_times()
  # Linux counts guest time inside user (and guest_nice inside nice): summing every field
  # would count a guest's time twice.
  not_busy = ('idle', 'iowait', 'guest', 'guest_nice')
  return sum(times) - sum(getattr(times, name, 0.0) for name in not_busy)


def _own_cpu_seconds() -> float:
  times = psutil.Process().cpu_times()
  return times.user + times.system + times.children_user + times.children_system


# ---------------------------------------------------------------------------------------------
# Page cache and durability


def _files_under(paths) -> list[str]:
  files = []
  for path in map(str, paths):
    if os.path.isfile(path):
      files.append(path)
    for root, _, names in os.walk(path):
      files.extend(os.path.join(root, n) for n in names)
  return files


def _fsync_path(path, flags=os.O_RDONLY) -> None:
  fd = os.open(path, flags)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def fsync_tree(path) -> None:
  """fsync every file and directory under path, then path's parent.

    A file's data is durable after its own fsync, but its name only after its directory's; the
    parent holds the entry for path itself. fsync of already-clean files costs next to nothing,
    so savers that fsync on their own pay little for this.
    """
  path = Path(path)
  if path.is_file():
    _fsync_path(path)
  else:
    for root, _, names in os.walk(path, topdown=False):
      for name in names:
        _fsync_path(os.path.join(root, name))
      _fsync_path(root, os.O_RDONLY | os.O_DIRECTORY)
  _fsync_path(path.parent, os.O_RDONLY | os.O_DIRECTORY)


def _still_cached(paths) -> bool | None:
  """Whether any file under paths has its first page cached; None if the kernel cannot tell.

    A read with RWF_NOWAIT succeeds only from the page cache and, since Linux 5.9, starts no I/O,
    so probing does not warm what it probes.
    """
  probe = bytearray(4096)
  for path in _files_under(paths):
    fd = os.open(path, os.O_RDONLY)
    try:
      if os.preadv(fd, [probe], 0, os.RWF_NOWAIT) > 0:
        return True
    except BlockingIOError:
      continue  # not cached: what we want
    except (OSError, AttributeError):
      return None  # kernel or filesystem without RWF_NOWAIT
    finally:
      os.close(fd)
  return False


def evict_page_cache(paths) -> str:
  """Evict the files under paths from the page cache; returns the method that worked.

    "drop_caches" (whole machine, needs root outside a locked-down container), "fadvise"
    (POSIX_FADV_DONTNEED per file, after fsync since only clean pages can be dropped), or "none"
    when neither worked or a probe still finds cached pages.
    """
  os.sync()  # drop_caches only drops clean pages
  try:
    with open('/proc/sys/vm/drop_caches', 'w') as f:
      f.write('3\n')
    method = 'drop_caches'
  except OSError:
    method = 'fadvise'
    try:
      for path in _files_under(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
          os.fsync(fd)
          os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
          os.close(fd)
    except OSError:
      return 'none'
  return 'none' if _still_cached(paths) else method


def drop_page_cache(paths) -> bool:
  """Evict the files under paths from the page cache; True when a cold read can be claimed."""
  return evict_page_cache(paths) != 'none'


# ---------------------------------------------------------------------------------------------
# Memory


def recycle_memory(nbytes: int) -> None:
  """Fault in nbytes of anonymous memory and free it, just before a timed operation.

    This VM hands freed memory back to its host within a second or two, and faulting such pages
    in again runs at 0.5-1 GB/s instead of ~12 GB/s. Whether an operation's allocations and
    page-cache pages hit returned memory would otherwise depend on how long ago something else
    freed memory. Recycling right before timing gives every operation the same condition: that
    of a long-running process whose memory is reused, the best case for everyone.
    """
  nbytes = int(min(nbytes, psutil.virtual_memory().available // 2))  # never cause swapping
  if nbytes <= 0:
    return
  ballast = np.empty(nbytes, dtype=np.uint8)  # above malloc's mmap threshold: munmap'ed on del
  ballast[::4096] = 1  # one write per page faults it in
  del ballast


def settle(paths=(), recycle_bytes: int = 0, quiet_s: float = 2.0) -> str:
  """Put the machine in the common starting state for a timed operation.

    Evicts the files under paths (a clean, cold page cache: no earlier writeback is billed to
    the operation and reads come from disk), waits quiet_s because the memory that eviction
    frees keeps the VM's page-reporting worker busy for a second or two, then recycles
    recycle_bytes of memory. Benchmarks that compare against benchmarks.baselines should call
    this before each timed operation, with the same arguments. Returns evict_page_cache's method.
    """
  cache = evict_page_cache(paths)
  time.sleep(quiet_s)
  recycle_memory(recycle_bytes)
  return cache


def _release_free_heap() -> None:
  """Hand memory that malloc keeps after free() back to the kernel (glibc only).

    glibc raises its mmap threshold after large frees, so later allocations of up to 32 MiB come
    from a heap it keeps around. Without this, an operation reusing a previous one's freed heap
    would show no RSS growth at all.
    """
  try:
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass  # not glibc: the measurement may under-count, nothing worse


def _reset_peak_rss() -> bool:
  """Reset the kernel's RSS high-water mark (VmHWM) for this process; False if not allowed."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5\n')
    return True
  except OSError:
    return False


def _peak_rss() -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) * 1024
  return 0


def peak_rss_during(fn, interval_s: float = 0.005):
  """Run fn(); return (its result, peak RSS above the RSS at the start, in bytes).

    A thread samples RSS every interval_s. Sampling alone can miss short spikes, or be starved
    while fn holds the GIL, so the kernel's exact high-water mark is also read where resettable.
    """
  proc = psutil.Process()
  _release_free_heap()
  exact = _reset_peak_rss()
  baseline = peak = proc.memory_info().rss
  stop = threading.Event()

  def sample():
    nonlocal peak
    while not stop.wait(interval_s):
      peak = max(peak, proc.memory_info().rss)

  sampler = threading.Thread(target=sample, name='peak-rss', daemon=True)
  sampler.start()
  try:
    result = fn()
  finally:
    stop.set()
    sampler.join()
  peak = max(peak, proc.memory_info().rss, _peak_rss() if exact else 0)
  return result, peak - baseline


# ---------------------------------------------------------------------------------------------
# Reporting


def machine_info() -> dict:
  """What a reader needs to compare results from two machines."""
  versions = {}
  for package in ('jax', 'jaxlib', 'flax', 'orbax-checkpoint', 'tensorstore', 'torch',
                  'safetensors', 'numpy'):
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      versions[package] = None
  return {
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'jaxckpt_source': source_fingerprint(),
      'cpu_count': os.cpu_count(),
      'loadavg_1m': os.getloadavg()[0],
      'memory_bytes': psutil.virtual_memory().total,
      'python': platform.python_version(),
      'platform': platform.platform(),
      'versions': versions,
  }


def source_fingerprint() -> dict:
  """Which jaxckpt was measured: git HEAD, and a hash of the package's .py files as they are.

    The working tree may hold uncommitted changes (or change while a benchmark runs), so HEAD
    alone does not say what ran; the hash of jaxckpt/**/*.py does (read when results are
    written: a run that straddles an edit shows a hash that no longer matches its start).
    """
  import hashlib
  import subprocess

  repo = Path(__file__).resolve().parent.parent
  digest = hashlib.sha256()
  for path in sorted((repo / 'jaxckpt').rglob('*.py')):
    digest.update(str(path.relative_to(repo)).encode() + b'\0' + path.read_bytes())
  try:
    head = subprocess.run(['git', '-C', str(repo), 'rev-parse', '--short', 'HEAD'],
                          capture_output=True,
                          text=True,
                          check=True).stdout.strip()
    dirty = bool(
        subprocess.run(['git', '-C', str(repo), 'status', '--porcelain', 'jaxckpt'],
                       capture_output=True,
                       text=True,
                       check=True).stdout.strip())
  except (OSError, subprocess.CalledProcessError):
    head, dirty = None, None
  return {'git_head': head, 'jaxckpt_dirty': dirty, 'jaxckpt_py_sha256': digest.hexdigest()[:16]}


def _json_default(value):
  # numpy scalars and paths show up in rows; everything else is a bug worth seeing as text.
  return value.item() if hasattr(value, 'item') else str(value)


def write_results(name: str, rows: list[dict], meta: dict | None = None) -> Path:
  """Write rows, meta and machine info to benchmarks/results/<name>.json; returns the path.

    Written to a .tmp file and renamed, so a crash never leaves half a JSON file behind.
    """
  RESULTS_DIR.mkdir(parents=True, exist_ok=True)
  path = RESULTS_DIR / f'{name}.json'
  tmp = path.with_name(path.name + '.tmp')
  payload = {'name': name, 'machine': machine_info(), 'meta': meta or {}, 'rows': rows}
  tmp.write_text(json.dumps(payload, indent=2, default=_json_default) + '\n')
  os.replace(tmp, path)
  return path


def _format_cell(column: str, value) -> str:
  if value is None:
    return ''
  if isinstance(value, bool):
    return 'yes' if value else 'no'
  if column.endswith('bytes') and isinstance(value, (int, float)):
    return f'{value / 1e6:.1f} MB'
  if isinstance(value, float):
    return f'{value:.4g}'
  return str(value)


def print_table(rows: list[dict], columns: list[str] | None = None) -> str:
  """Print rows as an aligned text table (numbers right-aligned); returns the text too."""
  columns = columns or list(dict.fromkeys(k for row in rows for k in row))
  cells = [[_format_cell(c, row.get(c)) for c in columns] for row in rows]
  widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
  numeric = [all(isinstance(row.get(c), (int, float, type(None))) for row in rows) for c in columns]

  def line(values):
    return '  '.join(
        v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

  text = '\n'.join([line(columns), line(['-' * w for w in widths])] + [line(r) for r in cells])
  print(text)
  return text


def plot_bars(rows: list[dict], path, title: str, value: str = 'seconds', unit: str = 's') -> Path:
  """Horizontal bar chart of each row's `value` (seconds by default), labelled "name op"."""
  import matplotlib

  matplotlib.use('Agg')  # no display on benchmark machines
  import matplotlib.pyplot as plt

  rows = [r for r in rows if r.get(value) is not None]
  labels = [f"{r['name']} {r['op']}" for r in rows]
  values = [r[value] for r in rows]
  # The library under test stands out from the peers and limits it is compared with.
  colors = ['tab:orange' if r['name'].startswith('jaxckpt') else 'tab:blue' for r in rows]
  fig, ax = plt.subplots(figsize=(8, 1.0 + 0.3 * len(rows)))
  bars = ax.barh(labels, values, color=colors)
  ax.bar_label(bars, labels=[f'{v:.3g} {unit}' for v in values], padding=3, fontsize=8)
  ax.invert_yaxis()  # first row at the top, as in the table
  ax.set_xlabel(value if unit == 's' else f'{value} ({unit})')
  ax.set_title('\n'.join(textwrap.wrap(title, 70)), fontsize=10)
  ax.margins(x=0.15)
  fig.tight_layout()
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
