"""Single files of a remote checkpoint, for a restore that takes the rest from its peers
(`jaxckpt.checkpoint.peers`): each file read once, CRC-checked, fsynced, then renamed in."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import layout, manifest
from ..errors import CheckpointError
from . import objects
from .store import Store


def peer_source(store: Store,
                step: int | None,
                *,
                inspect: bool = True,
                on_records: Callable[[int, dict[str, bytes]], Any] = lambda step, records: None):
  """`peers.Remote` for remote checkpoint `step` (its newest intact one; None: none there);
  its seal (and the bytes `meta` reads) from the store when `inspect` (the process that
  decides). Its `meta` downloads the checkpoint's own files (`objects.download` of none of its
  parts) and hands the records that came with them to `on_records(step, records)` before the
  checkpoint is published: a start that finds it published never downloads it again, so its
  records would not come after it."""
  from ..peers import Remote  # pylint: disable=import-outside-toplevel
  seal, size = None, 0
  if step is not None and inspect:
    raw, m, meta, problems = objects.inspect(store, step)
    if raw is not None and not problems:
      seal = manifest.seal_of(raw)
      own = [w['size'] for rel, w in m['files'].items() if not rel.startswith(f'{layout.STATE_DIR}/')]
      size = len(raw) + sum(own) + sum(r['size'] for r in meta.get('records', {}).values())
  return Remote(
      step if seal or not inspect else None,
      seal,
      lambda at, rels, into, expect: fetch_files(store, at, rels, into, expect),
      meta=lambda at, ckpt_dir: objects.download(
          store, at, ckpt_dir, only=(), before_publish=lambda records: on_records(at, records)),
      meta_bytes=size)


def fetch_files(store: Store,
                step: int,
                rels: list[str],
                step_dir: Path,
                expect: Mapping[str, Mapping[str, Any]] | None = None) -> int:
  """Downloads files `rels` of remote checkpoint `step` into `step_dir`; the bytes read.
  E-STORE-012 when one is not there intact, or not as `expect` ({rel: {size, crc32}}) says
  (nothing is left under its name)."""
  raw, m, meta, problems = objects.inspect(store, step)
  where = store.join(objects.step_prefix(step).rstrip('/'))
  if problems or m is None or meta is None:
    raise CheckpointError('E-STORE-012', f'{where} is not intact: {(problems or ["?"])[0]}',
                          "the job falls back to the remote's newest intact checkpoint")
  prefix, total = objects.data_prefix(step, meta), 0
  for rel in rels:
    if rel not in m['files'] or (expect is not None
                                 and {k: m['files'][rel].get(k) for k in ('size', 'crc32')}
                                 != {k: expect.get(rel, {}).get(k) for k in ('size', 'crc32')}):
      raise CheckpointError(
          'E-STORE-012', f'{where}: {rel} is not in its manifest as the '
          'checkpoint restored says', "the job falls back to the remote's newest intact "
          'checkpoint')
    path = layout.safe_member(step_dir, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + layout.FETCH_TMP)
    try:
      objects.fetch_file(store, prefix, rel, m['files'][rel], meta['part_bytes'], tmp,
                         objects.PARALLEL, lambda n: None, f'{where}/{rel}',
                         "the job falls back to the remote's newest intact checkpoint")
      os.replace(tmp, path)
    finally:
      tmp.unlink(missing_ok=True)
    total += m['files'][rel]['size']
  return total


__all__ = ['fetch_files', 'peer_source']
