"""What a store's error message says went wrong (`classify`): `StoreError.kind`, from which a
caller names the fix."""

from __future__ import annotations


def classify(message: str) -> str:
  """The `StoreError.kind` of a tensorstore error message: 'bad_url' (a bucket name the store
  cannot have), 'missing_bucket', 'unreachable', 'credentials' (a key or token the store does not
  know), 'denied' (known credentials without the permission), 'slow_down' (HTTP 503 or 429: the
  store asks for fewer requests), or 'failed'."""
  m = message.lower()
  if any(s in m for s in ("code='503'", "code='429'", 'slowdown', 'too many requests')):
    return 'slow_down'
  if 'invalidbucketname' in m or 'invalid' in m and 'bucket name' in m:
    return 'bad_url'
  if any(
      s in m for s in ('invalidaccesskeyid', 'signaturedoesnotmatch', 'unauthenticated', "'401'",
                       'expiredtoken', 'invalidtoken', 'invalid_grant', 'unrecognizedclient')):
    return 'credentials'
  if 'nosuchbucket' in m or 'bucket' in m and ('not found' in m or 'not exist' in m):
    return 'missing_bucket'
  if any(
      s in m for s in ('could not connect', 'connection refused', "couldn't connect",
                       'resolve host', 'curl error', 'timed out', 'timeout')):
    return 'unreachable'
  if any(
      s in m for s in ("'403'", 'permission_denied', 'accessdenied', 'access denied', 'forbidden',
                       'permission denied')):
    return 'denied'
  if "'404'" in m or 'not_found' in m:
    return 'missing_bucket'
  return 'failed'
