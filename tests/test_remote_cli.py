"""`jaxckpt inspect|verify|export|evaluate` take the URL of a remote run or checkpoint."""

import pytest
from conftest import assert_same_bytes, jaxckpt_cli
from safetensors.numpy import load_file

from jaxckpt.checkpoint.remote import Store, objects


@pytest.fixture(scope='module')
def remote_run(trainer, s3_server, tmp_path_factory):
  url = s3_server.bucket()
  workdir = tmp_path_factory.mktemp('run')
  r = trainer.train(workdir, '--config.train.steps=20', '--checkpoint_every=10', '--keep=0',
                    '--config.train.eval_every=10', f'--remote={url}')
  assert r.returncode == 0, r.stderr
  return url, workdir


def test_inspect_a_remote_run_shows_its_newest_checkpoint(remote_run):
  url, _ = remote_run
  r = jaxckpt_cli('inspect', url)
  assert r.returncode == 0, r.stderr
  assert f'checkpoint  {url}/checkpoints/step_00000020' in r.stdout
  assert 'step        20' in r.stdout
  older = jaxckpt_cli('inspect', f'{url}/checkpoints/step_00000010', '--json')
  assert older.returncode == 0 and '"step": 10' in older.stdout


def test_export_from_a_remote_checkpoint_matches_the_local_one(remote_run, tmp_path):
  url, workdir = remote_run
  for name, source in (('remote', url), ('local', f'{workdir}/checkpoints/step_00000020')):
    r = jaxckpt_cli('export', source, '--format=safetensors', f'--out={tmp_path / name}')
    assert r.returncode == 0, r.stderr
  assert_same_bytes(
      load_file(tmp_path / 'remote' / 'model.safetensors'),
      load_file(tmp_path / 'local' / 'model.safetensors'))


def test_evaluate_a_remote_run(remote_run):
  url, _ = remote_run
  r = jaxckpt_cli('evaluate', f'--workdir={url}', timeout=300)
  assert r.returncode == 0, r.stderr
  assert 'step 10' in r.stdout and 'step 20' in r.stdout


def test_verify_reads_every_remote_byte(remote_run, s3_server):
  url, _ = remote_run
  r = jaxckpt_cli('verify', url)
  assert r.returncode == 0, r.stdout + r.stderr
  assert r.stdout.splitlines() == [f'OK {url}/checkpoints/step_{s:08d}' for s in (10, 20)]
  store = Store(url)
  key = objects.object_key(store, 10, 'state/process_0.safetensors')
  data = bytearray(store.read(key))
  data[-5] ^= 0x10
  store.write(key, bytes(data))
  r = jaxckpt_cli('verify', url)
  assert r.returncode == 1
  assert r.stdout.splitlines()[0].startswith(f'FAIL {url}/checkpoints/step_00000010: '
                                             'state/process_0.safetensors: checksum mismatch')
  assert r.stdout.splitlines()[1] == f'OK {url}/checkpoints/step_00000020'


def test_a_url_that_names_nothing_is_a_usage_error_as_a_local_path_is(remote_run, tmp_path):
  url, _ = remote_run
  # A checkpoint the run does not hold: E-CKPT-010, exit 2, as for a local path.
  r = jaxckpt_cli('verify', f'{url}/checkpoints/step_00000099')
  assert r.returncode == 2 and r.stdout == '', r.stdout + r.stderr
  assert r.stderr.strip() == (f'jaxckpt: E-CKPT-010: {url}/checkpoints/step_00000099 is not a '
                              'checkpoint: the store holds no object under it; pass the URL of a '
                              "checkpoint the run holds, or the run's")
  # A mounted path whose disk is not there, whatever the command: one line, exit 2.
  missing = f'file://{tmp_path}/not-mounted/run'
  for args in (('inspect', missing), ('verify', missing), ('export', missing, '--format=hf',
                                                           f'--out={tmp_path / "hf"}')):
    r = jaxckpt_cli(*args)
    assert r.returncode == 2, (args, r.stderr)
    assert r.stderr.strip() == (f'jaxckpt: E-STORE-002: {tmp_path}/not-mounted does not exist; '
                                'mount the disk it is on, or create that directory'), r.stderr
  assert not (tmp_path / 'hf').exists()
  # A URL without a bucket is one, not a local path named `s3:`.
  for args in (('inspect', 's3://'), ('verify', 'gs:///')):
    r = jaxckpt_cli(*args)
    assert r.returncode == 2, (args, r.stderr)
    scheme = args[1][:5]
    assert r.stderr.strip().endswith(
        f'E-STORE-001: {scheme}: no bucket named; use {scheme}bucket/prefix'), r.stderr


def test_a_checkpoint_without_its_manifest_fails_naming_it_once(remote_run):
  url, _ = remote_run
  store = Store(url)
  step = f'{url}/checkpoints/step_00000020'
  manifest = objects.object_key(store, 20, 'manifest.json')
  body = store.read(manifest)
  store.delete(manifest)
  try:
    r = jaxckpt_cli('verify', step)
  finally:
    store.write(manifest, body)
  assert r.returncode == 1, r.stdout + r.stderr
  [line] = r.stdout.splitlines()
  assert line.startswith(f'FAIL {step}: ') and line.count(step) == 1, line
