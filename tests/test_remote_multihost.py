"""--remote with 2 real jax.distributed processes: each checks access and uploads its own part of
each checkpoint, process 0 holds the lease and commits once every part is there. On one shared
workdir or on each host's own disk, a fresh start resumes from the remote, bit-exactly."""

import json
import shutil
import signal
import time
from pathlib import Path

import pytest
from conftest import (REPO, TWO_PROCESS_FLAGS, assert_same_bytes, committed_steps, events_of,
                      finish_processes, losses, remote_steps, start_trainers, train_all, wait_for)

from jaxckpt.checkpoint.formats import read_host_arrays
from jaxckpt.checkpoint.remote import Store, objects

FLAGS = TWO_PROCESS_FLAGS  # 60 steps, a checkpoint every 5, log every 5


def _launch(cache, workdir, *flags):
  return start_trainers(cache, workdir, 2, *FLAGS, *flags)


def _train(cache, workdir, *flags):
  return train_all(cache, workdir, 2, *FLAGS, *flags)


def _arrays(workdir, step):
  return read_host_arrays(Path(workdir) / 'checkpoints' / f'step_{step:08d}')


@pytest.fixture(scope='module')
def straight(straight_two_processes) -> Path:
  """The run of FLAGS never stopped, on 2 processes and one workdir: the session's
  (tests/test_multihost_trainer.py compares with it too). Read only."""
  return straight_two_processes[0]


def _kill_when_uploaded(procs, store, at_least: int = 20) -> int:
  """SIGKILL every process once the remote holds step `at_least`; the newest remote step."""
  wait_for(lambda: any(s >= at_least for s in remote_steps(store)), procs[0], timeout=180)
  for p in procs:
    p.kill()
  finish_processes(procs)
  at_kill = max(remote_steps(store))
  assert at_kill < 60, 'the run finished before it could be killed'
  # Both parts under the one attempt process 0 named and committed.
  keys = store.list(objects.object_key(store, at_kill, 'state/'))
  assert {k.rsplit('/', 1)[1].split('.')[0] for k in keys} == {'process_0', 'process_1'}
  assert {k.split('/')[2] for k in store.list(f'checkpoints/step_{at_kill:08d}/')
         } == {objects.REMOTE_META, keys[0].split('/')[2]}
  wait_for(lambda: store.read('LEASE') is None or _stale(store, 2))
  return at_kill


@pytest.mark.slow  # a fresh machine's download: tests/test_remote_training.py (one process); every
# host's, then the resume across processes: the own-disk test's fallback, below
def test_two_processes_resume_from_the_remote_on_a_fresh_workdir(tmp_path, compile_cache, s3_server,
                                                                 straight):
  url = s3_server.bucket()
  store = Store(url)
  first = tmp_path / 'first'
  at_kill = _kill_when_uploaded(
      _launch(compile_cache, first, f'--remote={url}', '--remote_lease_secs=2'), store)
  shutil.rmtree(first)

  fresh = tmp_path / 'fresh'
  results = _train(compile_cache, fresh, f'--remote={url}')
  assert 'uploaded its part of step 60' in results[1][1], results[1][1][-3000:]
  # Process 0 downloads while it compiles its first step, and has nothing left to compile after;
  # process 1 compiles while it waits for that download (or, had it looked once the download was
  # in, beside its restore): once either way.
  (_, out0), (_, out1) = results
  assert f'fetching step {at_kill} from {url} ' in out0 and 'while the train step compiles' in out0
  assert 'compiling the train step' not in out0
  waiting = f'compiling the train step while process 0 fetches step {at_kill}'
  assert (waiting in out1) + ('compiling the train step while the checkpoint is read' in out1) == 1
  assert [e['step'] for e in events_of(fresh, 'fetched')] == [at_kill]
  assert [e['step'] for e in events_of(fresh, 'resumed')] == [at_kill]
  assert_same_bytes(_arrays(fresh, 60), _arrays(straight, 60))
  assert losses(fresh) == losses(straight)
  assert remote_steps(store)[-1] == 60


def test_on_each_host_own_disk_each_uploads_its_part_and_new_hosts_read_theirs(
    tmp_path, compile_cache, s3_server, straight):
  url = s3_server.bucket()
  store = Store(url)
  hosts = [tmp_path / 'host0', tmp_path / 'host1']
  at_kill = _kill_when_uploaded(
      _launch(compile_cache, tmp_path / 'host{k}', f'--remote={url}', '--remote_lease_secs=2'),
      store)
  # Neither host ever held the other's part: process 1's part reached the store from host 1.
  for k, host in enumerate(hosts):
    assert list(host.rglob(f'process_{1 - k}.safetensors')) == []
    assert list(host.rglob(f'process_{k}.safetensors'))

  files = objects.inspect(store, at_kill)[1]['files']  # (remote retention removes it later)
  sizes = [files[f'state/process_{p}.safetensors']['size'] for p in (0, 1)]
  for host in hosts:  # both VMs are replaced: their disks go with them
    shutil.rmtree(host)
  results = _train(compile_cache, tmp_path / 'host{k}', f'--remote={url}')
  assert 'uploaded its part of step 60' in results[1][1], results[1][1][-3000:]
  resumed = events_of(hosts[0], 'resumed')[-1]
  assert resumed['step'] == at_kill
  assert [e['step'] for e in events_of(hosts[0], 'fetched')] == [at_kill]
  # Each process read its own part from the remote and no more (half the state each): every
  # byte once in the job; what else its devices need came from the other over the collectives.
  assert [s['remote'] for s in resumed['sources']['processes']] == sizes
  assert remote_steps(store)[-1] == 60
  whole = objects.download(store, 60, tmp_path / 'downloaded')[0]
  assert_same_bytes(read_host_arrays(whole), _arrays(straight, 60))
  assert losses(hosts[0]) == losses(straight)

  # Fresh machines again, and the remote's newest fails its CRC-32 where process 1 reads its
  # part: every process stops that restore together, then every host takes the newest intact.
  older = remote_steps(store)[-2]
  key = objects.object_key(store, 60, 'state/process_1.safetensors')
  data = bytearray(store.read(key))
  data[len(data) // 2] ^= 1
  store.write(key, bytes(data))
  for host in hosts:
    shutil.rmtree(host)
  results = _train(compile_cache, tmp_path / 'host{k}', f'--remote={url}')
  for _, out in results:
    assert 'E-CKPT-016' in out and 'passing over remote step 60: E-STORE-012' in out, out[-3000:]
  assert events_of(hosts[0], 'resumed')[-1]['step'] == older
  assert losses(hosts[0]) == losses(straight)


# On PYTHONPATH as `sitecustomize`: process 1's os._exit takes 2 s, as on a loaded machine.
_SLOW_EXIT = """import os, sys, time
if '--process_id=1' in sys.argv:
  _exit = os._exit
  os._exit = lambda code: (time.sleep(2), _exit(code))
"""


def test_each_host_own_disk_without_remote_is_refused(tmp_path, compile_cache):
  # However slowly process 1 exits, it is not aborted (exit 134, a C++ stack) by process 0, which
  # holds the coordinator, exiting first: every process leaves the coordinator, together, first.
  (tmp_path / 'site').mkdir()
  (tmp_path / 'site' / 'sitecustomize.py').write_text(_SLOW_EXIT)
  procs = start_trainers(
      compile_cache,
      tmp_path / 'host{k}',
      2,
      *FLAGS,
      env={'PYTHONPATH': f'{tmp_path / "site"}:{REPO}'})
  for k, (code, out) in enumerate(finish_processes(procs, timeout=120)):
    assert code == 2 and 'E-DIST-007' in out and 'add --remote=URL' in out, (k, code, out[-3000:])
    assert 'Traceback' not in out and 'Check failure' not in out, out[-3000:]
    assert 'Fatal Python error' not in out
  assert not list(tmp_path.rglob('step_*'))


def test_a_lost_lease_stops_every_process_writing_to_the_prefix(tmp_path, compile_cache, s3_server):
  url = s3_server.bucket()
  store = Store(url)
  procs = _launch(compile_cache, tmp_path / 'run', f'--remote={url}', '--remote_lease_secs=2',
                  '--config.train.steps=100000', '--config.train.log_every=100000')
  try:
    wait_for(lambda: any(s >= 10 for s in remote_steps(store)), procs[0], timeout=180)
    other = {'id': 'other', 'host': 'elsewhere', 'pid': 1, 'started_at': time.time()}
    store.write('LEASE', json.dumps({**other, 'renewed_at': time.time()}).encode())
    wait_for(lambda: json.loads(store.read('LEASE')) and _lease_lost(tmp_path / 'run'), procs[0])
    taken = sorted(store.list('checkpoints/'))
    wait_for(lambda: _committed_locally(tmp_path / 'run') > _newest(taken) + 20, procs[0])
  finally:
    for p in procs:
      p.send_signal(signal.SIGTERM)
  results = finish_processes(procs)
  assert [code for code, _ in results] == [143, 143], results[1][1][-3000:]
  # Training went on, but no process wrote under the prefix after the lease was lost, beyond
  # the part of a step it was already sending.
  written = sorted(set(store.list('checkpoints/')) - set(taken))
  assert all(_step_of(k) <= _newest(taken) + 5 for k in written), written
  assert 'E-STORE-007: process 0 stopped the uploads' in results[1][1], results[1][1][-3000:]
  assert 'its part of step' in results[1][1] and 'is not uploaded' in results[1][1]
  assert json.loads(store.read('LEASE'))['id'] == 'other'


def _lease_lost(workdir) -> bool:
  return bool((workdir / 'events.jsonl').exists() and events_of(workdir, 'lease_lost'))


def _committed_locally(workdir) -> int:
  return max(committed_steps(workdir), default=0)


def _step_of(key: str) -> int:
  return int(key.split('/')[1][5:])


def _newest(keys) -> int:
  return max(_step_of(k) for k in keys)


def _stale(store, ttl) -> bool:
  return time.time() - json.loads(store.read('LEASE'))['renewed_at'] > ttl + 0.2
