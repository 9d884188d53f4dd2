"""Checkpoints in a remote store: their objects, how one is uploaded, found and downloaded.

    URL/checkpoints/step_<n>/
      a-<attempt>/<file>     each file of the local checkpoint up to `part_bytes` long...
      a-<attempt>/<file>.part-<i>   ...longer ones in parts of `part_bytes` (written in parallel)
      a-<attempt>/run/<name> the run's records as of this step (status, samples, ...)
      a-<attempt>/manifest.json     the local manifest, byte for byte
      remote.json            THE COMMIT, written last: which attempt, its part size, the
                             manifest's and the records' sizes and CRC-32s, and the
                             segments that hold the records that only grow:
    URL/records/<name>/...   the loss history and events, by segment (`segments`)

Every upload writes under its own attempt name (one per writer: a writer that lost the prefix
writes only where nothing reads). A remote checkpoint is complete exactly when its `remote.json`
names an attempt whose manifest, seal and every object are there; its bytes are checked against
the manifest's CRC-32s as they are downloaded. `remote.json` is created only if absent, and
replaced (a replay of the step) only if it is still the version read before the upload: one
conditional swap, so the step never disappears while it changes; the old attempt is deleted
after it. Checkpoints written before attempts (their files and manifest.json beside remote.json)
are read as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

from .. import atomic, discovery, layout, manifest
from ..checksum import crc32
from ..errors import CheckpointError
from .bounds import meta_problems, read_manifest, read_prefix, start_read
from .bounds import short as read_was_short
from .checks import MAX_META_BYTES, loads, manifest_problems, read_small
from .lease import LeaseError
from .segments import SEGMENTS, Appended, Segments, entry
from .segments import listed as listed_segments
from .segments import problems as segment_problems
from .segments import read as read_segments
from .store import Store, StoreError, paced
from .transfer import DamagedLocal, check_crc, part_keys, run_bounded, send_files

CHECKPOINTS = 'checkpoints'
RECORDS = 'run'
REMOTE_META = paced('remote.json')  # a commit: written at most once a second per step
PART_BYTES = 32 << 20
PARALLEL = 8  # objects in flight: memory held is PARALLEL x PART_BYTES at most
_ATTEMPT = re.compile(r'^a-[0-9a-f]{8,32}$')


def _never(what: str) -> None:
  """The default fence: writes are not checked (a store without a lease)."""


class Conflict(LeaseError):
  """A step's commit changed under its writer: another writes to the prefix (E-STORE-007)."""


def new_attempt() -> str:
  return f'a-{uuid.uuid4().hex[:16]}'


def step_prefix(step: int) -> str:
  return f'{CHECKPOINTS}/{layout.step_dirname(step)}/'


def data_prefix(step: int, meta: Mapping[str, Any] | None) -> str:
  """Where the objects of a step's commit (`remote.json`, as read) are: its attempt's folder, or
  the step's own for a checkpoint written before attempts."""
  attempt = (meta or {}).get('attempt')
  return step_prefix(step) + (f'{attempt}/' if attempt else '')


def object_key(store: Store, step: int, rel: str) -> str:
  """The key of file `rel` (or `run/<name>`, a record) of remote step `step` as committed."""
  return data_prefix(step, _read_meta(store, step)[0]) + rel


def _read_meta(store: Store, step: int) -> tuple[dict[str, Any] | None, bytes]:
  """(the step's `remote.json`, or None when absent or not ours; its generation)."""
  meta, generation, _ = _meta(store, step)
  return meta, generation


def _meta(store: Store, step: int) -> tuple[dict[str, Any] | None, bytes, str | None]:
  """`_read_meta`, and why a `remote.json` that is there is not one to use (None: absent, or
  usable). Read only up to MAX_META_BYTES."""
  raw, generation, large = read_small(store, step_prefix(step) + REMOTE_META, MAX_META_BYTES)
  if large:
    return None, generation, f'larger than {MAX_META_BYTES} bytes'
  meta = loads(raw)
  if raw is None:
    return None, generation, None
  if not isinstance(meta, dict):
    return None, generation, 'not a JSON object (or nested too deeply to read)'
  if meta.get('attempt') is not None and not _ATTEMPT.match(str(meta['attempt'])):
    # A name from the bucket that is not one of ours is never a path to follow.
    return None, generation, f'names the attempt {str(meta["attempt"])!r:.40}, not a name of ours'
  return meta, generation, None


def holds(store: Store, step_dir: Path) -> bool:
  """Whether the remote holds the committed checkpoint `step_dir` as it is (the same manifest,
  every object there): a checkpoint downloaded from it, or uploaded before."""
  raw, m = discovery.read_manifest_bytes(step_dir)
  got, _, _, problems = inspect(store, m['step'])
  return got == raw and not problems


def upload(store: Store,
           step_dir: Path,
           records: Mapping[str, bytes | Appended],
           *,
           attempt: str | None = None,
           files: Callable[[list[str]], Collection[str]] | None = None,
           commit: bool = True,
           may_write: Callable[[str], None] = _never,
           may_commit: Callable[[], None] = lambda: None,
           may_delete: Callable[[str], None] = _never,
           part_bytes: int = PART_BYTES,
           parallel: int = PARALLEL,
           memory: Mapping[str, Any] | None = None,
           segments: Segments | None = None) -> tuple[int, dict[str, Any]]:
  """Copies the committed checkpoint `step_dir` and `records` ({name: bytes}) to `store` under
  `attempt` (a fresh name when None); returns (the bytes sent, its manifest). Every file is
  opened before the first byte is sent, so local retention deleting the checkpoint meanwhile
  cannot cut an upload short. `may_write(what)` is called before each object is written,
  `may_commit()` before the commit, `may_delete(what)` before the old attempt of a replaced
  step is deleted; each raises to refuse (a lease that is not fresh, a part not there yet).

  Across processes each sends the `files(manifest's files)` that are its own, under the one
  attempt process 0 names, and only process 0 `commit`s: the records, the manifest and, once
  every other part is there, `remote.json`. A step committed by another writer meanwhile raises
  `Conflict` E-STORE-007. `memory`: {file: its `staging.InMemory`}, read instead of the disk
  while the save's staging buffer still holds it. A record given as `segments.Appended` is sent
  by segment: only its bytes that `segments` (this writer's, kept across uploads) has not sent."""
  raw, m = discovery.read_manifest_bytes(step_dir)
  step, attempt = m['step'], attempt or new_attempt()
  prefix, data = step_prefix(step), f'{step_prefix(step)}{attempt}/'
  before, generation = _read_meta(store, step) if commit else (None, b'')
  sending = {
      rel: m['files'][rel]
      for rel in (list(m['files']) if files is None else files(list(m['files'])))
  }
  sent = send_files(store, data, step_dir, sending, part_bytes, parallel, may_write, memory)
  if not commit:
    return sent, m
  segments = Segments() if segments is None else segments
  tables, planned, writes = {}, {}, {}
  for n, r in records.items():
    if isinstance(r, Appended):
      held, added = segments.plan(n, r)
      planned[n], tables[n] = (r, held), entry(held, r.size)
      writes.update(added)
    else:
      tables[n] = {'size': len(r), 'crc32': f'{crc32(r):08x}'}
      writes[f'{data}{RECORDS}/{n}'] = r
  meta = {
      'format': 'jaxckpt.remote', 'format_version': 3, 'attempt': attempt, 'part_bytes': part_bytes,
      'manifest': {'size': len(raw), 'crc32': f'{crc32(raw):08x}'}, 'records': tables
  }
  writes[data + layout.MANIFEST] = raw
  for key in writes:
    may_write(store.join(key))
  store.write_many(writes)
  may_commit()
  body = json.dumps(meta, indent=1).encode()
  if store.replace(prefix + REMOTE_META, body, generation) is None:
    now, _ = _read_meta(store, step)
    if (now or {}).get('attempt') != attempt or now.get('manifest') != meta['manifest'] or \
        now.get('records') != tables:
      raise Conflict(
          'E-STORE-007', f'{store.join(prefix + REMOTE_META)} was changed by another writer '
          'while this one uploaded the step', 'one trainer per --remote prefix: this run no '
          'longer writes there')
    # else: our own write, whose answer was lost and retried
  segments.committed(tables, planned)
  old = (before or {}).get('attempt')
  if before is not None and old != attempt:
    may_delete(store.join(prefix))
    now, _ = _read_meta(store, step)  # after the lease check: another holder may have committed
    if (now or {}).get('attempt') == attempt:
      store.delete_many(
          stale(store, step, [k[len(prefix):] for k in store.list(prefix)], now),
          fence=lambda: may_delete(store.join(prefix)))
  return sent + sum(len(b) for b in writes.values()), m


def stale(store: Store, step: int, keys: list[str], meta: Mapping[str, Any] | None) -> list[str]:
  """The keys (full) under committed step `step` that its commit `meta` does not name: other
  attempts (abandoned, a stale writer's, the one a replay replaced) and, once the step has an
  attempt, the objects of the commit it replaced from before attempts."""
  attempt = (meta or {}).get('attempt')
  out = []
  for key in keys:
    first = key.split('/', 1)[0]
    if key == REMOTE_META or (attempt and first == attempt):
      continue
    if _ATTEMPT.match(first) or attempt:
      out.append(step_prefix(step) + key)
  # The old format's manifest first: its step must never look complete while it goes.
  return sorted(out, key=lambda k: not k.endswith('/' + layout.MANIFEST))


def steps(store: Store) -> tuple[dict[int, list[str]], list[int]]:
  """From one listing: ({step: its object keys, relative to its prefix} of every step prefix
  that holds a commit (`remote.json` beside an attempt, or a manifest from before attempts),
  ascending; the steps whose prefix holds objects but no commit, which are uploads in progress
  or abandoned). `inspect` says whether a commit is complete."""
  by_step: dict[int, list[str]] = {}
  for key in store.list(CHECKPOINTS + '/'):
    parts = key.split('/', 2)
    step = layout.parse_step(parts[1]) if len(parts) == 3 else None
    if step is not None and parts[1] == layout.step_dirname(step):  # never two folders for one
      by_step.setdefault(step, []).append(parts[2])
  done = {s: keys for s, keys in sorted(by_step.items()) if _committed(keys)}
  return done, sorted(set(by_step) - set(done))


def _committed(keys: list[str]) -> bool:
  return layout.MANIFEST in keys or (REMOTE_META in keys
                                     and any(_ATTEMPT.match(k.split('/', 1)[0]) for k in keys))


def committed(store: Store) -> dict[int, list[str]]:
  """{step: its object keys} of every step prefix that holds a commit, ascending."""
  return steps(store)[0]


def inspect(
    store: Store,
    step: int,
    keys: list[str] | None = None
) -> tuple[bytes | None, dict[str, Any] | None, dict[str, Any] | None, list[str]]:
  """(manifest bytes, manifest, remote.json, problems) of a remote checkpoint, from its commit
  and the object listing (no data is read)."""
  prefix = step_prefix(step)
  where = store.join(prefix.rstrip('/'))
  keys = [k[len(prefix):] for k in store.list(prefix)] if keys is None else keys
  meta, _, why = _meta(store, step)
  if why is not None:
    return None, None, None, [f'{REMOTE_META}: {why}']
  data = data_prefix(step, meta)
  raw = read_manifest(store, data + layout.MANIFEST, meta)  # no more than it says
  if raw is None:
    return None, None, None, ['manifest.json: missing: not a committed checkpoint']
  try:
    m = manifest.parse(Path(where), raw)
  except CheckpointError as e:
    return raw, None, None, [str(e)]  # JSON nested too deep included (E-CKPT-004)
  problems = [p for p in (manifest.check_seal(raw, m),) if p]
  problems += manifest_problems(step, m)  # its step and names: from the bucket too
  if meta is None or 'part_bytes' not in meta:
    return raw, m, None, problems + [f'{REMOTE_META}: missing or malformed']
  if untrusted := meta_problems(meta, m, len(keys)):  # names and sizes from the bucket
    return raw, m, meta, problems + untrusted
  said = meta.get('manifest')
  if said is not None and said != {'size': len(raw), 'crc32': f'{crc32(raw):08x}'}:
    problems.append(f'{meta["attempt"]}/manifest.json: does not match {REMOTE_META}')
  inner = data[len(prefix):]
  present = {k[len(inner):] for k in keys if k.startswith(inner)}
  for rel, want in m['files'].items():
    for key, _, _ in part_keys(rel, want['size'], meta['part_bytes']):
      if key not in present:
        problems.append(f'{inner}{key}: missing')
  for name, want in meta.get('records', {}).items():
    if 'segments' in want:
      problems += segment_problems(name, want, listed_segments(store, name))
    elif f'{RECORDS}/{name}' not in present:
      problems.append(f'{inner}{RECORDS}/{name}: missing')
  return raw, m, meta, problems


def latest_intact(
    store: Store, last: Collection[int] = ()) -> tuple[int | None, list[tuple[int, str]]]:
  """(newest remote step whose objects are all there, [(newer step, problem)] passed over).
  The steps in `last` (`remote.abandoned.held`) are tried after all the others."""
  skipped = []
  found = committed(store)
  for step in sorted(found, key=lambda s: (s not in last, s), reverse=True):
    _, _, _, problems = inspect(store, step, found[step])
    if not problems:
      return step, skipped
    skipped.append((step, problems[0]))
  return None, skipped


def delete(store: Store, step: int, may_delete: Callable[[str], None] = _never) -> None:
  """Removes a remote checkpoint: its commit first, so it never looks complete while going."""
  prefix = step_prefix(step)
  may_delete(store.join(prefix))
  store.delete(prefix + REMOTE_META)
  store.delete(prefix + layout.MANIFEST)  # a checkpoint from before attempts
  store.delete_many([prefix + k for k in (key[len(prefix):] for key in store.list(prefix))],
                    fence=lambda: may_delete(store.join(prefix)))
  if store.scheme == 'file':  # a path keeps folders: remove those this emptied, deepest first
    for folder, _, _ in os.walk(Path(store.prefix) / prefix, topdown=False):
      with contextlib.suppress(OSError):  # rmdir refuses a folder that still holds something
        os.rmdir(folder)


def download(
    store: Store,
    step: int,
    ckpt_root: Path,
    *,
    parallel: int = PARALLEL,
    progress: Callable[[int, int], None] = lambda done, total: None,
    only: Collection[str] | None = None,
    on_plan: Callable[[int, int], None] = lambda total, part_bytes: None,
    before_publish: Callable[[dict[str, bytes]], None] = lambda records: None
) -> tuple[Path, dict[str, bytes]]:
  """Downloads remote checkpoint `step` into `ckpt_root/step_<n>` (published with its manifest
  last, like a local commit) and returns (that directory, {record name: bytes}). Every byte is
  checked against the manifest's CRC-32 while it is read: a mismatch raises E-STORE-012 and
  leaves nothing behind. `only`: the files under `state/` to fetch (the others stay absent, as
  other processes' parts on each host's own disk); its run state and shard table always come.
  `progress(done, total)` after each part; `on_plan(total, part_bytes)` once, before the first.
  `before_publish(records)` once every byte is checked, before the checkpoint is published: what
  must be in place before the checkpoint is (the run's records: a start that finds the checkpoint
  published never downloads it again); if it raises, nothing is published."""
  raw, m, meta, problems = inspect(store, step)
  where = store.join(step_prefix(step).rstrip('/'))
  if problems:
    raise CheckpointError('E-STORE-012', f'{where} is not intact: {problems[0]}',
                          'take an older remote checkpoint')
  prefix, part_bytes = data_prefix(step, meta), meta['part_bytes']
  tmp = layout.temporary_dir(ckpt_root, step)
  files = {
      rel: want
      for rel, want in m['files'].items()
      if only is None or rel in only or not rel.startswith(f'{layout.STATE_DIR}/')
  }
  total, done, lock = sum(w['size'] for w in files.values()), [0], threading.Lock()
  on_plan(total, part_bytes)

  def progressed(n: int) -> None:
    with lock:
      done[0] += n
      progress(done[0], total)

  try:
    tmp.mkdir(parents=True)
    for rel, want in files.items():
      path = layout.safe_member(tmp, rel)
      path.parent.mkdir(parents=True, exist_ok=True)
      fetch_file(store, prefix, rel, want, part_bytes, path, parallel, progressed, f'{where}/{rel}',
                 'take an older remote checkpoint')
    records = {}
    for name, want in meta.get('records', {}).items():
      if 'segments' in want:
        data = read_segments(store, name, want) or b''
      else:
        data = read_prefix(store, f'{prefix}{RECORDS}/{name}', want['size']) or b''
      if len(data) != want['size'] or f'{crc32(data):08x}' != want['crc32']:
        where = store.join(SEGMENTS if 'segments' in want else prefix + RECORDS, name)
        raise CheckpointError('E-STORE-012', f'{where}: does not match {REMOTE_META}',
                              'take an older remote checkpoint')
      records[name] = data
    before_publish(records)
    for dirpath, _, _ in os.walk(tmp):
      atomic.fsync_dir(Path(dirpath))
    atomic.write_file_durably(tmp / layout.MANIFEST, raw)
    final = ckpt_root / layout.step_dirname(step)
    atomic.publish_dir(tmp, final)
    atomic.fsync_dir(ckpt_root)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return final, records


def fetch_file(store: Store, prefix: str, rel: str, want: Mapping[str, Any], part_bytes: int,
               path: Path, parallel: int, progressed: Callable[[int],
                                                               None], name: str, fix: str) -> None:
  """Reads the objects of file `rel` under `prefix` into `path` (fsynced), its CRC-32 checked
  against `want`; E-STORE-012 when an object is missing, the wrong size or the CRC differs."""
  crcs: dict[int, tuple[int, int]] = {}
  with open(path, 'wb') as f:
    f.truncate(want['size'])

    def finish(item):
      key, start, stop, future = item
      try:
        data = store.finish('read', key, future)
      except StoreError as e:  # shorter than the range read
        if not read_was_short(e):
          raise
        data = None
      if data is None or data.state != 'value' or len(data.value) != stop - start:
        raise CheckpointError('E-STORE-012', f'{store.join(prefix + key)}: missing or '
                              'the wrong size', fix)
      os.pwrite(f.fileno(), data.value, start)
      crcs[start] = (crc32(data.value), stop - start)
      progressed(stop - start)

    tasks = [(lambda k=k, a=a, b=b: (k, a, b, start_read(store, prefix + k, b - a)))
             for k, a, b in part_keys(rel, want['size'], part_bytes)]
    run_bounded(tasks, finish, parallel)
    os.fsync(f.fileno())
  try:
    check_crc(name, crcs, want['crc32'])
  except DamagedLocal as e:
    raise CheckpointError('E-STORE-012', e.what, fix) from None


__all__ = [
    'Conflict', 'DamagedLocal', 'StoreError', 'committed', 'delete', 'download', 'holds', 'inspect',
    'latest_intact', 'object_key', 'stale', 'steps', 'upload'
]
