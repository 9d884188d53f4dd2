"""A save across processes, between the writes and the commit: who reads what, and the word.

Every process posts its part record (`shardtable.part_record`: its file's size and CRC-32, its
cells) and waits at one barrier; process 0 alone reads the records, files them into
`shards.json`, writes the manifest and commits. Its word to the others is `ok <committed_at>`.

Where each host commits its own part (the directory is each host's own disk), every host's
manifest must be the same bytes as process 0's, and so list every process's file. The word then
also carries the job's file table (each process's state file packed in 16 bytes) and process 0's
retention record (why the step is kept: a replay keeps what the step's earlier commit was kept
for, and each host's disk may hold another commit of it, or none; a process whose earlier commit
kept the step posts its record, and process 0 adds each to its own), and each process
commits its part under that manifest without reading any other process's record: what a
process other than 0 receives stays the word alone, not every process's record (which grows with
every shard of the job). Its disk holds no `shards.json`, as it holds no other process's part: a
restart's peer restore sends it from process 0 with the run state (`peers`), and the remote tier
holds it with the rest.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from . import atomic, layout, multihost, replicas, retention, shardtable, statefile
from .errors import CheckpointError
from .multihost import Group


def write_part(group: Group | None, stager: Any, tmp: Path, step: int, seq: int,
               staged: Mapping[str, Any], region: Any, table: list[dict[str, Any]],
               placed: tuple) -> tuple[dict[str, Any], list[dict[str, Any]], dict, dict, Any]:
  """Writes this process's state file of save `seq` (checkpoint `step`) under `tmp`: ({file:
  {size, crc32}}, the tensor table with CRCs, the replicas it wrote, {file: the `InMemory` the
  upload reads while `stager`'s `region` still holds it}, the job's confirmed replica count on
  process 0 (`post`), else None). Across processes (`group`), process 0 lists every process's
  files and shards, once all of them are durable (`post`)."""
  name = statefile.file_name(0 if group is None else group.index)
  rel, ((places, grid), copies, kept) = f'{layout.STATE_DIR}/{name}', placed
  header = []  # with the region: the file is in memory until the next save stages over it
  written, crcs = statefile.write(
      tmp / layout.STATE_DIR,
      staged,
      region=region,
      name=name,
      metadata=multihost.header_metadata(places),
      on_header=header.append)
  lent = region is not None and stager.lend(header[0], written[name]['size'])
  in_memory = {rel: lent} if lent else {}
  if group is None:
    return ({rel: written[name]}, [{**row, 'crc32': crcs[row['name']]} for row in table], {},
            in_memory, None)
  held = replicas.write(tmp / layout.STATE_DIR, copies)  # before the barrier: in the commit
  atomic.fsync_dir(tmp / layout.STATE_DIR)  # their names are durable too
  record = shardtable.part_record(rel, written[name], crcs, places,
                                  {t: np.shape(x) for t, x in staged.items()}, grid)
  # Process 0 alone reads every part record and lists every file; the others, their own.
  files, copies = post(group, tmp, seq, step, record, held, grid, kept) or \
      ({rel: {k: written[name][k] for k in ('size', 'crc32')}}, None)
  return files, table, held, in_memory, copies


def post(group: Group,
         tmp: Path,
         seq: int,
         step: int,
         record: str,
         held: Mapping[str, Any],
         grid: Any,
         kept: dict[str, Any] | None = None) -> tuple[dict[str, dict[str, Any]], Any] | None:
  """Posts this process's part record and waits for every other's. Process 0: (the job's files
  ({file: {size, crc32}}), `shards.json` written into `tmp` and listed, and the replicas it keeps
  matched against their owners'; the job's replica count, `copies`); the others: None (their
  files come with process 0's word). A process's record names the replicas it wrote (`held`),
  by size and CRC-32, so that process 0 knows how many the job holds of each part.

  On each host's own disk a process's retention record `kept` goes with its part record when it
  keeps the step for anything (a replay of a step its disk held), and process 0 adds each to its
  own: the manifest keeps the step for whatever any host's earlier commit kept it for."""
  extra = {'kept': kept} if kept and kept.get('kept') and not group.shared else {}
  if held:
    extra['replicas'] = {rel: {k: f[k] for k in ('size', 'crc32')} for rel, f in held.items()}
  if extra:
    head, _, rest = record.partition('\n')
    record = json.dumps({**json.loads(head), **extra}, separators=(',', ':')) + '\n' + rest
  records = group.collect(f'{seq}/durable', f'checkpoint step {step}', record)
  if records is None:
    return None
  heads = [json.loads(r.partition('\n')[0]) for r in records]  # each read once, here
  if kept is not None and not group.shared:
    for head in heads:
      retention.merge(kept, head.get('kept'))
  files, shards = shardtable.merge_records(records, expect=group.count, grid=grid)
  replicas.keep_matching(tmp, held, files)
  posted = [head.get('replicas') for head in heads]
  copies = replicas.confirmed(posted, files) if any(posted) else None
  files[shardtable.SHARDS] = shardtable.write(tmp / shardtable.SHARDS, shards)
  return files, copies


def listing(metadata: Mapping[str, Any], files: Mapping[str, Any], storage: str,
            across: bool) -> dict[str, Any]:
  """`metadata` with the job's state files and its shard table named, for the manifest of a
  save `across` processes in safetensors files (`files`: every process's); else as it is."""
  if storage != 'safetensors' or not across:
    return dict(metadata)
  return {
      **metadata, 'state_files': sorted(k for k in files if k != shardtable.SHARDS),
      shardtable.KEY: shardtable.SHARDS
  }


_PART = np.dtype([('size', '<u8'), ('crc32', '<u4')])  # a state file in the word: 12 bytes


def word(committed_at: float,
         files: Mapping[str, Any] | None,
         count: int = 0,
         retention: Mapping[str, Any] | None = None,
         copies: int | None = None) -> str:
  """Process 0's word after its commit: `ok <committed_at>`, and where each host commits its
  own part (`files`: the job's, None where the directory is shared) ` <the others> <parts>
  <copies> <retention>`: the `count` processes' state files packed (size and CRC-32, 16 bytes a
  process in base64, in process order), every other file ({file: {size, crc32}}: the shard
  table) as JSON, the fewest confirmed replicas of any part (`-`: none asked), and the
  manifest's `retention` record as JSON."""
  if files is None:
    return f'ok {committed_at!r}'
  names = [_part_name(k) for k in range(count)]
  parts = np.zeros(count, _PART)
  for k, name in enumerate(names):
    parts[k] = files[name]['size'], int(files[name]['crc32'], 16)
  listed = set(names)
  others = {n: f for n, f in files.items() if n not in listed}
  return f'ok {committed_at!r} {json.dumps(others, separators=(",", ":"))} ' \
      f'{base64.b64encode(parts.tobytes()).decode()} {"-" if copies is None else int(copies)} ' \
      f'{json.dumps(dict(retention or {}), separators=(",", ":"))}'


def announce(group: Group,
             seq: int,
             committed_at: float,
             files: Mapping[str, Any],
             retention: Mapping[str, Any],
             copies: int | None = None) -> None:
  """Process 0, once it committed save `seq`: its word to the others."""
  group.announce(
      f'{seq}/commit',
      word(committed_at, None if group.shared else files, group.count, retention, copies))


def await_commit(group: Group, seq: int, step: int) -> tuple[float, Any, Any, int | None]:
  """A process other than 0: process 0's word on save `seq` (`parse`); E-DIST-002 past the
  timeout."""
  said = group.await_word(f'{seq}/commit', f'checkpoint step {step}')
  return parse(said, step, None if group.shared else group.count)


def parse(said: str, step: int, count: int | None) -> tuple[float, Any, Any, int | None]:
  """Process 0's word `said` on the commit of `step`: (committed_at, the job's files of `count`
  processes, its retention record, the job's confirmed replica count), the last three None where
  the directory is shared (`count` None). E-DIST-003 when process 0 did not commit, or its word
  is not what this process expects."""
  fields = said.split(' ', 5)  # the retention record's strings may hold spaces
  if fields[0] != 'ok':
    raise CheckpointError('E-DIST-003', f'process 0 did not commit: {said[:300]}')
  try:
    if len(fields) != (2 if count is None else 6):
      raise ValueError(f'{len(fields)} fields')
    if count is None:
      return float(fields[1]), None, None, None
    others, kept = json.loads(fields[2]), json.loads(fields[5])
    copies = None if fields[4] == '-' else int(fields[4])
    if copies is not None and copies < 0:
      raise ValueError(f'a replica count of {copies}')
    parts = np.frombuffer(base64.b64decode(fields[3], validate=True), _PART)
    if len(parts) != count:
      raise ValueError(f'{len(parts)} state files for {count} processes')
    if not isinstance(others, dict) or not all(map(_is_entry, others.values())):
      raise ValueError('its file list is not {file: {size, crc32}}')
    reasons = kept.get('kept', []) if isinstance(kept, dict) else None
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
      raise ValueError('its retention record is not {"kept": [reason, ...], ...}')
    files = {_part_name(k): {'size': int(n), 'crc32': f'{c:08x}'} for k, (n, c) in enumerate(parts)}
    return float(fields[1]), {**others, **files}, kept, copies
  except (ValueError, TypeError, RecursionError) as e:  # deep JSON: RecursionError
    raise CheckpointError(
        'E-DIST-003', f'process 0 committed step {step}, and its word does not parse here '
        f'({" ".join(str(e).split())[:200]})', 'run one jaxckpt version on every process') from None


def _is_entry(entry: Any) -> bool:
  """Whether `entry` is a manifest's file entry: {"size": bytes, "crc32": 8 hex digits}."""
  return isinstance(entry, dict) and list(entry) == ['size', 'crc32'] and \
      type(entry['size']) is int and entry['size'] >= 0 and isinstance(entry['crc32'], str) and \
      len(entry['crc32']) == 8 and all(c in '0123456789abcdef' for c in entry['crc32'])


def _part_name(process: int) -> str:
  return f'{layout.STATE_DIR}/{statefile.file_name(process)}'
