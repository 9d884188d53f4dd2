"""Checkpoints of a job that spans processes (`jax.distributed`): who writes what, one commit.

    step_00000100/state/process_0.safetensors   the shards process 0 owns
    step_00000100/state/process_1.safetensors   the shards process 1 owns, ...

Each shard of the state (one distinct index of a global array) is written once in the whole job,
by one of the processes that hold it: every process computes the same assignment from the
shardings alone. A shard one process holds is its own; one that several hold goes to the least
loaded of them, largest first, so replicated arrays are spread over the processes instead of all
landing on process 0. A tensor in a process's file is
named after its array, with its place when it is a part of it (`params/wte/embedding[0:128,0:64]`);
the file's `__metadata__` (`shard/<tensor>`) and the checkpoint's shard table (`shardtable`)
record the array, the start in the global shape and the CRC-32 of each.

A save: every process writes its file in the same temporary directory (named after the step, so
all agree on it) and fsyncs it, posts what it wrote to the `jax.distributed` key-value store and
waits at a barrier; process 0 then reads every post, writes `manifest.json` (covering every file)
and commits, and the others, having read no one's post, wait for its word. A process that does not arrive within the timeout is named in a
one-line error, and nothing is committed. Where the directory is each host's own disk (not
shared: `Group.open` finds out), every process then commits its own part under the same
manifest, and the checkpoint is whole only where the parts are brought together (the remote
tier). A restore reads, on each process, only the byte ranges of the shards its devices need,
whatever process count and mesh wrote the checkpoint (`boxrestore`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np

from . import atomic, layout, shardgrid, shardtable, traffic
from .boxread import Box
from .boxread import box_of as _box
from .errors import CheckpointError

SHARED_PROBE = '.jaxckpt-shared'  # + '-<token>-<k>': process k's; who sees it shares the directory


def client():
  """The `jax.distributed` client of this process (None without `jax.distributed.initialize`);
  counted once `traffic.count_traffic()` was called."""
  from jax._src.distributed import global_state  # pylint: disable=import-outside-toplevel
  return traffic.counted(global_state.client)


_LOST = "the coordinator's key-value store failed or lost keys: start every process again"


class Group:
  """The processes of one job, as one of them sees them, saving into one checkpoint directory.

  The directory is one filesystem every process sees (`shared`), or each process's own disk
  (each host's part of a checkpoint then stays on that host: the remote tier holds it whole).
  """

  _opened = 0  # groups opened by this process: every process opens them in the same order

  def __init__(self, timeout_secs: float):
    self.index, self.count = jax.process_index(), jax.process_count()
    self.leader = self.index == 0
    self.timeout_secs = timeout_secs
    self.shared = True
    self._client = client()
    if self._client is None:
      raise CheckpointError('E-DIST-001', f'{self.count} processes but no jax.distributed client',
                            'call jax.distributed.initialize() before opening a manager')
    self.prefix = f'jaxckpt/group/{Group._opened}'
    Group._opened += 1

  def open(self, directory: Path, tidy: Callable[[], Any] = lambda: None) -> bool:
    """Learn whether every process sees `directory` as one filesystem (`shared`) or each its own
    disk: each process leaves a token file there and says whose it sees. `tidy()` (removing a
    crashed writer's debris) runs where each part lives before anyone writes: on process 0 alone
    when the directory is shared, on every process when it is not. Processes that share it in
    groups (several per host, one disk per host) are refused: E-DIST-007."""
    what = f'opening {directory}'
    directory.mkdir(parents=True, exist_ok=True)
    if self.leader:
      tidy()
      token = f'{os.getpid()}-{os.urandom(8).hex()}'
      self.announce('probe', token)
    else:
      token = self.await_word('probe', what)
    # This open's token is in each probe's name: one listing tells whose probes a process sees,
    # with no file read (a shared filesystem would otherwise serve N reads to each process).
    mine = directory / f'{SHARED_PROBE}-{token}-{self.index}'
    atomic.write_file_durably(mine, b'')
    self.collect('probed', what, '')
    names = set(os.listdir(directory))
    seen = [k for k in range(self.count) if f'{SHARED_PROBE}-{token}-{k}' in names]
    # Each says it in a word ('all', 'self') or, when neither, the list; process 0 alone reads
    # them and says what it makes of them: one word to the others.
    alone = seen == [self.index]
    said = 'all' if len(seen) == self.count else 'self' if alone else json.dumps(seen)
    views = self.collect('seen', what, said)
    if self.leader:
      verdict = 'shared' if all(v == 'all' for v in views) else 'own'
      if verdict == 'own' and any(v != 'self' for v in views):
        odd = {k: v if v == 'all' else json.loads(v) for k, v in enumerate(views) if v != 'self'}
        verdict = f'{directory} is shared by some of the {self.count} processes and not by ' \
            f'others (processes that see more than their own files: {odd})'
      self.announce('seen', verdict)
    else:
      verdict = self.await_word('seen', what)
    mine.unlink(missing_ok=True)
    for name in names:  # an earlier open's, cut short (everyone has listed by now)
      if name.startswith(f'{SHARED_PROBE}-') and token not in name:
        (directory / name).unlink(missing_ok=True)
    self.shared = verdict == 'shared'
    if verdict not in ('shared', 'own'):
      raise CheckpointError(
          'E-DIST-007', verdict, 'use a filesystem every process mounts, '
          'or one process per host, each with its own disk')
    if not self.shared and not self.leader:
      tidy()  # this process's own disk
    return self.shared

  def temporary_dir(self, root: Path, step: int) -> Path:
    """The name every process writes its part under: the same on all, from the step alone."""
    return root / f'{layout.step_dirname(step)}.tmp-{step:012x}'

  def sync(self, name: str, what: str, payload: str = '', **kw: Any) -> list[str]:
    """Post `payload`, wait until every process has posted its own, and return them all (in
    process order). E-DIST-002 names the processes that did not arrive within the timeout.
    Every process reads every payload: for small ones, or where each needs them all. `kw`:
    `collect`'s `timeout_secs` and `fix`."""
    return self.collect(name, what, payload, everyone=True, **kw)

  def collect(self,
              name: str,
              what: str,
              payload: str,
              *,
              everyone: bool = False,
              timeout_secs: float | None = None,
              fix: str = 'they stopped, were lost or are far behind; nothing was committed',
              read: bool = True,
              strict: bool = True):
    """Post `payload` and wait until every process has posted its own: process 0 (every process
    when `everyone`) gets them all, in process order; the others None, having read nothing but
    the barrier's answer (their cost stays flat in the process count). E-DIST-002, on every
    process, names the processes that did not arrive within the timeout (the group's, or
    `timeout_secs` for a wait sized by the work before it), and `fix`. `read=False`: a barrier
    alone (nothing posted, nothing read, None on every process). A process that reads them and
    finds some not there raises E-DIST-002 naming whose (never a list of fewer, in which each
    would be taken for another process's); `strict=False`: it gets None for each instead."""
    timeout_secs = self.timeout_secs if timeout_secs is None else timeout_secs
    if read:
      self._client.key_value_set(
          f'{self.prefix}/{name}/part/{self.index}', payload, allow_overwrite=True)
    self._client.key_value_set(f'{self.prefix}/{name}/here/{self.index}', '', allow_overwrite=True)
    try:
      self._client.wait_at_barrier(f'{self.prefix}/{name}', int(timeout_secs * 1000))
    except Exception as e:  # pylint: disable=broad-except  # the runtime's own error types
      here: dict[int, str] = {}
      with contextlib.suppress(Exception):  # the runtime's own error types: named as unknown
        here = self._posted(name, 'here')
      late = sorted(set(range(self.count)) - set(here))
      raise CheckpointError(
          'E-DIST-002', f'{what}: process(es) {late or "?"} of {self.count} did not arrive '
          f'within {timeout_secs:g} s ({" ".join(str(e).split())[:160]})', fix) from None
    if not read or not (everyone or self.leader):
      return None
    try:
      posted = self._posted(name, 'part')
    except Exception as e:  # pylint: disable=broad-except  # the runtime's own error types
      if strict:
        raise CheckpointError(
            'E-DIST-002', f'{what}: every process arrived, but reading their words from the '
            f'key-value store failed ({" ".join(str(e).split())[:160]})', _LOST) from None
      posted = {}
    missing = sorted(set(range(self.count)) - set(posted))
    if missing and strict:  # every process posted before the barrier: the store lost some
      more = f' and {len(missing) - 20} more' if len(missing) > 20 else ''
      raise CheckpointError(
          'E-DIST-002', f"{what}: every process arrived, but the key-value store's answer "
          f'lacks the word(s) of process(es) {missing[:20]}{more} of {self.count}', _LOST)
    return [posted.get(k) for k in range(self.count)]

  def _posted(self, name: str, kind: str) -> dict[int, str]:
    """{process: what it posted} of `kind` at `name`, as the store answers (its errors raised)."""
    found = self._client.key_value_dir_get(f'{self.prefix}/{name}/{kind}/')
    return {int(k.rsplit('/', 1)[1]): v for k, v in found}

  def announce(self, name: str, word: str) -> None:
    self._client.key_value_set(f'{self.prefix}/{name}/word', word, allow_overwrite=True)

  def await_word(self,
                 name: str,
                 what: str,
                 fix: str = 'process 0 stopped or was lost; nothing was committed') -> str:
    """Process 0's word on `name` (its commit: 'ok' or the error); E-DIST-002 past the timeout,
    with `fix`. Where process 0 said its work on `name` takes longer (`allow`), the wait goes
    on that much more."""
    key, waited = f'{self.prefix}/{name}/word', self.timeout_secs
    try:
      return self._client.blocking_key_value_get(key, int(waited * 1000))
    except Exception as e:  # pylint: disable=broad-except
      why = ' '.join(str(e).split())[:160]
    more = self._allowed(name)
    if more is not None:
      try:
        return self._client.blocking_key_value_get(key, max(1, int(more * 1000)))
      except Exception as e:  # pylint: disable=broad-except
        waited, why = waited + more, ' '.join(str(e).split())[:160]
    said = '' if more is None else (
        f": the group's {self.timeout_secs:g} s and the {more:g} s more it said it needs")
    raise CheckpointError('E-DIST-002',
                          f'{what}: no word from process 0 within {waited:g} s{said} ({why})',
                          fix) from None

  def allow(self, name: str, seconds: float) -> None:
    """Process 0, before work on `name` that may outlast the group's timeout: the others wait
    `seconds` more for its word (sized by that work)."""
    self._client.key_value_set(
        f'{self.prefix}/{name}/allow', f'{seconds:.3f}', allow_overwrite=True)

  def _allowed(self, name: str) -> float | None:
    try:
      seconds = float(self._client.key_value_try_get(f'{self.prefix}/{name}/allow'))
    except Exception:  # pylint: disable=broad-except  # not said, or not a number
      return None
    return seconds if 0 < seconds < float('inf') else None

  def forget(self, name: str) -> None:
    """Drop the keys of a finished exchange (every process has read them)."""
    try:
      self._client.key_value_delete(f'{self.prefix}/{name}/')
    except Exception:  # pylint: disable=broad-except  # only memory in the coordinator
      pass


# ------------------------------------------------------------------------------- ownership
def refuse_process_local(leaves: Mapping[str, Any]) -> None:
  """E-DIST-011 for a jax.Array that lives on this process's devices alone (a SingleDeviceSharding
  array, a pmap result): each process holds its own value under the one name, so each would
  write its copy as the array's one shard and no restore could tell which is the array."""
  for name, x in leaves.items():
    if isinstance(x, jax.Array) and x.is_fully_addressable:
      raise CheckpointError(
          'E-DIST-011', f"{name} lives on process {jax.process_index()}'s devices alone "
          f'({type(x.sharding).__name__}) in a save across {jax.process_count()} processes',
          'give it a sharding over the whole job (a jit '
          'out_shardings or jax.device_put with a NamedSharding of the global mesh), make it a '
          'host value (np.asarray) every process has, or leave it out (save(exclude=...))')


tensor_name = shardgrid.tensor_name


@functools.lru_cache(maxsize=4096)
def box_holders(sharding: Any, shape: tuple[int, ...]) -> tuple[tuple[Box, tuple[int, ...]], ...]:
  """((box, the processes whose devices hold it, ascending), ...) for an array of `shape` laid
  out by `sharding` over the whole job, each distinct box once. It walks every device of the
  job: computed once per sharding and shape (the layers of a model share a few), not once per
  leaf, which at 1000 hosts of 8 devices and a 70B model's 2,891 leaves is 23 million boxes."""
  boxes: dict[Box, set[int]] = {}
  for device, index in sharding.devices_indices_map(shape).items():
    boxes.setdefault(_box(index, shape), set()).add(device.process_index)
  return tuple((box, tuple(sorted(ks))) for box, ks in boxes.items())


@functools.lru_cache(maxsize=4096)
def _held(sharding: Any, shape: tuple[int, ...], itemsize: int) -> tuple[dict, dict, tuple]:
  """An array's boxes by who holds them: ({process: the boxes it alone holds}, {process: their
  bytes}, ((box, its holders), ...) of the boxes several processes hold)."""
  alone: dict[int, list[Box]] = {}
  nbytes: dict[int, int] = {}
  shared = []
  for box, holders in box_holders(sharding, shape):
    if len(holders) > 1:
      shared.append((box, holders))
      continue
    alone.setdefault(holders[0], []).append(box)
    nbytes[holders[0]] = nbytes.get(holders[0], 0) + math.prod(b - a for a, b in box) * itemsize
  return {k: tuple(v) for k, v in alone.items()}, nbytes, tuple(shared)


@functools.lru_cache(maxsize=8)
def _owned(key, count: int, me: int) -> tuple[tuple[int, Box], ...]:
  """((leaf number, box), ...) of the shards process `me` writes, of leaves described by `key`:
  every process works out the same from the shardings alone. A box one process holds is its
  own; one that several hold goes to the least loaded of them, largest first. The work is per
  distinct layout and per box several processes hold: a fully sharded 70B model on 1024 hosts
  of 8 devices has 23.7 million shards, each held by one process, and 2,891 leaves in a few
  layouts."""
  load = [0] * count
  shared, layouts = [], collections.Counter()
  for i, (_, shape, itemsize, sharding) in enumerate(key):
    if sharding is None:  # a host value every process has
      shared.append((math.prod(shape) * itemsize, i, tuple((0, n) for n in shape), range(count)))
      continue
    layouts[sharding, shape, itemsize] += 1
    shared += [(math.prod(b - a
                          for a, b in box) * itemsize, i, box, holders)
               for box, holders in _held(sharding, shape, itemsize)[2]]
  for laid, leaves in layouts.items():
    for k, nbytes in _held(*laid)[1].items():
      load[k] += leaves * nbytes
  mine = [(i, box) for i, (_, shape, itemsize, sharding) in enumerate(key) if sharding is not None
          for box in _held(sharding, shape, itemsize)[0].get(me, ())]
  for nbytes, i, box, holders in sorted(shared, key=lambda t: (-t[0], t[1], t[2])):
    owner = min(holders, key=lambda p: (load[p], p))
    load[owner] += nbytes
    if owner == me:
      mine.append((i, box))
  return tuple(mine)


def _key(leaves: Mapping[str, Any]) -> tuple:
  return tuple((n, tuple(np.shape(x)), np.dtype(x.dtype).itemsize,
                x.sharding if isinstance(x, jax.Array) else None) for n, x in leaves.items())


def grid(leaves: Mapping[str, Any]) -> shardgrid.Grid | None:
  """The cells of every leaf's shards when each is an even split (any `jax.sharding`'s); None
  when one is not. Every process computes the same from the shardings alone."""
  return _grid(_key(leaves))


@functools.lru_cache(maxsize=8)
def _grid(key) -> shardgrid.Grid | None:
  arrays = []
  for name, shape, _, sharding in key:
    if sharding is None:  # a host value every process has: one cell
      parts = [1] * len(shape)
    else:
      parts = _parts(sharding, shape)
      if parts is None:
        return None
    arrays.append((name, shape, parts))
  return shardgrid.Grid(arrays)


@functools.lru_cache(maxsize=4096)
def _parts(sharding: Any, shape: tuple[int, ...]) -> tuple[int, ...] | None:
  parts = shardgrid.parts_of((box for box, _ in box_holders(sharding, shape)), shape)
  return None if parts is None else tuple(parts)


def owned_parts(leaves: Mapping[str, Any],
                *,
                of: int | None = None,
                moved: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, dict]]:
  """(parts, places): the shards this process writes (process `of`'s, taken from the same
  arrays moved onto this process's devices, `moved`: a replica), as {tensor name: single-device
  array or host array}, and {tensor name: {'array', 'start', 'global_shape'}}."""
  key = _key(leaves)
  me = jax.process_index() if of is None else of
  parts, places = {}, {}
  for i, box in _owned(key, jax.process_count(), me):
    name, x = key[i][0], (moved or leaves)[key[i][0]]
    shape = tuple(np.shape(x))
    if isinstance(x, jax.Array):
      data = next(s.data for s in x.addressable_shards if _box(s.index, shape) == box)
    else:
      data = np.asarray(x)
    tensor = tensor_name(name, box, shape)
    parts[tensor] = data
    places[tensor] = {'array': name, 'start': [a for a, _ in box], 'global_shape': list(shape)}
  order = {n: i for i, n in enumerate(leaves)}  # file plan and manifest follow the leaf order
  ranked = sorted(parts, key=lambda t: (order[places[t]['array']], places[t]['start']))
  return {t: parts[t] for t in ranked}, {t: places[t] for t in ranked}


def header_metadata(places: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
  return {f'shard/{t}': json.dumps(p, separators=(',', ':')) for t, p in places.items()}


# ------------------------------------------------------------------------------- reading
def state_files(meta: Mapping[str, Any]) -> list[str]:
  return list(meta.get('state_files') or [])


def needed_files(shards: shardtable.Table,
                 want: Mapping[str, Any],
                 count: int,
                 *,
                 local: bool = False) -> list[set[str]]:
  """For each of `count` processes, the state files holding shards its devices hold of `want`
  ({name: target with shape and sharding}; names the checkpoint does not hold are left out),
  from the checkpoint's shard table (`shardtable.shard_table`). `local`: this process's devices
  alone (the others' sets stay empty)."""
  return [set(files) for files in needed_shards(shards, want, count, local=local)]


def needed_shards(shards: shardtable.Table,
                  want: Mapping[str, Any],
                  count: int,
                  *,
                  local: bool = False) -> list[dict[str, dict[str, dict]]]:
  """For each of `count` processes, {state file: {tensor: its shard (the table's row, with its
  'array')}} of the shards its devices hold of `want`, as `needed_files`. Read only: processes
  that need the same shards (every process, in a data-parallel job) share one dict, built once,
  so the work grows with the distinct boxes, not with the processes times the shards."""
  groups: dict[tuple[int, ...], dict[str, dict[str, dict]]] = {}  # processes: what they need
  for name, x in want.items():
    if name not in shards:
      continue
    shape = tuple(x.shape)
    if local:
      boxes: dict[Box, set[int]] = {}
      for device, index in x.sharding.addressable_devices_indices_map(shape).items():
        boxes.setdefault(_box(index, shape), set()).add(device.process_index)
      holders = [(box, tuple(sorted(ks))) for box, ks in boxes.items()]
    else:
      holders = box_holders(x.sharding, shape)
    for box, processes in holders:
      need = groups.setdefault(processes, {})
      for s in shards.overlapping(name, box):
        need.setdefault(s['file'], {})[s['tensor']] = {**s, 'array': name}
  member: list[list[dict]] = [[] for _ in range(count)]
  for processes, need in groups.items():
    for k in processes:
      member[k].append(need)
  out = []
  for needs in member:  # a process in one group shares its dict; one in several, merged
    merged = needs[0] if len(needs) == 1 else {}
    for need in needs if len(needs) > 1 else ():
      for rel, tensors in need.items():
        merged.setdefault(rel, {}).update(tensors)
    out.append(merged)
  return out


def unread(meta: Mapping[str, Any], want: Mapping[str, Any], shards: shardtable.Table) -> set[str]:
  """The state files a restore of `want` on this process reads nothing from."""
  needed = needed_files(shards, want, jax.process_count(), local=True)
  return set(state_files(meta)) - needed[jax.process_index()]
