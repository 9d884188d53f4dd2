"""`--remote`'s access check before anything is compiled: a probe object listed, written, read
back and deleted under the prefix, and (for the lease) the store's conditional writes. Every
failure is one line naming the URL, what failed, the store's own words and the fix (exit 2).
"""

from __future__ import annotations

import os
import re
import uuid

from jaxckpt.checkpoint.remote import Store, StoreError
from jaxckpt.errors import ConfigError, UsageError

# What a failed access check means, by `StoreError.kind`: (code, what, fix). Filled in with the
# store's {bucket}, {url}, {endpoint}, {endpoint_var} and {credentials}.
_ACCESS = {
    'bad_url':
        ('E-STORE-001', '{bucket} is not a valid bucket name', 'fix the bucket name in --remote'),
    'missing_bucket': ('E-STORE-002', 'bucket {bucket} does not exist',
                       'create it, or fix the bucket name in --remote'),
    'missing_parent': ('E-STORE-002', 'its parent directory does not exist (a disk not mounted?)',
                       'mount the disk, or create the parent directory of {url}'),
    'credentials': ('E-STORE-003', 'the credentials were refused', 'check {credentials}'),
    'denied': ('E-STORE-003', 'the credentials may not list the bucket',
               'grant them list and read access to the bucket, or check {credentials}'),
    'unreachable': ('E-STORE-005', 'the storage endpoint {endpoint} cannot be reached',
                    'check {endpoint_var} and the network'),
    'slow_down': ('E-STORE-015', 'the store kept answering HTTP 503 or 429 (slow down)',
                  'run it again later, or send fewer requests: --remote_rate=auto, or a lower '
                  'number'),
    'failed': ('E-STORE-008', 'the store failed', 'check --remote and the store'),
}
# The permission a probe stage needs, by scheme, for E-STORE-004.
_PERMISSION = {
    's3': {'write': 's3:PutObject', 'read': 's3:GetObject', 'delete': 's3:DeleteObject'},
    'gs': {
        'write': 'storage.objects.create', 'read': 'storage.objects.get',
        'delete': 'storage.objects.delete'
    },
}


def open_store(url: str) -> Store:
  try:
    return Store(url)
  except StoreError as e:  # E-STORE-001: its `what` starts with the URL
    raise ConfigError(e.code, f'--remote={e.what}', e.fix) from None


def check_access(store: Store, *, conditions: bool = False) -> None:
  """Lists, writes, reads back and deletes a probe object under the prefix; raises `UsageError`
  (exit 2), one line naming the URL, what failed and the fix. `conditions`: also that the store
  refuses a second create-only write and a write at a stale generation (the lease needs both)."""
  probe = f'.jaxckpt-probe-{uuid.uuid4().hex[:12]}'
  data = b'jaxckpt access probe\n'
  stage, unclear = 'list', None
  try:
    try:
      store.list('.jaxckpt-probe-')
    except StoreError as e:
      if e.kind != 'failed':
        raise
      # An answer that says nothing (the GCS emulator's empty 404 for a bucket it does not
      # have): what the write is told may say more.
      unclear = e
    stage = 'write'
    store.write(probe, data)
    stage = 'read'
    if store.read(probe) != data:
      raise StoreError('E-STORE-008', f'{store.join(probe)} read back different bytes',
                       'the store does not keep what it is given')
    stage = 'delete'
    store.delete(probe)
    if unclear is not None:
      stage = 'list'
      raise unclear
    stage = 'write'
    ignored = store.ignored_condition(probe) if conditions else None
    if ignored:
      raise UsageError(
          'E-STORE-014', f'{store.url} ignores conditional writes, so one writer per prefix cannot '
          'be enforced', f'use a store that honours them, or pass --remote_lease=off ({ignored})')
  except StoreError as e:
    if unclear is not None and e.kind == 'failed':
      e, stage = unclear, 'list'
    raise _access_error(store, stage, e) from None


def _access_error(store: Store, stage: str, e: StoreError) -> UsageError:
  """The one line for a probe that failed at `stage` with `e`: the URL, what, the store's own
  words (short) and the fix."""
  env = os.environ
  if store.scheme == 's3':
    endpoint_var = 'AWS_ENDPOINT_URL_S3' if env.get('AWS_ENDPOINT_URL_S3') else 'AWS_ENDPOINT_URL'
    endpoint = env.get(endpoint_var) or 'of S3'
    credentials = 'AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the AWS profile in use)'
  elif store.scheme == 'gs':
    endpoint_var = 'STORAGE_EMULATOR_HOST'
    endpoint = env.get('TENSORSTORE_GCS_HTTP_URL') or env.get(endpoint_var) or 'of GCS'
    credentials = ('the application default credentials (GOOGLE_APPLICATION_CREDENTIALS, or '
                   'gcloud auth application-default login)')
  else:
    endpoint_var, endpoint, credentials = 'the mount', store.prefix, 'the permissions of the path'
  code, what, fix = _ACCESS.get(e.kind) or _ACCESS['failed']  # a kind without its own line
  refused = e.kind == 'denied' or store.scheme == 'file' and e.kind == 'credentials'
  if refused and (stage != 'list' or store.scheme == 'file'):
    permission = _PERMISSION.get(store.scheme, {}).get(stage, f'{stage} access')
    code, what, fix = ('E-STORE-004', f'no permission to {stage} objects under the prefix',
                       f'grant the credentials {permission} on {store.url}')
  names = dict(
      bucket=store.bucket,
      url=store.url,
      endpoint=endpoint,
      endpoint_var=endpoint_var,
      credentials=credentials)
  what, fix = what.format(**names), fix.format(**names)
  # Without tensorstore's status code, retry count and [http_response_body='...'] payloads.
  lines = str(e.__cause__ or e.what).strip().splitlines()
  reason = re.sub(r'^([A-Z_]+: )+', '', lines[0].split(' [', 1)[0] if lines else '')
  reason = re.sub(r'^All \d+ retry attempts failed: ', '', reason).rstrip(': ').replace(';', ',')
  detail = f' ({stage}: {reason[:200]})' if reason else ''
  return UsageError(code, f'--remote={store.url}: {what}{detail}', fix)
