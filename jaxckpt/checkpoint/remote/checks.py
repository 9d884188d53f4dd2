"""Small objects from the bucket, and what a remote manifest says of its own place, checked
before anything uses them (beside `bounds`, which checks the names and sizes of a commit).

- `read_small`: an object that is small by design (a step's `remote.json`, the `LEASE`) is read
  whole only once a ranged read of one byte at its bound found nothing there: one larger than the
  bound is never read whole, only reported as larger.
- `loads`: JSON from the bucket, or None when it is not JSON, including JSON nested too deeply to
  parse (Python's parser raises RecursionError for that, not ValueError).
- `manifest_problems`: a manifest whose `step` is not the step of the folder it was found in (a
  step folder copied or renamed in the bucket), or one that names a file both as a file and as
  a folder of others (`x` and `x/y`), or names the manifest itself: no checkpoint that can be
  published as that folder's `step_<n>`. Each is a problem line, as a missing object is: the
  checkpoint is not intact (E-STORE-012) and a reader takes an older one.
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from .. import layout
from .store import Store, StoreError

MAX_META_BYTES = 4 << 20  # a step's remote.json: one naming the most segments allowed is < 2 MiB
MAX_LEASE_BYTES = 64 << 10  # the LEASE: a few hundred bytes


def read_small(store: Store,
               key: str,
               limit: int,
               *,
               timeout: float | None = None) -> tuple[bytes | None, bytes, bool]:
  """(object `key`'s bytes, or None when it is absent or larger than `limit`; its generation;
  whether it is larger than `limit`). Raises `StoreError` when the store fails; `timeout` as for
  `Store.read_generation`, for both requests together."""
  end = None if timeout is None else time.monotonic() + timeout
  try:
    probe = store.start_read(key, slice(limit, limit + 1)).result(timeout=timeout)
  except StoreError as e:
    if not _past_end(e):
      raise
  else:
    if probe.state != 'value':  # absent: its generation makes a conditional write a create
      return None, probe.stamp.generation, False
    return None, probe.stamp.generation, True
  left = None if end is None else max(0.1, end - time.monotonic())
  raw, generation = store.read_generation(key, timeout=left)
  if raw is not None and len(raw) > limit:  # replaced by a larger one since the first read
    return None, generation, True
  return raw, generation, False


def _past_end(e: StoreError) -> bool:
  """Whether a ranged read failed because the object ends before the range (S3 and a path say
  OUT_OF_RANGE; the GCS emulator sends a Content-Range that tensorstore refuses)."""
  said = f'{e} {e.__cause__ or ""}'.lower()
  return any(s in said for s in ('out_of_range', 'content-range', 'not satisfiable'))


def loads(raw: bytes | None) -> Any:
  """`raw` parsed as JSON; None when it is None, empty, not JSON or nested too deeply."""
  if not raw:
    return None
  try:
    return json.loads(raw)
  except (ValueError, RecursionError):
    return None


def manifest_problems(step: int, m: Mapping[str, Any]) -> list[str]:
  """Why manifest `m`, found under remote step `step`'s folder, cannot be published as that
  step: its own step differs, or its file names conflict. [] when neither."""
  said = m.get('step')
  if type(said) is not int or said < 0:  # pylint: disable=unidiomatic-typecheck
    return [f'manifest.json: step {said!r:.40} is not a whole number']
  if said != step:
    return [
        f'manifest.json says step {said}, but it is in the folder of step {step} (a step '
        'folder copied or renamed in the bucket?)'
    ]
  files = m.get('files')
  names = set(files) if isinstance(files, Mapping) else set()
  for rel in sorted(names):
    if not isinstance(rel, str):
      continue  # `bounds.meta_problems` names it
    if rel == layout.MANIFEST:
      return [f'manifest.json names itself ({rel!r}) as one of its files']
    parts = rel.split('/')
    for n in range(1, len(parts)):
      if (folder := '/'.join(parts[:n])) in names:
        return [
            f'manifest.json names {folder!r:.80} both as a file and as the folder of {rel!r:.80}'
        ]
  return []


__all__ = ['MAX_LEASE_BYTES', 'MAX_META_BYTES', 'loads', 'manifest_problems', 'read_small']
