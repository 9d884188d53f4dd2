"""Remote URLs where the tools take a path: runs and checkpoints in s3://, gs:// or file://.

    jaxckpt inspect  s3://bucket/run                       its newest intact checkpoint
    jaxckpt inspect  s3://bucket/run/checkpoints/step_00000300
    jaxckpt verify   gs://bucket/run                       every remote checkpoint, byte by byte
    jaxckpt export   s3://bucket/run --format=hf --out=out/hf
    jaxckpt evaluate --workdir=s3://bucket/run

A checkpoint named by URL is downloaded (CRC-checked, as a fresh machine's resume does) into a
temporary directory that is removed when the command ends; the command then reads it as it reads
a local one. `verify` reads every remote checkpoint through the same CRC-checked download.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from jaxckpt.checkpoint import CheckpointError, abandoned, atomic, layout
from jaxckpt.checkpoint.remote import Store, StoreError, objects
from jaxckpt.checkpoint.remote import abandoned as remote_abandoned
from jaxckpt.errors import UsageError

_URL = re.compile(r'^[a-zA-Z][a-zA-Z0-9+.-]*://')
_STEP = re.compile(r'^(?P<run>.*)/checkpoints/(?P<name>step_\d{8,})/?$')
_NOT_INTACT = 'E-STORE-012'  # a remote checkpoint that is not intact: an older one may be


def is_url(arg: str) -> bool:
  return bool(_URL.match(str(arg)))


def split(url: str) -> tuple[str, int | None]:
  """(the run's URL, the step named, or None for the run itself)."""
  m = _STEP.match(url)
  if m:
    return m['run'], layout.parse_step(m['name'])
  scheme, sep, rest = url.rpartition('://')
  url = scheme + sep + rest.rstrip('/')  # `s3://` stays a URL (without a bucket: refused)
  return (url[:-len('/checkpoints')] if url.endswith('/checkpoints') else url), None


# A store's answers that say the URL itself is wrong: usage errors (exit 2), as a local path that
# does not exist is.
_WRONG_URL = ('missing_parent', 'missing_bucket', 'bad_url')


@contextlib.contextmanager
def _url_errors() -> Iterator[None]:
  try:
    yield
  except StoreError as e:
    if e.kind in _WRONG_URL:
      raise UsageError(e.code, e.what, e.fix) from None
    raise


def open_run(url: str) -> Store:
  """The store of the run `url` names; a URL that cannot be one (a scheme, a bucket's name, a
  mounted path's parent that is not there) is a usage error."""
  try:
    store = Store(split(url)[0])
    store.kv  # pylint: disable=pointless-statement  # opened now: a path's parent is checked
    return store
  except StoreError as e:
    raise UsageError(e.code, e.what, e.fix) from None


def newest(store: Store) -> int:
  """The run's newest intact checkpoint: of the history it is on, before any it abandoned."""
  with _url_errors():
    step, skipped = objects.latest_intact(
        store, last=remote_abandoned.held(store, objects.committed(store)))
  if step is None:
    why = f' (newest: step {skipped[0][0]}: {skipped[0][1]})' if skipped else ''
    raise UsageError('E-STORE-009', f'{store.url} holds no intact checkpoint{why}',
                     'check the URL: a run written with --remote=URL has URL/checkpoints/')
  return step


@contextlib.contextmanager
def local_checkpoint(arg: str) -> Iterator[Path]:
  """`arg` itself when it is a local path; for a URL, a downloaded copy of the checkpoint it
  names, removed afterwards. A run's URL names its newest intact checkpoint: one whose download
  fails its checks (an object missing, a CRC-32 mismatch) is passed over, saying so on stderr,
  for the next older one."""
  if not is_url(arg):
    yield Path(arg)
    return
  store = open_run(arg)
  step = split(arg)[1]
  with _tempdir() as tmp:
    root = tmp / 'checkpoints'
    yield _download(store, step, root) if step is not None else _download_newest(store, root)


def _download_newest(store: Store, root: Path) -> Path:
  """The newest remote checkpoint that downloads intact, into `root` (one the run abandoned
  when it went back to an older one only when nothing else is)."""
  skipped: list[tuple[int, str]] = []
  try:
    steps, _ = remote_abandoned.newest_first(store, objects.committed(store))
  except StoreError as e:
    raise UsageError(e.code, e.what, e.fix) from None
  for step in steps:
    try:
      return objects.download(store, step, root)[0]
    except CheckpointError as e:
      if e.code != _NOT_INTACT:  # the store unreachable or refusing: not the checkpoint's fault
        if isinstance(e, StoreError):
          raise UsageError(e.code, e.what, e.fix) from None
        raise
      # The download left nothing behind; what it found is said, then the next older one tried.
      print(
          f'jaxckpt: passing over remote step {step}: {e.code}: {e.what}; taking the next '
          'older one',
          file=sys.stderr,
          flush=True)
      skipped.append((step, e.what))
  why = f' (newest: step {skipped[0][0]}: {skipped[0][1]})' if skipped else ''
  raise UsageError('E-STORE-009', f'{store.url} holds no intact checkpoint{why}',
                   'check the URL: a run written with --remote=URL has URL/checkpoints/')


@contextlib.contextmanager
def local_run(arg: str) -> Iterator[Path]:
  """`arg` when local; for a run's URL, a temporary run directory holding every intact remote
  checkpoint and the newest one's records (loss history, events...), and the record of those
  the run abandoned (`remote.abandoned`): the newest is then the history's the run is on."""
  if not is_url(arg):
    yield Path(arg)
    return
  store = open_run(arg)
  with _tempdir() as tmp:
    with _url_errors():
      gone = remote_abandoned.recorded(store)
      steps, _ = remote_abandoned.newest_first(store, objects.committed(store))
    records: dict[str, bytes] = {}
    for step in reversed(steps):  # the records: the first intact one's in the order a start takes
      try:
        records = objects.download(store, step, tmp / 'checkpoints')[1]
      except CheckpointError as e:
        print(f'jaxckpt: passing over remote step {step}: {e.line()}')
    if gone and (tmp / 'checkpoints').is_dir():  # `inspect` of it passes over the same
      atomic.write_json_durably(tmp / 'checkpoints' / abandoned.FILE, abandoned.encode(0, gone))
    for name, data in records.items():  # plain names: the download refuses any other
      layout.safe_member(tmp, name).write_bytes(data)
    yield tmp


def _download(store: Store, step: int, root: Path) -> Path:
  try:
    return objects.download(store, step, root)[0]
  except StoreError as e:
    raise UsageError(e.code, e.what, e.fix) from None


@contextlib.contextmanager
def _tempdir() -> Iterator[Path]:
  tmp = Path(tempfile.mkdtemp(prefix='jaxckpt-remote-'))
  try:
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def verify(url: str) -> int:
  """`jaxckpt verify URL`: each remote checkpoint's objects and every byte against its manifest;
  prints OK/FAIL lines like the local verify and returns its exit status."""
  store = open_run(url)
  run_url, step = split(url)
  with _url_errors():
    steps = [step] if step is not None else sorted(objects.committed(store))
    if step is not None and not store.list(objects.step_prefix(step)):  # as a local path
      raise UsageError('E-CKPT-010', f'{url} is not a checkpoint: the store holds no object '
                       'under it', "pass the URL of a checkpoint the run holds, or the run's")
  if not steps:
    raise UsageError('E-CKPT-010', f'{url} holds no checkpoint (looked in {run_url}/checkpoints)',
                     'pass a run URL (the --remote of a run) or a checkpoint URL')
  bad = 0
  for s in steps:
    where = store.join(objects.step_prefix(s).rstrip('/'))
    with _tempdir() as tmp:
      try:
        objects.download(store, s, tmp)
        print(f'OK {where}')
      except CheckpointError as e:
        bad += 1
        what = e.what[len(where):].lstrip('/: ') if e.what.startswith(where) else e.what
        print(f'FAIL {where}: {what}')
  return 1 if bad else 0
