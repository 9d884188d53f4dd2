"""A lost host's restore from its peers (replicas=1) against a download from the remote tier.

    python -m benchmarks.peers [--params=120.8e6] [--processes=2] [--repeats=1]

`--processes` real jax.distributed processes (one CPU device each, gloo collectives) share an
andrea_120m-shaped adamw state (`benchmarks.common.synthetic_state(120.8e6, 449)`: 1.46 GB of
float32; `--params=12e6` for a quick run) on a 1-D mesh ('data',): leaves whose leading dimension
divides by the process count are split over 'data', the others replicated. Each process has its
own directory, ROOT/host{k}/ckpt, standing for its host's own disk; a moto S3 server (in this
process, on loopback) is the remote tier.

1. save: every process saves step 1 with `CheckpointOptions(replicas=1)` (its own part, plus a
   replica of process k-1's part); this process then assembles one complete copy (host0's step
   directory and each other process's own part from its host) and uploads it with
   `objects.upload`, as the hosts' uploaders would have.
2. peer: host1's directory is wiped (a replacement VM); every process runs
   `peers.restore_dir(..., remote=None)` (host1's step directory is brought back from the peers
   over a JAX collective: `multihost_utils.broadcast_one_to_all` in 32 MiB windows), then
   `CheckpointManager.restore` and `jax.block_until_ready`.
3. remote: host1's directory is wiped again; process 1 downloads the checkpoint whole
   (`objects.download`) and restores from it; the others restore from their own disks.

Each restore phase starts on every process together (a barrier after jax.distributed is up);
the time reported is the lost host's (process 1's), from the start of its restore until the
state is on its devices; every shard is then checked against the CRC-32 the save recorded.
The page cache is not evicted: both phases read files just written. The server is Python on
this machine's cores (no network in between): its speed says nothing of a real bucket's, and the
collective is gloo over loopback, not a real interconnect.

Target: remote_s / peer_s >= 5. Prints a table, writes benchmarks/results/peers.json.
"""

import argparse
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
COLUMNS = [
    'phase', 'processes', 'state_bytes', 'seconds', 'move_s', 'restore_s', 'own_bytes',
    'peers_bytes', 'remote_bytes', 'others_s', 'ratio', 'target', 'met'
]


def _directory(root: Path, k: int) -> Path:
  return root / f'host{k}' / 'ckpt'


def _crc(x) -> str:
  return f'{zlib.crc32(memoryview(np.ascontiguousarray(x)).cast("B")):08x}'


def worker(mode: str, process: int, count: int, coordinator: str, root: str, params: float,
           leaves: int, url: str, timeout: float) -> None:
  """`save` (step 1 with replicas=1; the state's spec and this process's shard CRCs to ROOT),
  `peer` or `remote` (one restore of the lost host, timed; prints RESULT {json})."""
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout, manifest, multihost
  from jaxckpt.checkpoint import peers
  from jaxckpt.checkpoint.remote import Store, objects
  from jaxckpt.checkpoint.tree import named_leaves
  root_dir = Path(root)
  directory = _directory(root_dir, process)
  mesh = Mesh(np.asarray(jax.devices()), ('data',))

  def sharding(shape):
    split = len(shape) > 0 and shape[0] % count == 0
    return NamedSharding(mesh, P('data') if split else P())

  if mode == 'save':
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
  multihost.client().wait_at_barrier(f'bench/peers/{mode}', int(timeout * 1000))
  start = time.perf_counter()
  step_dir = directory / layout.step_dirname(1)
  if mode == 'peer':
    got = peers.restore_dir(directory, target, multihost.Group(timeout), None)
    if got is None:
      raise SystemExit(f'process {process}: the peers hold no whole checkpoint')
    step_dir, sources = got.path, got.sources
  elif process == LOST:
    step_dir, _ = objects.download(Store(url), 1, directory)
    fetched = sum(p.stat().st_size for p in step_dir.rglob('*') if p.is_file())
    sources = {'own': 0, 'peers': 0, 'remote': fetched}
  else:  # a host that kept its disk reads the files its devices need from it
    m = manifest.read(step_dir)
    need = multihost.needed_files(m, named_leaves(target), count)[process]
    sources = {'own': sum(m['files'][r]['size'] for r in need), 'peers': 0, 'remote': 0}
  moved = time.perf_counter()
  mgr = CheckpointManager(directory, CheckpointOptions(barrier_timeout_secs=timeout))
  state, _ = mgr.restore(step_dir, target)
  jax.block_until_ready(state)
  done = time.perf_counter()
  mgr.close()
  want = json.loads((root_dir / f'digest{process}.json').read_text())
  bad = [n for n, x in state.items() if _crc(x.addressable_shards[0].data) != want[n]]
  if bad:
    raise SystemExit(f'process {process}: {len(bad)} leaves restored wrong, e.g. {bad[:3]}')
  print(
      'RESULT ' + json.dumps(
          {'seconds': done - start, 'move_s': moved - start, 'restore_s': done - moved, **sources}),
      flush=True)


def run_workers(mode: str, args, root: Path, url: str) -> list[dict]:
  """One job of `args.processes` workers in `mode`; each one's RESULT. A worker that fails
  ends the others (they would wait for it until their timeout)."""
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
              sys.executable, '-m', 'benchmarks.peers', '--worker', mode,
              str(k),
              str(args.processes), coordinator,
              str(root),
              str(args.params),
              str(args.leaves), url,
              str(args.timeout)
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


def _row(phase: str, results: list[dict], count: int, state_bytes: int) -> dict:
  """The lost host's figures of one phase (medians over the repeats)."""
  lost = [r[LOST] for r in results]
  others = [max(x['seconds'] for k, x in enumerate(r) if k != LOST) for r in results]
  med = lambda key: statistics.median(x[key] for x in lost)  # noqa: E731
  return {
      'phase': phase, 'processes': count, 'state_bytes': state_bytes, 'seconds': med('seconds'),
      'move_s': med('move_s'), 'restore_s': med('restore_s'), 'own_bytes': lost[0]['own'],
      'peers_bytes': lost[0]['peers'], 'remote_bytes': lost[0]['remote'],
      'others_s': statistics.median(others), 'all_seconds': [x['seconds'] for x in lost]
  }


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--params', type=float, default=120.8e6, help='model parameters (x3: adamw)')
  ap.add_argument('--leaves', type=int, default=449)
  ap.add_argument('--processes', type=int, default=2, choices=(2, 3))
  ap.add_argument('--repeats', type=int, default=1, help='peer and remote restores, alternating')
  ap.add_argument('--timeout', type=float, default=900, help='seconds any wait of a worker takes')
  ap.add_argument(
      '--scratch', default=tempfile.gettempdir(), help='where the disks of the hosts are')
  args = ap.parse_args(argv)
  from moto.server import ThreadedMotoServer

  from benchmarks.common import print_table, write_results
  from jaxckpt.checkpoint import peers
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
  boto3.client('s3', endpoint_url=os.environ['AWS_ENDPOINT_URL']).create_bucket(Bucket=BUCKET)
  url = f's3://{BUCKET}/peers'
  root = Path(tempfile.mkdtemp(prefix='jaxckpt-peers-bench-', dir=args.scratch))
  load_before = os.getloadavg()[0]
  started = time.perf_counter()
  runs = {'peer': [], 'remote': []}
  try:
    saved = run_workers('save', args, root, url)
    print(f'saved: {[round(r["save_s"], 2) for r in saved]} s', file=sys.stderr, flush=True)
    t = time.perf_counter()
    state_bytes = upload_whole(root, args.processes, url)
    upload_s = time.perf_counter() - t
    print(f'uploaded {state_bytes / 1e9:.2f} GB in {upload_s:.1f} s', file=sys.stderr, flush=True)
    for _ in range(args.repeats):
      for phase in ('peer', 'remote'):
        shutil.rmtree(root / f'host{LOST}')  # a replacement VM: nothing of its own
        runs[phase].append(run_workers(phase, args, root, url))
        print(f'{phase}: {json.dumps(runs[phase][-1])}', file=sys.stderr, flush=True)
  finally:
    server.stop()
    shutil.rmtree(root, ignore_errors=True)
  rows = [_row(phase, runs[phase], args.processes, state_bytes) for phase in ('peer', 'remote')]
  ratio = rows[1]['seconds'] / rows[0]['seconds']
  rows[0].update(ratio=ratio, target=TARGET, met=ratio >= TARGET)
  print(f'{state_bytes / 1e9:.2f} GB state on {args.processes} processes; seconds: process '
        f'{LOST} (the lost host) from the start of its restore to the state on its devices '
        f'(median of {args.repeats}); ratio: remote seconds / peer seconds')
  print_table(rows, COLUMNS)
  path = write_results(
      'peers', rows, {
          'params': args.params, 'leaves': args.leaves, 'processes': args.processes, 'repeats':
              args.repeats, 'window_bytes': peers.WINDOW, 'save_s': [r['save_s'] for r in saved],
          'upload_s': upload_s, 'runs': runs, 'ratio': ratio, 'target': f'>= {TARGET}',
          'met': ratio >= TARGET, 'wall_s': time.perf_counter() - started, 'load_before':
              load_before, 'load_after': os.getloadavg()[0]
      })
  print(f'wrote {path}')


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
