"""The remote tier against the raw S3 client, on a local S3 server (moto, its own process).

    python -m benchmarks.remote --config=120m --repeats=2 [--tokens]

- save -> remote-committed: from `save()` of the trainer's andrea_120m state (1.46 GB) until its
  manifest is committed in s3:// (local commit, then the uploader's parallel part uploads),
  against boto3's own multipart `upload_file` of the same files from the committed checkpoint
  (page cache warm) to the same server.
- restore from remote on an empty workdir: `objects.download` (parallel part reads, CRC-checked,
  into a local checkpoint) + the manager's restore onto the devices, against boto3's own
  `download_file` (ranged parallel GETs) of the same bytes.
- `--tokens`: andrea_12m training tokens/s with `--remote` on against off, both checkpointing
  every `--every` steps (benchmarks.overhead's method: fresh workdir, window after warm-up).

The server is Python on this machine's 2 cores, run at `nice 19` since it stands for another
machine (in the tokens/s pairs it must not take CPU from training that a real bucket would not);
absolute speeds say nothing of a real bucket;
the ratios compare the two clients on the same server in the same run. Targets (DESIGN.md):
both ratios (boto3 time / jaxckpt time) >= 0.9, tokens/s on/off >= 0.98.
Writes benchmarks/results/remote.json.
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from benchmarks.common import median, print_table, write_results
from benchmarks.states import get_config, train_state
from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.remote import Store, Uploader, objects

BUCKET = 'bench'
TARGET, TOKENS_TARGET = 0.9, 0.98


class Server:
  """moto's S3 server as a subprocess on a free loopback port."""

  def __init__(self):
    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      self.port = s.getsockname()[1]
    self.endpoint = f'http://127.0.0.1:{self.port}'
    os.environ.update(
        AWS_ENDPOINT_URL=self.endpoint,
        AWS_ACCESS_KEY_ID='bench',
        AWS_SECRET_ACCESS_KEY='bench',
        AWS_REGION='us-east-1')
    # Niced: the server stands for another machine, so it gets only the CPU training leaves.
    self.proc = subprocess.Popen([
        'nice', '-n', '19', sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p',
        str(self.port)
    ],
                                 stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    import boto3
    self.client = boto3.client('s3', endpoint_url=self.endpoint, region_name='us-east-1')
    for _ in range(200):
      try:
        self.client.create_bucket(Bucket=BUCKET)
        return
      except Exception:  # noqa: BLE001 - not listening yet
        time.sleep(0.1)
    raise RuntimeError('the moto server did not start')

  def clear(self) -> None:
    for page in self.client.get_paginator('list_objects_v2').paginate(Bucket=BUCKET):
      for obj in page.get('Contents', []):
        self.client.delete_object(Bucket=BUCKET, Key=obj['Key'])

  def stop(self) -> None:
    self.proc.terminate()
    self.proc.wait()


def jaxckpt_round(state, scratch: Path, url: str) -> dict:
  """save() -> remote commit, then a restore from the remote alone into an empty workdir."""
  store = Store(url)
  uploader = Uploader(store)
  mgr = CheckpointManager(
      scratch / 'ckpt',
      CheckpointOptions(keep=1),
      on_commit=lambda info: uploader.submit(info.step, info.path))
  try:
    start = time.perf_counter()
    mgr.save(1, state, {'step': 1})
    blocked = time.perf_counter() - start
    mgr.wait_until_finished()
    committed = time.perf_counter() - start
    assert uploader.wait(1, timeout=600), uploader.error
    remote = time.perf_counter() - start
  finally:
    uploader.close()
    mgr.close()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  fresh = scratch / 'fresh' / 'ckpt'
  start = time.perf_counter()
  path, _ = objects.download(store, 1, fresh)
  fetched = time.perf_counter() - start
  with CheckpointManager(fresh, CheckpointOptions()) as reader:
    restored, _ = reader.restore(path, abstract)
    jax.block_until_ready(restored)
  restored_s = time.perf_counter() - start
  del restored
  return {
      'blocked_s': blocked, 'local_commit_s': committed, 'remote_commit_s': remote,
      'download_s': fetched, 'restore_s': restored_s,
      'step_dir': scratch / 'ckpt' / layout.step_dirname(1)
  }


def boto3_round(server: Server, step_dir: Path, scratch: Path) -> dict:
  """boto3's upload_file of every file of the checkpoint, then download_file of each."""
  files = [p for p in sorted(step_dir.rglob('*')) if p.is_file()]
  start = time.perf_counter()
  for p in files:
    server.client.upload_file(str(p), BUCKET, f'boto3/{p.relative_to(step_dir)}')
  upload = time.perf_counter() - start
  out = scratch / 'boto3'
  start = time.perf_counter()
  for p in files:
    dest = out / p.relative_to(step_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    server.client.download_file(BUCKET, f'boto3/{p.relative_to(step_dir)}', str(dest))
  download = time.perf_counter() - start
  for p in files:
    if (out / p.relative_to(step_dir)).read_bytes() != p.read_bytes():
      raise AssertionError(f'boto3 round trip changed {p}')
  return {'upload_s': upload, 'download_s': download, 'bytes': sum(p.stat().st_size for p in files)}


def tokens(every: int, steps: int, warmup: int, batch: int, url: str, scratch: str) -> dict:
  """andrea_12m tokens/s with --remote on and off (both checkpointing every `every` steps), in
  alternating pairs; also extrapolated to the default cadence as benchmarks.overhead does: the
  extra cost of a checkpoint with --remote, c = (T_on - T_off) / saves, and tokens/s ratio at
  every N steps = 1 / (1 + c / (N * step time off))."""
  from benchmarks.overhead import make_config, one_run
  default_every = get_config('12m').checkpoint.every
  runs = {}
  for name in ('off', 'on', 'off2', 'on2'):
    config = make_config(batch, warmup + steps, every)
    with config.unlocked():
      config.checkpoint.remote = f'{url}/{name}' if name.startswith('on') else ''
    runs[name] = one_run(config, warmup, scratch)
    print(f'--remote {name}: {runs[name]["tokens_per_s"]:,.0f} tokens/s', file=sys.stderr)
  pairs = []
  for off, on in (('off', 'on'), ('off2', 'on2')):
    a, b = runs[off], runs[on]
    cost = (b['seconds'] - a['seconds']) / max(b['saves'], 1)
    pairs.append({
        'ratio': b['tokens_per_s'] / a['tokens_per_s'], 'cost': cost,
        'at_default': 1 / (1 + max(0.0, cost) / (default_every * a['step_s']))
    })
  at_default = median([p['at_default'] for p in pairs])
  return {
      'tokens_per_s_off': median([runs['off']['tokens_per_s'], runs['off2']['tokens_per_s']]),
      'tokens_per_s_on': median([runs['on']['tokens_per_s'], runs['on2']['tokens_per_s']]
                               ), 'pair_ratios': [p['ratio'] for p in pairs],
      'ratio_measured': median([p['ratio'] for p in pairs]
                              ), 'cost_per_checkpoint_s': median([p['cost'] for p in pairs]),
      'ratio_at_default_cadence': at_default, 'default_every': default_every, 'every': every,
      'batch': batch, 'target': f'>= {TOKENS_TARGET}', 'met': at_default >= TOKENS_TARGET,
      'runs': runs
  }


def transfer_rounds(server: Server, config: str, repeats: int, scratch_root: Path):
  """`repeats` rounds of jaxckpt then boto3 on the trainer's state of `config`."""
  _, state, nbytes = train_state(config)
  rows = []
  for r in range(repeats):
    scratch = scratch_root / f'r{r}'
    ours = jaxckpt_round(state, scratch, f's3://{BUCKET}/jaxckpt-{r}')
    theirs = boto3_round(server, ours.pop('step_dir'), scratch)
    rows.append({
        'repeat': r, **ours, 'boto3_upload_s': theirs['upload_s'],
        'boto3_download_s': theirs['download_s'], 'bytes': theirs['bytes']
    })
    print(
        f'repeat {r}: remote commit {ours["remote_commit_s"]:.2f} s vs boto3 upload '
        f'{theirs["upload_s"]:.2f} s; restore {ours["restore_s"]:.2f} s vs boto3 download '
        f'{theirs["download_s"]:.2f} s',
        file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    server.clear()
  up = median([r['boto3_upload_s'] / r['remote_commit_s'] for r in rows])
  down = median([r['boto3_download_s'] / r['restore_s'] for r in rows])
  return rows, {
      'upload_ratio': up, 'restore_ratio': down, 'target': f'>= {TARGET}',
      'met': up >= TARGET and down >= TARGET, 'state_bytes': nbytes
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='120m')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--tokens', action='store_true', help='also tokens/s with --remote on/off')
  parser.add_argument('--every', type=int, default=15)
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--warmup', type=int, default=10)
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--scratch-root', default='/tmp')
  args = parser.parse_args(argv)
  server = Server()
  scratch_root = Path(tempfile.mkdtemp(prefix='jaxckpt-remote-bench-', dir=args.scratch_root))
  rows, summary = [], {}
  try:
    if args.repeats:
      rows, summary = transfer_rounds(server, args.config, args.repeats, scratch_root)
    if args.tokens:
      summary['tokens'] = tokens(args.every, args.steps, args.warmup, args.batch,
                                 f's3://{BUCKET}/tokens', str(scratch_root))
  finally:
    server.stop()
    shutil.rmtree(scratch_root, ignore_errors=True)
  if rows:
    print(f'{args.config} state, {summary["state_bytes"] / 1e9:.2f} GB, moto S3 server on '
          'loopback')
    print_table(rows)
    print()
    print_table([{k: v for k, v in summary.items() if k != 'tokens'}])
  if 'tokens' in summary:
    print_table([{k: v for k, v in summary['tokens'].items() if k not in ('pair_ratios', 'runs')}])
  path = write_results('remote' if rows else 'remote_tokens', rows,
                       {'config': args.config, 'summary': summary})
  print(f'wrote {path}')


if __name__ == '__main__':
  main()
