"""Checkpoints in a remote store: their objects, how one is uploaded, found and downloaded.

    URL/checkpoints/step_<n>/
      <file>                 each file of the local checkpoint up to `part_bytes` long...
      <file>.part-<i>        ...longer ones in parts of `part_bytes` (written in parallel)
      run/<name>             the run's records as of this step (loss history, events, ...)
      remote.json            part size and the records' sizes and CRC-32s
      manifest.json          the local manifest, byte for byte: WRITTEN LAST, after every other
                             object is confirmed written. It is the remote commit marker.

A remote checkpoint is complete exactly when its manifest exists, its seal holds and every object
it implies is there; its bytes are checked against the manifest's CRC-32s as they are downloaded.
Replacing or deleting one removes its manifest first, so it never looks complete while it changes.
"""

from __future__ import annotations

import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from .. import atomic, discovery, layout, manifest
from ..checksum import crc32, crc32_combine
from ..errors import CheckpointError
from .store import Store, StoreError

CHECKPOINTS = 'checkpoints'
RECORDS = 'run'
REMOTE_META = 'remote.json'
PART_BYTES = 32 << 20
PARALLEL = 8  # objects in flight: memory held is PARALLEL x PART_BYTES at most


def step_prefix(step: int) -> str:
  return f'{CHECKPOINTS}/{layout.step_dirname(step)}/'


def part_keys(rel: str, size: int, part_bytes: int) -> list[tuple[str, int, int]]:
  """[(key, start, stop)] of the objects that hold file `rel` (relative to its step prefix)."""
  if size <= part_bytes:
    return [(rel, 0, size)]
  return [(f'{rel}.part-{i:05d}', start, min(start + part_bytes, size))
          for i, start in enumerate(range(0, size, part_bytes))]


def _run_bounded(tasks: list[Callable[[], Any]], finish: Callable[[Any], None], parallel: int):
  """Starts `tasks` (each returns a future), at most `parallel` in flight; `finish` each result
  in order. Raises the first error, after the futures already started have settled."""
  pending: deque = deque()
  error = None
  for task in tasks:
    if error is None:
      try:
        pending.append(task())
      except BaseException as e:  # noqa: BLE001 - re-raised below
        error = e
    while pending and (len(pending) >= parallel or error is not None):
      error = _settle(pending.popleft(), finish, error)
  while pending:
    error = _settle(pending.popleft(), finish, error)
  if error is not None:
    raise error


def _settle(item, finish, error):
  try:
    finish(item)
  except BaseException as e:  # noqa: BLE001 - the first one wins
    return error or e
  return error


def upload(store: Store,
           step_dir: Path,
           records: Mapping[str, bytes],
           *,
           files: Callable[[list[str]], Collection[str]] | None = None,
           commit: bool = True,
           may_commit: Callable[[], None] = lambda: None,
           part_bytes: int = PART_BYTES,
           parallel: int = PARALLEL) -> tuple[int, dict[str, Any]]:
  """Copies the committed checkpoint `step_dir` and `records` ({name: bytes}) to `store`; returns
  (the bytes sent, its manifest). The manifest goes last, after `may_commit()` (which raises to
  refuse: a lost lease, a part that is not there yet). Every file is opened before the first
  byte is sent, so local retention deleting the checkpoint meanwhile cannot cut an upload short.

  Across processes each sends the `files(manifest's files)` that are its own, and only process 0
  `commit`s: the records, `remote.json` and the manifest, once every other part is there."""
  raw, m = discovery.read_manifest_bytes(step_dir)
  step = m['step']
  sending = {
      rel: m['files'][rel]
      for rel in (list(m['files']) if files is None else files(list(m['files'])))
  }
  prefix = step_prefix(step)
  handles = {rel: open(layout.safe_member(step_dir, rel), 'rb') for rel in sending}
  try:
    store.delete(prefix + layout.MANIFEST)  # replacing one: uncommit it first
    sent = 0
    tasks = []
    for rel, want in sending.items():
      for key, start, stop in part_keys(rel, want['size'], part_bytes):
        tasks.append(_put_part(store, prefix + key, handles[rel], start, stop))
        sent += stop - start
    _run_bounded(tasks, lambda item: store.finish('write', *item), parallel)
  finally:
    for f in handles.values():
      f.close()
  if not commit:
    return sent, m
  meta = {
      'format': 'jaxckpt.remote', 'part_bytes': part_bytes,
      'records': {n: {'size': len(b), 'crc32': f'{crc32(b):08x}'} for n, b in records.items()}
  }
  store.write_many({
      **{f'{prefix}{RECORDS}/{n}': b for n, b in records.items()},
      prefix + REMOTE_META: json.dumps(meta, indent=1).encode()
  })
  may_commit()
  store.write(prefix + layout.MANIFEST, raw)
  return sent + sum(len(b) for b in records.values()) + len(raw), m


def _put_part(store: Store, key: str, f, start: int, stop: int):

  def task():
    data = os.pread(f.fileno(), stop - start, start)
    if len(data) != stop - start:
      raise CheckpointError('E-STORE-013', f'{f.name} is shorter than its manifest says',
                            'the local checkpoint is damaged; it is not uploaded')
    return key, store.start_write(key, data)

  return task


def steps(store: Store) -> tuple[dict[int, list[str]], list[int]]:
  """From one listing: ({step: its object keys, relative to its prefix} of every step prefix
  that holds a manifest, ascending; the steps whose prefix holds objects but no manifest, which
  are uploads in progress or abandoned)."""
  by_step: dict[int, list[str]] = {}
  for key in store.list(CHECKPOINTS + '/'):
    parts = key.split('/', 2)
    step = layout.parse_step(parts[1]) if len(parts) == 3 else None
    if step is not None:
      by_step.setdefault(step, []).append(parts[2])
  done = {s: keys for s, keys in sorted(by_step.items()) if layout.MANIFEST in keys}
  return done, sorted(set(by_step) - set(done))


def committed(store: Store) -> dict[int, list[str]]:
  """{step: its object keys} of every step prefix that holds a manifest, ascending."""
  return steps(store)[0]


def inspect(
    store: Store,
    step: int,
    keys: list[str] | None = None
) -> tuple[bytes | None, dict[str, Any] | None, dict[str, Any] | None, list[str]]:
  """(manifest bytes, manifest, remote.json, problems) of a remote checkpoint, from its manifest
  and the object listing (no data is read)."""
  prefix = step_prefix(step)
  where = store.join(prefix.rstrip('/'))
  if keys is None:
    keys = [k[len(prefix):] for k in store.list(prefix)]
  raw = store.read(prefix + layout.MANIFEST)
  if raw is None:
    return None, None, None, ['manifest.json: missing: not a committed checkpoint']
  try:
    m = manifest.parse(Path(where), raw)
    meta = json.loads(store.read(prefix + REMOTE_META) or b'null')
  except (CheckpointError, ValueError) as e:
    return raw, None, None, [str(e)]
  problems = [p for p in (manifest.check_seal(raw, m),) if p]
  if not isinstance(meta, dict) or 'part_bytes' not in meta:
    return raw, m, None, problems + [f'{REMOTE_META}: missing or malformed']
  present = set(keys)
  for rel, want in m['files'].items():
    for key, _, _ in part_keys(rel, want['size'], meta['part_bytes']):
      if key not in present:
        problems.append(f'{key}: missing')
  for name in meta.get('records', {}):
    if f'{RECORDS}/{name}' not in present:
      problems.append(f'{RECORDS}/{name}: missing')
  return raw, m, meta, problems


def latest_intact(store: Store) -> tuple[int | None, list[tuple[int, str]]]:
  """(newest remote step whose objects are all there, [(newer step, problem)] passed over)."""
  skipped = []
  for step, keys in sorted(committed(store).items(), reverse=True):
    _, _, _, problems = inspect(store, step, keys)
    if not problems:
      return step, skipped
    skipped.append((step, problems[0]))
  return None, skipped


def delete(store: Store, step: int) -> None:
  """Removes a remote checkpoint: its manifest first, so it never looks complete while going."""
  prefix = step_prefix(step)
  store.delete(prefix + layout.MANIFEST)
  store.delete_many([prefix + k for k in (key[len(prefix):] for key in store.list(prefix))])


def download(
    store: Store,
    step: int,
    ckpt_root: Path,
    *,
    parallel: int = PARALLEL,
    progress: Callable[[int, int],
                       None] = lambda done, total: None) -> tuple[Path, dict[str, bytes]]:
  """Downloads remote checkpoint `step` into `ckpt_root/step_<n>` (published with its manifest
  last, like a local commit) and returns (that directory, {record name: bytes}). Every byte is
  checked against the manifest's CRC-32 while it is read: a mismatch raises E-STORE-012 and
  leaves nothing behind."""
  raw, m, meta, problems = inspect(store, step)
  where = store.join(step_prefix(step).rstrip('/'))
  if problems:
    raise CheckpointError('E-STORE-012', f'{where} is not intact: {problems[0]}',
                          'take an older remote checkpoint')
  prefix, part_bytes = step_prefix(step), meta['part_bytes']
  tmp = layout.temporary_dir(ckpt_root, step)
  total = sum(w['size'] for w in m['files'].values())
  done, lock = [0], threading.Lock()
  try:
    tmp.mkdir(parents=True)
    for rel, want in m['files'].items():
      path = layout.safe_member(tmp, rel)
      path.parent.mkdir(parents=True, exist_ok=True)
      crcs: dict[int, tuple[int, int]] = {}
      with open(path, 'wb') as f:
        f.truncate(want['size'])

        def finish(item, f=f, crcs=crcs):
          key, start, stop, future = item
          data = store.finish('read', key, future)
          if data.state != 'value' or len(data.value) != stop - start:
            raise CheckpointError('E-STORE-012', f'{store.join(prefix + key)}: missing or '
                                  'the wrong size', 'take an older remote checkpoint')
          os.pwrite(f.fileno(), data.value, start)
          crcs[start] = (crc32(data.value), stop - start)
          with lock:
            done[0] += stop - start
            progress(done[0], total)

        tasks = [(lambda k=k, a=a, b=b: (k, a, b, store.start_read(prefix + k)))
                 for k, a, b in part_keys(rel, want['size'], part_bytes)]
        _run_bounded(tasks, finish, parallel)
        os.fsync(f.fileno())
      crc = 0
      for start in sorted(crcs):
        crc = crc32_combine(crc, *crcs[start])  # from crc32(b'') == 0
      if f'{crc:08x}' != want['crc32']:
        raise CheckpointError(
            'E-STORE-012', f'{store.join(prefix + rel)}: checksum mismatch (crc32 {crc:08x}, '
            f'manifest says {want["crc32"]})', 'take an older remote checkpoint')
    records = {}
    for name, want in meta.get('records', {}).items():
      data = store.read(f'{prefix}{RECORDS}/{name}') or b''
      if len(data) != want['size'] or f'{crc32(data):08x}' != want['crc32']:
        raise CheckpointError(
            'E-STORE-012', f'{store.join(prefix + RECORDS, name)}: does not '
            f'match {REMOTE_META}', 'take an older remote checkpoint')
      records[name] = data
    for dirpath, _, _ in os.walk(tmp):
      atomic.fsync_dir(Path(dirpath))
    atomic.write_file_durably(tmp / layout.MANIFEST, raw)
    final = ckpt_root / layout.step_dirname(step)
    atomic.publish_dir(tmp, final)
    atomic.fsync_dir(ckpt_root)
  except BaseException:
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return final, records


__all__ = [
    'StoreError', 'committed', 'delete', 'download', 'inspect', 'latest_intact', 'steps', 'upload'
]
