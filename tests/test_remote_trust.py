"""What a bucket says is never trusted, and a start never fakes what the remote holds: against
moto's S3 server on loopback.

- A tampered `remote.json` (record names that are absolute or climb out with `..`, a part size
  of 0 or 1, a record larger than its object) is refused with one line, E-STORE-012 (the
  checkpoint is not intact; readers take an older one): no file written outside the target, no
  traceback, `jaxckpt verify` exit 1.
- A fresh machine whose remote holds committed checkpoints, none intact, is refused
  (E-RESUME-004, exit 2), as is `--resume=none` against a remote that holds any (E-RESUME-001).
- After `--resume=PATH` to an older step, the remote's newer steps are another history's: the
  stop line and status.json never call the step reached durable before this run uploads it.
- A newest local checkpoint that fails its checksums while the remote holds the same step
  intact: the run resumes from that step, downloaded, not from an older local one.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (REPO, call_cli, committed_steps, events_of, flip_a_data_byte, jaxckpt_cli,
                      read_events, wait_for)

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, layout
from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.checkpoint.remote import Store, objects
from jaxckpt.records.runlog import read_status

META = 'checkpoints/step_00000002/remote.json'
LOSS = b'{"step": 1, "loss": 2.5}\n' * 40


# ----------------------------------------------------------------- the library's own download
@pytest.fixture(scope='module')
def local_checkpoint(tmp_path_factory):
  root = tmp_path_factory.mktemp('local') / 'checkpoints'
  rng = np.random.default_rng(0)
  with CheckpointManager(root, CheckpointOptions(every_steps=1, keep=0)) as mgr:
    for step in (1, 2):
      mgr.save(step, {'w': jnp.asarray(rng.standard_normal(300_000, dtype=np.float32))},
               {'step': step})
  return root


@pytest.fixture
def uploaded(s3_server, local_checkpoint):
  """A bucket holding steps 1 and 2 (step 2's state file in parts, a loss history beside)."""
  store = Store(s3_server.bucket())
  for step in (1, 2):
    objects.upload(
        store,
        local_checkpoint / layout.step_dirname(step), {'loss.jsonl': LOSS},
        part_bytes=256 << 10)
  return store


def _tamper(store: Store, change) -> dict:
  meta = json.loads(store.read(META))
  change(meta, store)
  store.write(META, json.dumps(meta).encode())
  return meta


def _record(name: str):
  """A record named `name` beside the loss history, its object there with the size and CRC-32
  remote.json says: only the name is wrong."""

  def change(meta, store):
    meta['records'][name] = dict(meta['records']['loss.jsonl'])
    bucket, prefix = store.bucket, store.prefix
    key = f'{prefix}/checkpoints/step_00000002/{meta["attempt"]}/run/{name}'
    import boto3
    boto3.client(
        's3', endpoint_url=os.environ['AWS_ENDPOINT_URL'], region_name='us-east-1').put_object(
            Bucket=bucket, Key=key, Body=LOSS)

  return change


def _part_bytes(n: int):
  return lambda meta, store: meta.update(part_bytes=n)


def _record_size(extra: int):
  return lambda meta, store: meta['records']['loss.jsonl'].update(size=len(LOSS) + extra)


def _outside(tmp_path: Path) -> Path:
  return tmp_path / 'outside' / f'escaped-{uuid.uuid4().hex[:8]}'


# (id, the change, what the line says, whether it shows without reading data: `latest_intact`
# passes over it; else the download, which reads the record, finds it).
CASES = [
    ('absolute record name', lambda out: _record(str(out)), 'an absolute path', True),
    ('.. record name', lambda out: _record(f'../../../outside/{out.name}'), 'leaves its directory',
     True),
    ('part_bytes 0', lambda out: _part_bytes(0), 'part_bytes 0 is not within', True),
    ('part_bytes 1', lambda out: _part_bytes(1), 'part_bytes 1 is not within', True),
    ('part_bytes a string', lambda out: _part_bytes('1'), "part_bytes '1' is not within", True),
    ('a record larger than its object', lambda out: _record_size(1000), 'does not match', False),
    ('a record size of a TiB', lambda out: _record_size(1 << 40), 'a malformed size', True),
]


def _cli(in_process: bool, capsys, *args: str) -> tuple[int, str, str]:
  """(exit code, stdout, stderr) of `jaxckpt ARGS...`: in this process (`call_cli`), or as the
  real command in a subprocess of its own."""
  if in_process:
    return call_cli(list(args), capsys)
  r = jaxckpt_cli(*args)
  return r.returncode, r.stdout, r.stderr


# The first case runs `verify` and `inspect` as real commands; the others in this process: the
# same code and exit paths, without two interpreter start-ups each.
@pytest.mark.parametrize('name, case, said, listed', CASES, ids=[c[0] for c in CASES])
def test_a_tampered_commit_is_refused_in_one_line(uploaded, tmp_path, capsys, name, case, said,
                                                  listed):
  out = _outside(tmp_path)
  out.parent.mkdir()
  target = tmp_path / 'deep' / 'er' / 'fresh'
  _tamper(uploaded, case(out))
  with pytest.raises(CheckpointError) as e:
    objects.download(uploaded, 2, target)
  assert e.value.code == 'E-STORE-012', e.value.line()
  assert said in e.value.what, e.value.what
  assert len(e.value.line().splitlines()) == 1
  assert list(out.parent.iterdir()) == []  # nothing written outside the target
  assert not target.exists() or list(target.iterdir()) == []  # nor a half-written step there
  assert objects.latest_intact(uploaded)[0] == (1 if listed else 2)  # readers pass over it
  # The command line: one FAIL line, exit 1, no traceback.
  in_process = name != CASES[0][0]
  capsys.readouterr()  # what the download logged is not the command's
  code, stdout, stderr = _cli(in_process, capsys, 'verify',
                              f'{uploaded.url}/checkpoints/step_00000002')
  assert code == 1, stdout + stderr
  assert 'Traceback' not in stderr, stderr
  assert stdout.splitlines() == [stdout.splitlines()[0]]
  assert stdout.startswith(f'FAIL {uploaded.url}/checkpoints/step_00000002: '), stdout
  # `inspect` reads no data: it shows the checkpoint with what is wrong with its commit.
  code, stdout, stderr = _cli(in_process, capsys, 'inspect',
                              f'{uploaded.url}/checkpoints/step_00000002')
  assert code == 0 and 'Traceback' not in stderr, stderr
  assert not listed or said in stdout, stdout
  assert list(out.parent.iterdir()) == []


def test_a_part_size_of_one_byte_is_refused_before_anything_is_allocated(uploaded):
  """Not a problem line per byte of the file: the part size is refused once."""
  _tamper(uploaded, _part_bytes(1))
  problems = objects.inspect(uploaded, 2)[3]
  assert len(problems) == 1 and 'part_bytes 1' in problems[0], problems[:3]


@pytest.mark.parametrize('name', ['absolute', 'dotdot'])
def test_evaluate_writes_no_record_outside_its_directory(uploaded, tmp_path, name):
  """`jaxckpt evaluate --workdir=s3://...` downloads the run into a temporary directory: a record
  name from the bucket never takes a file out of it."""
  scratch = tmp_path / 'tmp'
  scratch.mkdir()
  out = tmp_path / f'escaped-{name}'
  # mkdtemp makes scratch/jaxckpt-remote-XXXX: '..' once climbs to scratch, twice to tmp_path.
  _tamper(uploaded, _record(str(out) if name == 'absolute' else f'../../{out.name}'))
  r = subprocess.run([sys.executable, '-m', 'jaxckpt.cli', 'evaluate', f'--workdir={uploaded.url}'],
                     cwd=REPO,
                     capture_output=True,
                     text=True,
                     timeout=300,
                     env=dict(os.environ, TMPDIR=str(scratch)))
  assert not out.exists(), 'a record was written outside the temporary directory'
  assert 'Traceback' not in r.stderr, r.stderr
  assert 'passing over remote step 2: E-STORE-012: ' in r.stdout, r.stdout + r.stderr
  assert list(scratch.iterdir()) == []  # and the temporary directory is gone


# ------------------------------------------------------------------ the trainer's start-up
RUN = ('--checkpoint_every=10', '--keep=0', '--config.train.log_every=1')


@pytest.fixture(scope='module')
def run20(trainer, s3_server, tmp_path_factory):
  """A run of 20 steps with --remote: (its URL, its workdir) with steps 10 and 20 in both."""
  url = s3_server.bucket()
  workdir = tmp_path_factory.mktemp('run20')
  r = trainer.train(workdir, '--config.train.steps=20', *RUN, f'--remote={url}')
  assert r.returncode == 0, r.stderr
  assert sorted(objects.committed(Store(url))) == [10, 20] == committed_steps(workdir)
  return url, workdir


def _clone(s3_server, url: str) -> str:
  """A copy of the remote run `url` in a bucket of its own, object by object."""
  new = s3_server.bucket()
  src, dst = Store(url), Store(new)
  for key in src.list():
    dst.write(key, src.read(key))
  return new


def _workdir_copy(workdir: Path, tmp_path: Path) -> Path:
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy)
  (copy / 'LOCK').unlink(missing_ok=True)
  return copy


def test_a_fresh_machine_over_a_remote_with_no_intact_checkpoint_is_refused(
    trainer, s3_server, run20, tmp_path):
  url = _clone(s3_server, run20[0])
  store = Store(url)
  for step in (10, 20):  # every remote checkpoint fails its CRC-32s
    key = objects.object_key(store, step, 'state/process_0.safetensors')
    data = bytearray(store.read(key))
    data[len(data) // 2] ^= 1
    store.write(key, bytes(data))
  fresh = tmp_path / 'fresh'
  r = trainer.train(fresh, '--config.train.steps=20', *RUN, f'--remote={url}')
  assert r.returncode == 2, r.stderr[-3000:]
  line = r.stderr.strip().splitlines()[-1]
  assert line.startswith(f'jaxckpt: E-RESUME-004: none of the 2 committed checkpoint(s) in '
                         f'--remote={url} is intact (newest: step 20: '), line
  assert line.endswith(f'; see `jaxckpt verify {url}`; restore the objects, or start over with a '
                       'new --remote prefix'), line
  assert 'Traceback' not in r.stderr
  assert committed_steps(fresh) == [] and events_of(fresh, 'started') == []
  assert sorted(objects.committed(store)) == [10, 20]  # and nothing there was replaced


def test_resume_none_against_a_remote_that_holds_checkpoints_is_refused(trainer, run20, tmp_path):
  url = run20[0]
  fresh = tmp_path / 'fresh'
  r = trainer.train(fresh, '--config.train.steps=20', *RUN, f'--remote={url}', '--resume=none')
  assert r.returncode == 2, r.stderr[-3000:]
  line = r.stderr.strip().splitlines()[-1]
  assert line.startswith(f'jaxckpt: E-RESUME-001: --resume=none but --remote={url} already holds '
                         'committed checkpoints (steps 10..20)'), line
  assert 'Traceback' not in r.stderr
  assert committed_steps(fresh) == [] and events_of(fresh, 'started') == []


def test_a_resume_to_an_older_step_is_durable_only_at_its_own_step(trainer, s3_server, run20,
                                                                   tmp_path):
  """--resume=PATH of step 10 with nothing left to train: the run ends at step 10, and step 10
  (there as it is) is what the line calls durable, not the remote's newer step 20."""
  url = _clone(s3_server, run20[0])
  workdir = _workdir_copy(run20[1], tmp_path)
  r = trainer.train(workdir, '--config.train.steps=10', *RUN, f'--remote={url}',
                    f'--resume={workdir}/checkpoints/step_00000010')
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'step 20 is durable' not in r.stderr
  assert f'jaxckpt: step 10 is durable in {url}/checkpoints/step_00000010' in r.stderr, r.stderr
  status = read_status(workdir)
  assert (status['remote_step'], status['remote_lag_steps']) == (10, 0), status


def test_a_stop_after_a_resume_to_an_older_step_claims_nothing_not_uploaded(
    trainer, s3_server, run20, tmp_path):
  """SIGTERM between steps 10 and 20 after --resume=PATH of step 10, with no time to upload the
  step reached (--stop_grace_secs=0): the remote holds a step 20, of another history."""
  url = _clone(s3_server, run20[0])
  workdir = _workdir_copy(run20[1], tmp_path)
  proc = trainer.start(workdir, '--config.train.steps=100000', '--checkpoint_every=100000',
                       '--keep=0', '--config.train.log_every=1', f'--remote={url}',
                       '--stop_grace_secs=0', f'--resume={workdir}/checkpoints/step_00000010')
  wait_for(
      lambda: 12 <= read_status(workdir).get('step', 0) < 20 and read_status(workdir).get('state')
      == 'running', proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
  stopped = events_of(workdir, 'interrupted')[-1]['step']
  assert 10 < stopped < 20, stopped
  assert 'is durable' not in out, out[-3000:]
  assert f'jaxckpt: step {stopped} is committed locally only' in out, out[-3000:]
  assert 'holds step 10' in out.split(f'step {stopped} is committed locally only')[1].split('\n')[0]
  # The upload in flight may land while the process exits: status.json then says so, and only
  # when the remote holds this run's very checkpoint of that step.
  status = read_status(workdir)
  remote = status['remote_step']
  assert remote in (None, 10) or remote == stopped and objects.holds(
      Store(url), workdir / 'checkpoints' / f'step_{stopped:08d}'), status
  assert not events_of(workdir, 'remote_final')[-1]['durable']


def test_a_rotted_local_copy_is_replaced_by_the_intact_remote_one(trainer, s3_server, run20,
                                                                  tmp_path):
  url = _clone(s3_server, run20[0])
  workdir = _workdir_copy(run20[1], tmp_path)
  flip_a_data_byte(workdir / 'checkpoints' / 'step_00000020')
  r = trainer.train(workdir, '--config.train.steps=30', *RUN, f'--remote={url}')
  assert r.returncode == 0, r.stderr[-3000:]
  assert [e['step'] for e in events_of(workdir, 'resumed')][-1] == 20  # not 10
  fetched = events_of(workdir, 'fetched')
  assert [e['step'] for e in fetched] == [20], fetched
  assert sorted(objects.committed(Store(url))) == [10, 20, 30]
  verify = jaxckpt_cli('verify', url)  # every remote checkpoint intact, step 20 too
  assert verify.returncode == 0, verify.stdout
  local = jaxckpt_cli('verify', str(workdir))
  assert local.returncode == 0, local.stdout


def test_a_rotted_local_copy_newer_than_the_remote_is_never_uploaded(trainer, s3_server, run20,
                                                                     tmp_path):
  """The remote holds step 10 only; the local step 20 fails its CRC-32s: its upload stops at
  the damage with one line (E-STORE-013), and the run replays from step 10."""
  url = _clone(s3_server, run20[0])
  store = Store(url)
  objects.delete(store, 20)
  workdir = _workdir_copy(run20[1], tmp_path)
  flip_a_data_byte(workdir / 'checkpoints' / 'step_00000020')
  r = trainer.train(workdir, '--config.train.steps=30', *RUN, f'--remote={url}')
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'Traceback' not in r.stderr
  damaged = [line for line in r.stderr.splitlines() if 'E-STORE-013' in line]
  assert len(damaged) <= 1, damaged  # one line, if the upload got to it before the replay
  assert [e['step'] for e in events_of(workdir, 'resumed')][-1] == 10
  events = read_events(workdir)
  events = events[max(i for i, e in enumerate(events) if e['event'] == 'remote'):]  # this start
  resumed_at = [e['event'] for e in events].index('resumed')
  assert not [e for e in events[:resumed_at] if e['event'] == 'uploaded' and e['step'] == 20]
  assert [e['step'] for e in events if e['event'] == 'uploaded'][0] == 10  # there as it is
  assert sorted(objects.committed(store)) == [10, 20, 30]
  verify = jaxckpt_cli('verify', url)  # step 20 went up from the replay, intact
  assert verify.returncode == 0, verify.stdout
