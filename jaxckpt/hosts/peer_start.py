"""Where a run on each host's own disk (with `--remote`) starts from: the disks first, then the
peers, the remote for the rest.

Each host's workdir is its own disk; with `--replicas=R` each process also keeps R other
processes' parts beside its own (`jaxckpt.checkpoint.replicas`). At a restart the processes
bring the newest checkpoint they hold between them to what each needs
(`jaxckpt.checkpoint.peers`): a host whose disk was wiped gets its parts from the hosts that
kept replicas of them, over the interconnect, and only parts no living process holds come from
the remote, each read once in the job by one process that needs it. When process 0 holds no
copy of the remote's newest, it takes that checkpoint's own files and the run's records from
the remote first: a job of fresh machines reads each byte of it once between them, not once
per host. Only when nothing is whole that way does every process download the remote's newest.

The `resumed` event says, per process, the bytes that came from its own disk, from its peers
and from the remote (`sources`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from absl import logging

from jaxckpt.checkpoint import CheckpointError, layout, multihost, peers
from jaxckpt.checkpoint.remote import partial
from jaxckpt.errors import ResumeError, UsageError
from jaxckpt.hosts import remote_start
from jaxckpt.records.workdir import checkpoints_dir


def check(replicas: int, *, remote: Any, shared: bool, count: int, workdir: Path, part_bytes: int,
          keep: int) -> None:
  """E-CONFIG-010 (exit 2) for `--replicas` a job cannot hold, before anything is written;
  on a RAM disk (`/dev/shm`), `--keep=0` (memory would fill), and parts kept that would not fit
  in the memory available or the mount's own size, less what its checkpoints hold already."""
  if replicas <= 0:
    return
  fix = ('use --replicas=0, or one process per host, each with --workdir on its own disk, '
         'and --remote')
  if count < 2 or shared or remote is None:
    why = ('one process' if count < 2 else 'a workdir every process shares'
           if shared else 'no --remote (the tier that holds what no peer does)')
    raise UsageError('E-CONFIG-010', f'--replicas={replicas} with {why}', fix)
  if replicas >= count:
    raise UsageError(
        'E-CONFIG-010', f'--replicas={replicas} with {count} processes: each part would need '
        f'{replicas} other hosts to keep it and there are {count - 1}',
        f'use --replicas between 1 and {count - 1}')
  if not _on_ram(workdir):
    return
  each = f'{replicas + 1} parts of {part_bytes / 1e6:.0f} MB'
  if keep == 0:
    raise UsageError(
        'E-CONFIG-010', f'--workdir={workdir} is in memory and --keep=0 keeps every '
        f'checkpoint: {each} per host for each one, until memory is full',
        'set --keep (each checkpoint kept costs that), or use a workdir on disk')
  kept = (replicas + 1) * part_bytes * (keep + 1)  # the checkpoints kept + one being saved
  # In memory already: the newest `keep` checkpoints, which the run rotates out as it saves
  # (others, held by --keep_every or --keep_best, stay beside what this needs).
  newest = sorted(layout.committed_steps(checkpoints_dir(workdir)).items())[-keep:]
  there = min(kept, sum(_bytes_under(path) for _, path in newest))
  room = {
      'memory available': _mem_available(), 'free in its mount (tmpfs size=)': _mount_free(workdir)
  }
  limit = min(((v, k) for k, v in room.items() if v is not None), default=None)
  if limit is not None and kept - there > limit[0]:
    raise UsageError(
        'E-CONFIG-010', f'--workdir={workdir} is in memory: {each} for each of {keep + 1} '
        f'checkpoints need {kept / 1e9:.2f} GB ({there / 1e9:.2f} GB of it there already) '
        f'and {limit[0] / 1e9:.2f} GB more is {limit[1]}',
        'use a smaller --keep or --replicas, a larger RAM disk, or a workdir on disk')


def resume_point(run, ckpt_dir: Path, target: Any, timeout_secs: float) -> Path | None:
  """The checkpoint this process restores from (None: a fresh start); sets `run.restored`
  ({'step', 'processes': [{'own', 'peers', 'remote'}, ...]} on process 0) when the peers
  supplied it."""
  t0 = time.monotonic()
  group = multihost.Group(timeout_secs)

  def take(step: int, records: dict[str, bytes]) -> None:  # the remote's newest is the one taken
    run.fetched = remote_start.fetched(run, step, 0, 0.0,
                                       *remote_start.take_records(run, step, records))

  # Process 0 decides what the remote holds; any process may be the one to read a part of it.
  remote = partial.peer_source(run.store, run.start_step, inspect=run.leader, on_records=take)
  try:
    got = peers.restore_dir(ckpt_dir, target, group, remote, run.replicas)
  except CheckpointError as e:
    if e.code == 'E-RESUME-004':  # the hosts' checkpoints, none whole: never a fresh start
      raise ResumeError(e.code, e.what, e.fix) from None
    if e.code != 'E-CKPT-016' or run.start_step is None:
      raise  # with nothing in the remote to fall back to, the hosts' checkpoints stay theirs
    logging.warning("%s; every host downloads the remote's newest intact checkpoint", e.line())
    got = None  # every process raised it together: they fall back together
  if got is None:  # nothing whole between the peers and the remote's parts: its newest, whole,
    run.sync_down(ckpt_dir, fetch=True, local_too=False)  # on every host
    return run.resume_point(ckpt_dir)
  seconds = round(time.monotonic() - t0, 3)
  if run.fetched is not None and run.fetched['step'] == got.step:
    run.fetched.update(bytes=got.sources['remote'], seconds=seconds)
  every = group.collect(
      'peers/sources', 'a restore from the peers', json.dumps(got.sources), strict=False)
  mb = {k: f'{v / 1e6:.1f}' for k, v in got.sources.items()}
  logging.info(
      'step %d from the peer tier in %.1f s: %s MB from this disk, %s MB from peers, '
      '%s MB from %s', got.step, seconds, mb['own'], mb['peers'], mb['remote'], run.store.url)
  processes = None if every is None else _process_sources(every, group.count)
  if processes is not None:
    run.restored = {'step': got.step, 'seconds': seconds, 'processes': processes}
  return got.path


_SOURCES = ('own', 'peers', 'remote')


def _process_sources(every: list[str], count: int) -> list[dict[str, int]] | None:
  """Each process's {'own', 'peers', 'remote'} bytes from what the processes posted (`every`,
  in process order); None, with one warning, when that is not `count` of them, each a JSON
  object of non-negative integers: the `resumed` event then goes without them."""
  processes, bad = [], None
  if len(every) != count:
    bad = f'{len(every)} value(s) posted by {count} processes'
  for k, raw in enumerate(every if bad is None else []):
    try:
      value = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
      value = None
    if not (isinstance(value, dict)
            and all(type(value.get(name)) is int and value[name] >= 0 for name in _SOURCES)):
      bad = f'process {k} posted {str(raw)[:80]!r}'
      break
    processes.append({name: value[name] for name in _SOURCES})
  if bad is not None:
    logging.warning(
        "the 'resumed' event goes without each process's sources (bytes from its disk, peers "
        'and remote): %s (each posts {"own": N, "peers": N, "remote": N}, N >= 0)', bad)
    return None
  return processes


def _on_ram(path: Path) -> bool:
  """Whether `path` is on tmpfs or ramfs (the local tier then costs host memory)."""
  best, kind = '', ''
  try:
    where = str(path.resolve())
    with open('/proc/mounts', encoding='utf-8') as f:
      for line in f:
        fields = line.split()
        mount = fields[1]
        under = where == mount or where.startswith(mount.rstrip('/') + '/')
        if under and len(mount) >= len(best):  # the last of those at one path covers the others
          best, kind = mount, fields[2]
  except (OSError, RuntimeError):
    return False
  return kind in ('tmpfs', 'ramfs')


def _bytes_under(path: Path) -> int:
  """The bytes of the files under `path` (0 where there is none)."""
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.lstat(os.path.join(root, name)).st_size
      except OSError:
        pass
  return total


def _mount_free(path: Path) -> int | None:
  """The bytes free in the filesystem of `path` (or its nearest existing parent): a tmpfs
  mount's own `size=` bounds it below the memory."""
  for where in (path, *path.parents):
    try:
      st = os.statvfs(where)
    except OSError:
      continue
    return st.f_bavail * st.f_frsize
  return None


def _mem_available() -> int | None:
  try:
    with open('/proc/meminfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


__all__ = ['check', 'resume_point']
