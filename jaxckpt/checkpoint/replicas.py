"""Replicas of other processes' parts: the peer tier of a checkpoint on each host's own disk.

With `CheckpointOptions(replicas=R)`, process k keeps, beside its own part of every checkpoint
(`state/process_k.safetensors`), the parts of the R processes before it on a ring over the
processes (k-1, ..., k-R, modulo the count), under their own names. With one process per host
(the own-disk mode's rule; `multihost.Group.open` checks that no two processes share the
directory, not that two directories are on two machines) a replica is on another host, and a
host lost with its disk leaves each of its parts on R others.

The bytes move over the job's interconnect as JAX moves arrays: at `save`, each array is put on
the sharding whose devices are those of the same mesh shifted by r processes
(`jax.device_put`, dispatched on the caller's thread in program order with the train steps, as
any collective must be). Where the shard is already on the receiving devices (a replicated
parameter: the data-parallel case) none of it needs to cross the interconnect (whether XLA still
copies it on the device is not measured yet); where it is not, XLA sends it (NCCL, ICI, gloo on
CPU). The writer then writes process k-r's file from those shards exactly as k-r writes
it (the same tensors, order and header), and keeps it only when its size and CRC-32 equal the
ones k-r posted: a replica is byte-identical to the part it copies, or it is not kept.

The cost: R more parts of device memory while the save is in flight (until the writer has
copied them to host memory) and R more parts on each host's disk per checkpoint kept.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from . import bounded, multihost, statefile
from .errors import ArgumentError, CheckpointError

log = logging.getLogger(__name__)


def kept_by(index: int, count: int, replicas: int) -> list[int]:
  """The processes whose parts process `index` keeps a replica of (the R before it)."""
  return [(index - r) % count for r in range(1, replicas + 1)]


def holders(index: int, count: int, replicas: int) -> list[int]:
  """The processes that keep a replica of process `index`'s part (the R after it)."""
  return [(index + r) % count for r in range(1, replicas + 1)]


def check(replicas: int, count: int, shared: bool, storage: str = 'safetensors') -> None:
  """E-CONFIG-010 for a replica count this job cannot hold (one process, a shared directory,
  as many as the processes, or orbax's files, which hold no parts to copy)."""
  if replicas <= 0:
    return
  if storage != 'safetensors':
    raise ArgumentError(
        'E-CONFIG-010', f'replicas={replicas} with storage={storage!r}: only '
        'safetensors parts are copied to peers', "use storage='safetensors'")
  if shared or count < 2:
    raise ArgumentError(
        'E-CONFIG-010', f'replicas={replicas} needs several processes, each with its own disk '
        f'(this job: {count} process(es), {"one shared" if shared else "own"} directory)',
        "use replicas=0, or one process per host with a workdir on each host's own disk")
  if replicas >= count:
    raise ArgumentError(
        'E-CONFIG-010', f'replicas={replicas} with {count} processes: each part would need '
        f'{replicas} other hosts to hold it and there are {count - 1}',
        f'use replicas between 1 and {count - 1}')


@functools.lru_cache(maxsize=256)
def shifted(sharding: NamedSharding, shift: int) -> NamedSharding:
  """`sharding` on the devices of the process `shift` after each device's own, same local
  place: an array put on it has, on process k+shift's devices, what process k's devices hold."""
  if not isinstance(sharding, NamedSharding):
    raise CheckpointError(
        'E-CKPT-015', f'replicas need NamedSharding arrays; found a {type(sharding).__name__}',
        'give every array of the state a NamedSharding over the global mesh, or use replicas=0')
  by_process: dict[int, list] = {}
  for d in sorted(jax.devices(), key=lambda d: d.id):
    by_process.setdefault(d.process_index, []).append(d)
  count = len(by_process)
  if len({len(v) for v in by_process.values()}) != 1:
    raise CheckpointError(
        'E-CKPT-015', 'replicas need the same number of devices on every process '
        f'(found {sorted({p: len(v) for p, v in by_process.items()}.items())})',
        'use replicas=0, or as many devices on each host')
  move = {
      d: by_process[(p + shift) % count][i] for p, ds in by_process.items() for i, d in enumerate(ds)
  }
  mesh = sharding.mesh
  devices = np.vectorize(move.__getitem__, otypes=[object])(mesh.devices)
  return NamedSharding(
      Mesh(devices, mesh.axis_names), sharding.spec, memory_kind=sharding.memory_kind)


def dispatch(leaves: Mapping[str, Any], replicas: int) -> list[tuple[int, dict, dict]]:
  """On the caller's thread, at `save`: [(process, parts, places)] of the parts this process
  keeps, their shards being moved onto its devices (asynchronously: the writer waits for them)."""
  me, count = jax.process_index(), jax.process_count()
  # Replicated arrays too: the copies outlive the caller's arrays, which its next step may donate
  # before the writer reads them (a host copy in `save` would do as well, at its blocking cost).
  arrays = [n for n, x in leaves.items() if isinstance(x, jax.Array)]
  out = []
  for r, of in enumerate(kept_by(me, count, replicas), start=1):
    moved = jax.device_put([leaves[n] for n in arrays],
                           [shifted(leaves[n].sharding, r) for n in arrays])
    parts, places = multihost.owned_parts(
        leaves, of=of, moved={**leaves, **dict(zip(arrays, moved))})
    out.append((of, parts, places))
  return out


def write(state_dir: Path, copies: list[tuple[int, dict, dict]]) -> dict[str, dict[str, Any]]:
  """Writes each replica's file under `state_dir` (fsynced); {relative path: {size, crc32}}."""
  written = {}
  for of, parts, places in copies:
    name = statefile.file_name(of)
    bounded.ready(parts.items(), f"the replica of process {of}'s part")  # the move, bounded
    host = {t: np.asarray(x) for t, x in parts.items()}
    files, _ = statefile.write(
        state_dir, host, name=name, metadata=multihost.header_metadata(places))
    written[f'{state_dir.name}/{name}'] = files[name]
    del host
  return written


def keep_matching(step_dir: Path, written: Mapping[str, Mapping[str, Any]],
                  files: Mapping[str, Mapping[str, Any]]) -> list[str]:
  """Removes each replica whose size or CRC is not its owner's (`files`, every process's
  posted record); returns the ones kept. A mismatch is a warning: the owner's part stands."""
  kept = []
  for rel, got in written.items():
    want = files.get(rel)
    if want is not None and got['size'] == want['size'] and got['crc32'] == want['crc32']:
      kept.append(rel)
      continue
    log.warning("replica %s of %s differs from its owner's part (%s, owner: %s): not kept", rel,
                step_dir.name, got, want)
    try:
      os.unlink(step_dir / rel)
    except FileNotFoundError:
      pass
  return kept


def confirmed(posted: list[Any], files: Mapping[str, Mapping[str, Any]]) -> int:
  """Process 0: the fewest replicas any process's part has in the job, counting each that
  its holder posted (`posted`: each process's {file: {size, crc32}}, or None) with the owner's
  size and CRC-32 (`files`, the job's). 0: some part is on its owner's disk alone."""
  parts = {rel: 0 for rel in files}  # every process's state file (before the shard table)
  for held in posted:
    for rel, got in (held if isinstance(held, dict) else {}).items():
      want = files.get(rel)
      if rel in parts and isinstance(got, dict) and want is not None and \
          (got.get('size'), got.get('crc32')) == (want['size'], want['crc32']):
        parts[rel] += 1
  return min(parts.values(), default=0)


__all__ = [
    'check', 'confirmed', 'dispatch', 'holders', 'keep_matching', 'kept_by', 'shifted', 'write'
]
