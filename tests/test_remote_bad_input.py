"""Bad `--remote` input to `python -m jaxckpt.main`, against real servers on loopback: an unknown
scheme, a missing bucket, wrong credentials, no write permission, an endpoint that refuses
connections. Each is one line `jaxckpt: E-STORE-00N: --remote=URL: what; fix`, exit 2, no
traceback, before step 1: nothing compiled or trained, nothing left in the store.

Credentials are checked by a second moto server, in its own process, with IAM enforced: its first
requests (`INITIAL_NO_AUTH_ACTION_COUNT`) go unchecked, enough to make a bucket and a read-only
user; after that every request must be signed by a key it issued.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import free_port

RUN = ('--config.train.steps=5', '--checkpoint_every=1')
REGION = 'us-east-1'
# Listing and reading only. `s3:List*`, not `s3:ListBucket` alone: moto 5.2.6 checks a listing
# against the operation's name (`s3:ListObjectsV2`) where AWS checks `s3:ListBucket`.
READ_ONLY = {
    'Version':
        '2012-10-17', 'Statement': [{
            'Effect': 'Allow', 'Action': ['s3:List*', 's3:GetObject'],
            'Resource': ['arn:aws:s3:::guarded', 'arn:aws:s3:::guarded/*']
        }]
}


class IamS3Server:
  """`python -m moto.server` with IAM authentication: bucket `guarded`, and `reader`'s key."""

  SETUP_REQUESTS = 4  # create_bucket, create_user, put_user_policy, create_access_key

  def __init__(self):
    self.port = free_port()
    self.endpoint = f'http://127.0.0.1:{self.port}'
    self.proc = subprocess.Popen(
        [sys.executable, '-m', 'moto.server', '-H', '127.0.0.1', '-p',
         str(self.port)],
        env=dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(self.SETUP_REQUESTS)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
      self._set_up()
    except BaseException:
      self.stop()
      raise

  def _set_up(self) -> None:
    deadline = time.monotonic() + 30
    while True:  # a bare connect: an HTTP request could count as one of the unchecked ones
      try:
        socket.create_connection(('127.0.0.1', self.port), timeout=1).close()
        break
      except OSError:
        assert self.proc.poll() is None and time.monotonic() < deadline, 'moto did not start'
        time.sleep(0.1)
    admin = dict(aws_access_key_id='setup', aws_secret_access_key='setup')
    self.client('s3', **admin).create_bucket(Bucket='guarded')
    iam = self.client('iam', **admin)
    iam.create_user(UserName='reader')
    iam.put_user_policy(
        UserName='reader', PolicyName='read-only', PolicyDocument=json.dumps(READ_ONLY))
    key = iam.create_access_key(UserName='reader')['AccessKey']
    self.reader = {
        'AWS_ACCESS_KEY_ID': key['AccessKeyId'], 'AWS_SECRET_ACCESS_KEY': key['SecretAccessKey']
    }

  def client(self, service: str, **keys):
    import boto3
    return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION, **keys)

  def env(self, keys: dict) -> dict:
    return {'AWS_ENDPOINT_URL': self.endpoint, 'AWS_REGION': REGION, **keys}

  def stop(self) -> None:
    self.proc.terminate()
    self.proc.wait(timeout=10)


@pytest.fixture(scope='module')
def iam_s3_server():
  server = IamS3Server()
  try:
    from botocore.exceptions import ClientError
    with pytest.raises(ClientError, match='InvalidAccessKeyId'):  # IAM is enforced now
      server.client('s3', aws_access_key_id='setup', aws_secret_access_key='x').list_buckets()
    yield server
  finally:
    server.stop()


BOGUS = {'AWS_ACCESS_KEY_ID': 'AKIAIOSFODNN7BOGUSKEY', 'AWS_SECRET_ACCESS_KEY': 'bogus/secret'}
STATIC = {'AWS_ACCESS_KEY_ID': 'testing', 'AWS_SECRET_ACCESS_KEY': 'testing', 'AWS_REGION': REGION}


def unknown_scheme(request):
  return 'az://container/run', {}


def s3_missing_bucket(request):
  return 's3://no-such-bucket/run', request.getfixturevalue('s3_server').env


def s3_wrong_credentials(request):
  return 's3://guarded/run', request.getfixturevalue('iam_s3_server').env(BOGUS)


def s3_read_only(request):
  server = request.getfixturevalue('iam_s3_server')
  return 's3://guarded/run', server.env(server.reader)


def s3_refused(request):
  return 's3://some-bucket/run', {'AWS_ENDPOINT_URL': f'http://127.0.0.1:{free_port()}', **STATIC}


def _gcs_env(host: str) -> dict:
  # TENSORSTORE_GCS_HTTP_URL too: the store sets it from STORAGE_EMULATOR_HOST in this process.
  return {'STORAGE_EMULATOR_HOST': host, 'TENSORSTORE_GCS_HTTP_URL': host}


def gs_missing_bucket(request):
  return 'gs://no-such-bucket/run', _gcs_env(
      request.getfixturevalue('gcs_server').env['STORAGE_EMULATOR_HOST'])


def gs_refused(request):
  return 'gs://some-bucket/run', _gcs_env(f'http://127.0.0.1:{free_port()}')


# (id, case, code, what the line must say besides the URL: its fix).
CASES = [
    ('unknown scheme', unknown_scheme, 'E-STORE-001', 'use s3://bucket/prefix, gs://bucket/prefix'),
    ('s3 missing bucket', s3_missing_bucket, 'E-STORE-002', 'create it, or fix the bucket name'),
    ('s3 wrong credentials', s3_wrong_credentials, 'E-STORE-003',
     'check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY'),
    ('s3 no write permission', s3_read_only, 'E-STORE-004',
     'grant the credentials s3:PutObject on s3://guarded/run'),
    ('s3 connection refused', s3_refused, 'E-STORE-005', 'check AWS_ENDPOINT_URL and the network'),
    ('gs missing bucket', gs_missing_bucket, 'E-STORE-002', 'create it, or fix the bucket name'),
    ('gs connection refused', gs_refused, 'E-STORE-005',
     'check STORAGE_EMULATOR_HOST and the network'),
]


@pytest.mark.parametrize('case, code, fix', [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_remote_is_one_line_exit_2_before_step_1(trainer, tmp_path, request, case, code, fix):
  url, env = case(request)
  workdir = tmp_path / 'run'
  r = trainer.train(workdir, *RUN, f'--remote={url}', env=env, timeout=120)
  assert r.returncode == 2, r.stderr
  assert 'Traceback' not in r.stderr, r.stderr
  lines = r.stderr.strip().splitlines()
  line = lines[-1]
  assert line.startswith(f'jaxckpt: {code}: --remote={url}: '), line
  assert f'; {fix}' in line, line
  assert [x for x in lines if x.startswith('jaxckpt:')] == [line]
  # Before step 1, before any compile: nothing written; the workdir it made is gone again.
  assert not workdir.exists(), sorted(workdir.rglob('*'))


def test_a_refused_write_leaves_nothing_in_the_store(trainer, tmp_path, iam_s3_server):
  r = trainer.train(
      tmp_path / 'run',
      *RUN,
      '--remote=s3://guarded/run',
      env=iam_s3_server.env(iam_s3_server.reader))
  assert r.returncode == 2, r.stderr
  reader = iam_s3_server.client(
      's3',
      aws_access_key_id=iam_s3_server.reader['AWS_ACCESS_KEY_ID'],
      aws_secret_access_key=iam_s3_server.reader['AWS_SECRET_ACCESS_KEY'])
  assert reader.list_objects_v2(Bucket='guarded').get('KeyCount') == 0  # no probe, no lease
