"""A save across processes, between the writes and the commit: who reads what, and the word.

Every process posts its part record (`shardtable.part_record`: its file's size and CRC-32, its
cells) and waits at one barrier; process 0 alone reads the records, files them into
`shards.json`, writes the manifest and commits. Its word to the others is `ok <committed_at>`.

Where each host commits its own part (the directory is each host's own disk), every host's
manifest must be the same bytes as process 0's, and so list every process's file. The word then
also carries the job's file table ({file: {size, crc32}}, about 75 bytes a process), and each
process commits its part under that manifest without reading any other process's record: what a
process other than 0 receives stays the word alone, not every process's record (which grows with
every shard of the job). Its disk holds no `shards.json`, as it holds no other process's part: a
restart's peer restore sends it from process 0 with the run state (`peers`), and the remote tier
holds it with the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from . import replicas, shardtable
from .errors import CheckpointError
from .multihost import Group


def post(group: Group, tmp: Path, seq: int, step: int, record: str, held: Mapping[str, Any],
         grid: Any) -> dict[str, dict[str, Any]] | None:
  """Posts this process's part record and waits for every other's. Process 0: the job's files
  ({file: {size, crc32}}), `shards.json` written into `tmp` and listed, and the replicas it keeps
  matched against their owners'; the others: None (their files come with process 0's word)."""
  records = group.collect(f'{seq}/durable', f'checkpoint step {step}', record)
  if records is None:
    return None
  files, shards = shardtable.merge_records(records, expect=group.count, grid=grid)
  replicas.keep_matching(tmp, held, files)
  files[shardtable.SHARDS] = shardtable.write(tmp / shardtable.SHARDS, shards)
  return files


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


def word(committed_at: float, files: Mapping[str, Any] | None) -> str:
  """Process 0's word after its commit: the time it sealed, and the job's files when each host
  commits its own part (`files`; None where the directory is shared)."""
  listed = '' if files is None else ' ' + json.dumps(files, separators=(',', ':'))
  return f'ok {committed_at!r}{listed}'


def await_commit(group: Group, seq: int, step: int) -> tuple[float, dict[str, Any] | None]:
  """A process other than 0: process 0's word on save `seq` (committed_at, the job's files or
  None); E-DIST-003 when it did not commit, E-DIST-002 past the timeout."""
  said = group.await_word(f'{seq}/commit', f'checkpoint step {step}')
  head, _, listed = said.partition(' ')
  at, _, listed = listed.partition(' ')
  if head != 'ok':
    raise CheckpointError('E-DIST-003', f'process 0 did not commit: {said}')
  try:
    return float(at), (json.loads(listed) if listed else None)
  except ValueError as e:
    raise CheckpointError('E-DIST-003', f'process 0 committed step {step}, and its word does '
                          f'not parse ({e})', 'the job runs one jaxckpt version everywhere') from e
