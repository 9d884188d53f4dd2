"""Who sends which part to whom in a restore from the peers: process 0's plan, and each
process's reading of it.

Process 0 builds the plan (`build`) and every process fetches it whole from the key-value store
of the job's coordinator, so its size is what each process pays, and N times that what the
coordinator pays. Every process must see every move (each computes the same rounds from them),
but nothing in the plan is listed once per pair of processes: a part's receivers are runs of
process indices (`spans`), and what each process reads of its own disk is one number per
process. Where every process needs every part (replicated arrays, the data-parallel case) and
one host comes back empty, the plan is O(N) bytes where lists of receivers made it O(N²): at
1024 hosts 193 KB, where it was 39.8 MB (`benchmarks/peer_plan.py`).

A plan: {'step', 'seal', 'files': {part: {size, crc32}} of the parts that move, 'moves',
'held': [bytes each process reads of the parts it holds], and the checkpoint's own files:
'meta' sizes, 'own' entries, 'from' whom, 'meta_to' (spans) whom}. Each move is [part, sender,
read from the remote first (0 or 1), receivers (spans), groups]; a group is [receivers (spans),
tensors]: those receivers get those tensors of the part alone (a subset), or with tensors None
the whole part, several receivers at once.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import holdings, layout, manifest, multihost, sends, shardtable, statefile
from .formats import data_file
from .replicas import holders as holders_of
from .tree import named_leaves

Spans = list  # [[first, past the last], ...] of process indices, ascending


def spans(ks: Iterable[int]) -> Spans:
  """`ks` as runs of consecutive indices: [0, 2, 3, 4, 9] is [[0, 1], [2, 5], [9, 10]]."""
  out: Spans = []
  for k in sorted(set(ks)):
    if out and out[-1][1] == k:
      out[-1][1] = k + 1
    else:
      out.append([k, k + 1])
  return out


def members(runs: Spans) -> list[int]:
  """The indices of `spans`' runs, ascending."""
  return [k for lo, hi in runs for k in range(lo, hi)]


def build(ckpt_dir: Path, step: int, intact: list[list[str]], target: Any, count: int,
          remote_has_it: bool, replicas: int) -> dict[str, Any] | None:
  """Process 0: the plan (see the module's docstring) that brings every process what its
  devices need of `target` from checkpoint `step`, where process k holds `intact[k]` of its
  files intact; None when a part (or an own file) is held intact by no process and not by the
  remote (`remote_has_it`: the remote's newest is this very commit)."""
  path = ckpt_dir / layout.step_dirname(step)
  raw = (path / layout.MANIFEST).read_bytes()
  m = manifest.parse(path, raw)
  whole = holdings.own_files(m)
  # Each of the checkpoint's own files is sent from a process that holds it intact (process 0
  # first: its disk always holds the shard table), the manifest from process 0.
  senders = {name: [k for k in range(count) if name in intact[k]] for name in whole}
  if not all(senders.values()):
    return None
  table = shardtable.shard_table(path, m, data_file(m))
  wanted = multihost.needed_shards(table, named_leaves(target), count)
  tensors_in = table.tensors_in()
  held = [set(names) for names in intact]
  dtypes = {r['name']: r['dtype'] for r in m['tensors']}
  moves, load = [], [0] * count  # the bytes each process reads from the remote
  for rel in holdings.parts(m):
    holders = [k for k in range(count) if rel in held[k]]
    receivers = [k for k in range(count) if rel in wanted[k] and rel not in held[k]]
    if not receivers:
      continue
    if not holders and not remote_has_it:
      return None
    own = _owner(rel)  # the part's own process sends it first
    # One that no process holds is read from the remote by the receiver that has read least
    # of it so far (its own process first): each byte once in the job, spread over the job.
    source = (own if own in holders else holders[0]) if holders else min(
        receivers, key=lambda k: (load[k], k != own, k))
    if not holders:
      load[source] += m['files'][rel]['size']
    # A receiver that needs a few of its tensors gets those, but the part's owner (process 0
    # for a part of a larger job: it uploads those), its replica keepers and its reader.
    keep = own if 0 <= own < count else 0
    full = {keep, *(holders_of(keep, count, replicas) if keep == own else ())}
    # Those that get the same tensors are listed once with them; so are those that get the whole
    # part, when there are several (tensors None): it goes to them all at once.
    groups: dict[Any, list] = {None: [[], None]}  # by the tensors needed; None: the part
    subsets: dict[tuple[str, ...], list | None] = {}  # by the tensors needed: once each
    keys: dict[int, tuple[str, ...]] = {}  # processes that need alike share one dict of them
    for k in receivers:
      if k == source:
        continue
      need = wanted[k][rel]
      key = keys.get(id(need)) or keys.setdefault(id(need), tuple(sorted(need)))
      if k not in full and key not in subsets:
        subsets[key] = None if len(key) == tensors_in.get(rel) else _subset(
            need, dtypes, m['files'][rel]['size'])  # all of them: the part
      tensors = None if k in full else subsets[key]
      groups.setdefault(None if tensors is None else key, [[], tensors])[0].append(k)
    if len(groups[None][0]) < 2:  # one receiver of the whole part: point to point
      del groups[None]
    moves.append([
        rel, source, 0 if holders else 1,
        spans(k for k in receivers if k != source), [[spans(ks), t] for ks, t in groups.values()]
    ])
  meta = {name: m['files'][name]['size'] for name in whole}
  return {
      'step': step, 'seal': manifest.seal_of(raw),
      'files': {rel: m['files'][rel] for rel, *_ in moves}, 'moves': moves,
      'held': [sum(m['files'][r]['size'] for r in wanted[k] if r in held[k]) for k in range(count)],
      'meta': {**meta, layout.MANIFEST: len(raw)}, 'own': {name: m['files'][name] for name in whole},
      'from': {name: k[0] for name, k in senders.items()
              }, 'meta_to': spans(k for k in range(count) if not set(whole) <= held[k])
  }


@dataclasses.dataclass
class Moves:
  """One process's reading of a plan's moves (every process reads the same)."""
  pairs: list[sends.Pair]  # point to point, in `sends.carry`'s rounds
  subsets: dict[tuple[str, int], sends.Tensors]  # (part, receiver): its tensors alone
  # (part, sender, receivers, tensors: None for the whole part)
  spreads: list[tuple[str, int, list[int], sends.Tensors | None]]
  reads: dict[str, int]  # part: the process that reads it from the remote (its sender)


def moves_of(plan: Mapping[str, Any]) -> Moves:
  """The plan's moves as sends: what several receivers get alike (a subset, or the whole part)
  goes to all of them at once (`spreads.spread`); the rest go point to point."""
  out = Moves([], {}, [], {})
  for rel, source, fetch, receivers, groups in plan['moves']:
    if fetch:
      out.reads[rel] = source
    alike: set[int] = set()
    for runs, tensors in groups:
      ks = members(runs)
      if len(ks) > 1 or tensors is None:
        out.spreads.append((rel, source, ks, tensors))
        alike |= set(ks)
      else:
        out.subsets[rel, ks[0]] = tensors
    out.pairs += [(rel, source, k) for k in members(receivers) if k not in alike]
  return out


def _subset(shards: Mapping[str, Mapping[str, Any]], dtypes: Mapping[str, str],
            size: int) -> list | None:
  """`sends.Tensors` of `shards` ({tensor: shard row}) when they are less than half of a part
  of `size` bytes (each with its CRC-32); None: the part is sent whole."""
  tensors, nbytes = [], 0
  for name, s in sorted(shards.items()):
    code = statefile.CODES.get(dtypes.get(s['array'], ''))
    if code is None or not re.fullmatch(r'[0-9a-f]{8}', str(s.get('crc32'))):
      return None
    tensors.append([name, code, list(s['shape']), s['crc32']])
    nbytes += sends.tensor_bytes(code, s['shape'])
  return tensors if 2 * nbytes < size else None


def _owner(rel: str) -> int:
  try:
    return int(Path(rel).stem.rsplit('_', 1)[1])
  except (IndexError, ValueError):
    return -1


__all__ = ['Moves', 'build', 'members', 'moves_of', 'spans']
