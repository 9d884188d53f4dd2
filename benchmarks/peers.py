"""A lost host's restore from its peers (replicas=1) against restores from the remote tier.

    python -m benchmarks.peers [--params=120.8e6] [--processes=2] [--repeats=1]

`--processes` real jax.distributed processes (one CPU device each, gloo collectives) share an
andrea_120m-shaped adamw state (`benchmarks.common.synthetic_state(120.8e6, 449)`: 1.45 GB of
float32; `--params=12e6` for a quick run) on a 1-D mesh ('data',): leaves whose leading dimension
divides by the process count are split over 'data', the others replicated. Each process writes
its own state file, and the replicated leaves are in process 0's, so every process's restore
reads from every part. Each process has its own directory, ROOT/host{k}, standing for its host's
own disk; a moto S3 server (in this process, on loopback) is the remote tier.

1. save: every process saves step 1 to ROOT/host{k}/ckpt with `CheckpointOptions(replicas=1)`
   (its own part, plus a replica of process k-1's part); this process then assembles one
   complete copy (host0's step directory and each other process's own part from its host) and
   uploads it with `objects.upload`, as the hosts' uploaders would have.

Then, in each repeat, these phases in turn, each after host1's directory is wiped (a
replacement VM):

2. peer (`--replicas=1`): every process runs `peers.restore_dir(..., remote=None)`: host1's step
   directory is brought back from the peers (`sends`: rounds of `jax.lax.ppermute` in a
   shard_map, `sends.WINDOW` windows, disk reads and writes overlapped with the collective), then
   `CheckpointManager.restore` and `jax.block_until_ready`.
3. remote, the lost host's part (`--replicas=0`, what a job without replicas does now): the
   replicas are moved aside on every host, so each holds only its own part, and every process
   runs `peers.restore_dir` with the remote (`partial.peer_source`): the part no living process
   holds (the lost host's) is read from the remote once, by a process that needs it, and sent to
   the others that need it; the parts the living hosts hold come from them, as in phase 2. The
   headline.
4. remote, every host downloads: what a job without replicas did before it read parts. A host
   then holds only its own part and a data-parallel restore needs every part, so every process
   downloads the whole checkpoint (`objects.download`, all of them at once from the one server)
   into ROOT/host{k}/remote, which holds nothing of it, and restores from there.
5. remote, the lost host alone: process 1 alone downloads the checkpoint whole and restores from
   it; the others restore from the step directories on their own disks, which hold every part
   (with 3 processes, thanks to the peer phase before). A reference row: what a remote restore
   could be at best.

Every phase starts on every process together (a barrier after jax.distributed is up). Two
times are reported: `lost_s`, the lost host's (process 1's), and `job_s`, the job's (the largest
over the processes), each from that barrier until the state is on the process's devices: the job
takes its first step only once its slowest process has restored. `move_s`/`restore_s` split the
lost host's time into bringing the files to its disk (`restore_dir` or `download`) and
`CheckpointManager.restore`; in the peer phase, `check_s` is the CRC check of the parts each
process already holds (`holdings.intact`, the largest over the processes) and `permute_s` the lost
host's time in the collective calls (`sends._move`: device_put, the ppermute, the copy out; the
benchmark wraps both to time them). Every shard restored is checked against the CRC-32 the save
recorded. `job_ratio` is a remote row's `job_s` over the peer's, `lost_ratio` the same of
`lost_s`; the target is on the headline's `job_ratio`.

What the numbers do not say: both tiers are loopback on this machine. The server is Python on
the same cores as the workers (no network in between), and in phase 3 the processes' downloads
share it: its speed says nothing of a real bucket's, where each host has its own network. The
collective is gloo over loopback TCP, not a real interconnect (NCCL, ICI). The page cache is not
evicted: every phase reads files just written.

Target: remote job_s / peer job_s >= 5. Prints a table, writes benchmarks/results/peers.json.
"""

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BUCKET = 'bench-peers'
LOST = 1  # the process whose host is lost
TARGET = 5.0
PHASES = {  # mode: the row's label
    'peer': 'peer (--replicas=1)',
    'remote_parts': "remote, the lost host's part (--replicas=0)",
    'remote': 'remote, every host downloads whole (before)',
    'remote_lost': 'remote, the lost host alone downloads whole',
}
HEADLINE = 'remote_parts'
COLUMNS = [
    'phase', 'processes', 'state_bytes', 'lost_s', 'job_s', 'move_s', 'restore_s', 'check_s',
    'permute_s', 'own_bytes', 'peers_bytes', 'remote_bytes', 'job_remote_bytes', 'job_ratio',
    'lost_ratio', 'target', 'met'
]


def _directory(root: Path, k: int) -> Path:
  return root / f'host{k}' / 'ckpt'


def _crc(x) -> str:
  return f'{zlib.crc32(memoryview(np.ascontiguousarray(x)).cast("B")):08x}'


def _timed(module, name: str, spent: list) -> None:
  """Wraps `module.name` to add its seconds to spent[0] and its calls to spent[1]."""
  fn = getattr(module, name)

  def wrapped(*a, **kw):
    t = time.perf_counter()
    try:
      return fn(*a, **kw)
    finally:
      spent[0] += time.perf_counter() - t
      spent[1] += 1

  setattr(module, name, wrapped)


def build_state(root_dir: Path, process: int, params: float, leaves: int, sharding) -> dict:
  """The synthetic state on this process's devices (`sharding(shape)` of each leaf, placed one
  leaf at a time), with its shards' CRCs (and, on process 0, the state's spec) written under
  `root_dir` for the restores to check against."""
  import jax

  from benchmarks.common import synthetic_state
  host = synthetic_state(int(params), leaves)
  state = {}
  for name in list(host):
    x = host.pop(name)  # one leaf at a time: the host copy goes once it is on the device
    state[name] = jax.make_array_from_callback(x.shape, sharding(x.shape), lambda i, x=x: x[i])
  jax.block_until_ready(state)
  digest = {n: _crc(x.addressable_shards[0].data) for n, x in state.items()}
  (root_dir / f'digest{process}.json').write_text(json.dumps(digest))
  if process == 0:
    spec = {n: [list(x.shape), str(x.dtype)] for n, x in state.items()}
    (root_dir / 'spec.json').write_text(json.dumps(spec))
  return state


def check_restored(root_dir: Path, process: int, state: dict) -> None:
  """Exits naming the leaves whose restored shards differ from the ones `build_state` made."""
  want = json.loads((root_dir / f'digest{process}.json').read_text())
  bad = [n for n, x in state.items() if _crc(x.addressable_shards[0].data) != want[n]]
  if bad:
    raise SystemExit(f'process {process}: {len(bad)} leaves restored wrong, e.g. {bad[:3]}')


def worker(mode: str, process: int, count: int, coordinator: str, root: str, params: float,
           leaves: int, url: str, timeout: float) -> None:
  """`save` (step 1 with replicas=1; the state's spec and this process's shard CRCs to ROOT), or
  one restore in a phase of PHASES, timed (prints RESULT {json})."""
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import (CheckpointManager, CheckpointOptions, layout, manifest, multihost,
                                  shardtable)
  from jaxckpt.checkpoint import holdings, peers, sends
  from jaxckpt.checkpoint.remote import Store, objects, partial
  from jaxckpt.checkpoint.tree import named_leaves
  root_dir = Path(root)
  directory = _directory(root_dir, process)
  mesh = Mesh(np.asarray(jax.devices()), ('data',))

  def sharding(shape):
    split = len(shape) > 0 and shape[0] % count == 0
    return NamedSharding(mesh, P('data') if split else P())

  if mode == 'save':
    state = build_state(root_dir, process, params, leaves, sharding)
    options = CheckpointOptions(replicas=1, keep=0, barrier_timeout_secs=timeout)
    start = time.perf_counter()
    with CheckpointManager(directory, options) as mgr:
      mgr.save(1, state)
    print('RESULT ' + json.dumps({'save_s': time.perf_counter() - start}), flush=True)
    return

  spec = json.loads((root_dir / 'spec.json').read_text())
  target = {
      n: jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=sharding(tuple(s)))
      for n, (s, d) in spec.items()
  }
  check, permute = [0.0, 0], [0.0, 0]
  if mode == 'peer':
    _timed(holdings, 'intact', check)
    _timed(sends, '_move', permute)
  multihost.client().wait_at_barrier(f'bench/peers/{mode}', int(timeout * 1000))
  start = time.perf_counter()
  step_dir = directory / layout.step_dirname(1)
  if mode in ('peer', 'remote_parts'):
    remote = partial.peer_source(Store(url), 1, inspect=process == 0) if mode != 'peer' else None
    got = peers.restore_dir(directory, target, multihost.Group(timeout), remote)
    if got is None:
      raise SystemExit(f'process {process}: the peers hold no whole checkpoint')
    step_dir, sources = got.path, got.sources
  elif mode == 'remote' or process == LOST:
    into = root_dir / f'host{process}' / ('remote' if mode == 'remote' else 'ckpt')
    step_dir, _ = objects.download(Store(url), 1, into)
    fetched = sum(p.stat().st_size for p in step_dir.rglob('*') if p.is_file())
    sources = {'own': 0, 'peers': 0, 'remote': fetched}
  else:  # a host that kept its disk reads the files its devices need from it
    m = manifest.read(step_dir)
    need = multihost.needed_files(
        shardtable.shard_table(step_dir, m, None), named_leaves(target), count)[process]
    sources = {'own': sum(m['files'][r]['size'] for r in need), 'peers': 0, 'remote': 0}
  moved = time.perf_counter()
  mgr = CheckpointManager(step_dir.parent, CheckpointOptions(barrier_timeout_secs=timeout))
  state, _ = mgr.restore(step_dir, target)
  jax.block_until_ready(state)
  done = time.perf_counter()
  mgr.close()
  check_restored(root_dir, process, state)
  result = {'seconds': done - start, 'move_s': moved - start, 'restore_s': done - moved, **sources}
  if mode == 'peer':
    result.update(check_s=check[0], permute_s=permute[0], windows=permute[1])
  print('RESULT ' + json.dumps(result), flush=True)


def run_workers(mode: str,
                args,
                root: Path,
                url: str,
                module: str = 'benchmarks.peers',
                extra: tuple[str, ...] = ()) -> list[dict]:
  """One job of `args.processes` workers of `module` in `mode` (`extra`: more arguments after
  the common ones); each one's RESULT. A worker that fails ends the others (they would wait for
  it until their timeout)."""
  coordinator = f'127.0.0.1:{_free_port()}'
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  env.update(JAX_PLATFORMS='cpu', PYTHONPATH=str(REPO))  # AWS_* of the server are in os.environ
  logs = [root / 'logs' / f'{mode}-{k}.txt' for k in range(args.processes)]
  logs[0].parent.mkdir(exist_ok=True)
  procs = []
  for k, log in enumerate(logs):
    with open(log, 'w') as out:  # a file, not a pipe: no worker blocks on output unread
      procs.append(
          subprocess.Popen([
              sys.executable, '-m', module, '--worker', mode,
              str(k),
              str(args.processes), coordinator,
              str(root),
              str(args.params),
              str(args.leaves), url,
              str(args.timeout), *extra
          ],
                           cwd=REPO,
                           env=env,
                           stdout=out,
                           stderr=subprocess.STDOUT))
  deadline = time.monotonic() + args.timeout + 120
  while any(p.poll() is None for p in procs):
    failed = [k for k, p in enumerate(procs) if p.returncode]
    if failed or time.monotonic() > deadline:
      for p in procs:
        if p.poll() is None:
          p.kill()
          p.wait()
      why = f'process {failed[0]} failed' if failed else f'still running after {args.timeout} s'
      raise SystemExit(f'{mode}: {why}:\n' + logs[failed[0] if failed else 0].read_text()[-3000:])
    time.sleep(0.2)
  texts = [log.read_text() for log in logs]
  for k, (p, text) in enumerate(zip(procs, texts)):
    if p.returncode:
      raise SystemExit(f'{mode}: process {k} failed (exit {p.returncode}):\n{text[-3000:]}')
  return [json.loads(next(l for l in t.splitlines() if l.startswith('RESULT '))[7:]) for t in texts]


@contextlib.contextmanager
def _own_parts_only(root: Path, count: int, hide: bool):
  """While it lasts (when `hide`), each host's replicas of other processes' parts are moved
  out of its step directory: each host holds its own part alone, as without `--replicas`."""
  from jaxckpt.checkpoint import layout
  moved = []
  for k in range(count) if hide else ():
    state = _directory(root, k) / layout.step_dirname(1) / 'state'
    for part in state.glob('process_*.safetensors') if state.is_dir() else ():
      if part.name != f'process_{k}.safetensors':
        aside = root / f'host{k}' / f'aside-{part.name}'
        os.replace(part, aside)
        moved.append((aside, part))
  try:
    yield
  finally:
    for aside, part in moved:
      os.replace(aside, part)


def upload_whole(root: Path, count: int, url: str) -> int:
  """The complete checkpoint the hosts' uploaders would have put in the remote: host0's step
  directory plus each other process's own part from its host (hard links, nothing copied)."""
  from jaxckpt.checkpoint import layout
  from jaxckpt.checkpoint.remote import Store, objects
  name = layout.step_dirname(1)
  whole = root / 'whole' / name
  shutil.copytree(_directory(root, 0) / name, whole, copy_function=os.link)
  for k in range(1, count):
    part = _directory(root, k) / name / 'state' / f'process_{k}.safetensors'
    if not (whole / 'state' / part.name).exists():
      os.link(part, whole / 'state' / part.name)
  objects.upload(Store(url), whole, {}, may_write=lambda _: None, may_delete=lambda _: None)
  nbytes = sum(p.stat().st_size for p in whole.rglob('*') if p.is_file())
  shutil.rmtree(root / 'whole')
  return nbytes


def _row(mode: str, results: list[list[dict]], count: int, state_bytes: int) -> dict:
  """One phase's figures, medians over the repeats: the lost host's, and the job's (the
  slowest process's) seconds."""
  lost = [r[LOST] for r in results]
  job = [max(x['seconds'] for x in r) for r in results]
  med = lambda key: statistics.median(x[key] for x in lost)  # noqa: E731
  row = {
      'phase': PHASES[mode], 'processes': count, 'state_bytes': state_bytes,
      'lost_s': med('seconds'), 'job_s': statistics.median(job), 'move_s': med('move_s'),
      'restore_s': med('restore_s'), 'own_bytes': lost[0]['own'], 'peers_bytes': lost[0]['peers'],
      'remote_bytes': lost[0]['remote'], 'job_remote_bytes': sum(x['remote'] for x in results[0]),
      'all_lost_s': [x['seconds'] for x in lost], 'all_job_s': job
  }
  if mode == 'peer':
    row.update(
        check_s=statistics.median(max(x['check_s'] for x in r) for r in results),
        permute_s=med('permute_s'),
        windows=lost[0]['windows'])
  return row


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--params', type=float, default=120.8e6, help='model parameters (x3: adamw)')
  ap.add_argument('--leaves', type=int, default=449)
  ap.add_argument('--processes', type=int, default=2, choices=(2, 3))
  ap.add_argument('--repeats', type=int, default=1, help='rounds of the three restore phases')
  ap.add_argument('--timeout', type=float, default=900, help='seconds any wait of a worker takes')
  ap.add_argument(
      '--scratch', default=tempfile.gettempdir(), help='where the disks of the hosts are')
  args = ap.parse_args(argv)
  from benchmarks.common import print_table, write_results
  from jaxckpt.checkpoint import sends
  server = local_s3(BUCKET)
  url = f's3://{BUCKET}/peers'
  root = Path(tempfile.mkdtemp(prefix='jaxckpt-peers-bench-', dir=args.scratch))
  load_before = os.getloadavg()[0]
  started = time.perf_counter()
  runs = {mode: [] for mode in PHASES}
  try:
    saved = run_workers('save', args, root, url)
    print(f'saved: {[round(r["save_s"], 2) for r in saved]} s', file=sys.stderr, flush=True)
    t = time.perf_counter()
    state_bytes = upload_whole(root, args.processes, url)
    upload_s = time.perf_counter() - t
    print(f'uploaded {state_bytes / 1e9:.2f} GB in {upload_s:.1f} s', file=sys.stderr, flush=True)
    for _ in range(args.repeats):
      for mode in PHASES:
        shutil.rmtree(root / f'host{LOST}')  # a replacement VM: nothing of its own
        with _own_parts_only(root, args.processes, mode == 'remote_parts'):
          runs[mode].append(run_workers(mode, args, root, url))
        for k in range(args.processes):  # the downloads of a job without replicas go with it
          shutil.rmtree(root / f'host{k}' / 'remote', ignore_errors=True)
        print(f'{mode}: {json.dumps(runs[mode][-1])}', file=sys.stderr, flush=True)
  finally:
    server.stop()
    shutil.rmtree(root, ignore_errors=True)
  rows = [_row(mode, runs[mode], args.processes, state_bytes) for mode in PHASES]
  peer = rows[0]
  for row in rows[1:]:
    row.update(job_ratio=row['job_s'] / peer['job_s'], lost_ratio=row['lost_s'] / peer['lost_s'])
  head = rows[list(PHASES).index(HEADLINE)]
  ratio = head['job_ratio']
  head.update(target=TARGET, met=ratio >= TARGET)
  print(f'{state_bytes / 1e9:.2f} GB state on {args.processes} processes; from the common start '
        f'to the state on the devices (median of {args.repeats}): lost_s of process {LOST} (the '
        f'lost host), job_s of the slowest process; job_ratio, lost_ratio: a row over '
        f'the peer row; both tiers are loopback on this machine')
  print_table(rows, COLUMNS)
  path = write_results(
      'peers', rows, {
          'params': args.params, 'leaves': args.leaves, 'processes': args.processes, 'repeats':
              args.repeats, 'window_bytes': sends.WINDOW, 'save_s': [r['save_s'] for r in saved],
          'upload_s': upload_s, 'runs': runs, 'headline': PHASES[HEADLINE], 'ratio':
              ratio, 'lost_ratio': head['lost_ratio'], 'target': f'job_ratio >= {TARGET}',
          'met': ratio >= TARGET, 'wall_s': time.perf_counter() - started, 'load_before':
              load_before, 'load_after': os.getloadavg()[0]
      })
  print(f'wrote {path}')


def local_s3(bucket: str):
  """A moto S3 server in this process, on loopback, holding `bucket` (started; `.stop()` it);
  the AWS_* variables that reach it are set in os.environ, for the workers too."""
  from moto.server import ThreadedMotoServer
  port = _free_port()
  os.environ.update(
      AWS_ENDPOINT_URL=f'http://127.0.0.1:{port}',
      AWS_ACCESS_KEY_ID='bench',
      AWS_SECRET_ACCESS_KEY='bench',
      AWS_REGION='us-east-1')
  logging.getLogger('werkzeug').setLevel(logging.WARNING)  # not a line per request
  server = ThreadedMotoServer(ip_address='127.0.0.1', port=port, verbose=False)
  server.start()
  import boto3
  boto3.client('s3', endpoint_url=os.environ['AWS_ENDPOINT_URL']).create_bucket(Bucket=bucket)
  return server


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


if __name__ == '__main__':
  if len(sys.argv) > 1 and sys.argv[1] == '--worker':
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6],
           float(sys.argv[7]), int(sys.argv[8]), sys.argv[9], float(sys.argv[10]))
  else:
    main()
