"""--remote with 2 real jax.distributed processes on one shared workdir: process 0 checks access,
holds the lease and uploads each committed checkpoint (every process's file); a fresh shared
workdir resumes from the remote on both processes, bit-exactly."""

import shutil
import sys
from pathlib import Path

from conftest import (TINY, assert_same_bytes, events_of, finish_processes, losses, start_processes,
                      wait_for)
from jaxckpt.checkpoint.formats import read_host_arrays
from jaxckpt.checkpoint.remote import Store, StoreError, objects

FLAGS = ('--config.train.steps=60', '--checkpoint_every=5', '--config.train.log_every=5')


def _launch(cache, workdir, *flags):
  return start_processes(
      lambda k, coordinator: [
          sys.executable, '-m', 'jaxckpt.main', f'--config={TINY}', f'--workdir={workdir}', *FLAGS,
          *flags, f'--coordinator_address={coordinator}', '--num_processes=2', f'--process_id={k}'
      ],
      2,
      cache=cache)


def _train(cache, workdir, *flags):
  results = finish_processes(_launch(cache, workdir, *flags), timeout=240)
  for k, (code, out) in enumerate(results):
    assert code == 0, f'process {k} exited {code}:\n{out[-3000:]}'
  return results


def _remote_steps(store) -> list[int]:
  try:
    return sorted(objects.committed(store))
  except StoreError:
    return []


def _arrays(workdir, step):
  return read_host_arrays(Path(workdir) / 'checkpoints' / f'step_{step:08d}')


def test_two_processes_resume_from_the_remote_on_a_fresh_workdir(tmp_path, compile_cache,
                                                                 s3_server):
  url = s3_server.bucket()
  store = Store(url)
  _train(compile_cache, tmp_path / 'straight')
  first = tmp_path / 'first'
  procs = _launch(compile_cache, first, f'--remote={url}', '--remote_lease_secs=2')
  wait_for(lambda: any(s >= 20 for s in _remote_steps(store)), procs[0], timeout=180)
  for p in procs:
    p.kill()
  finish_processes(procs)
  at_kill = max(_remote_steps(store))
  assert at_kill < 60, 'the run finished before it could be killed'
  keys = store.list(f'checkpoints/step_{at_kill:08d}/state/')
  assert {k.rsplit('/', 1)[1].split('.')[0] for k in keys} == {'process_0', 'process_1'}
  shutil.rmtree(first)
  wait_for(lambda: store.read('LEASE') is None or _stale(store, 2))

  fresh = tmp_path / 'fresh'
  _train(compile_cache, fresh, f'--remote={url}')
  assert [e['step'] for e in events_of(fresh, 'fetched')] == [at_kill]
  assert [e['step'] for e in events_of(fresh, 'resumed')] == [at_kill]
  assert_same_bytes(_arrays(fresh, 60), _arrays(tmp_path / 'straight', 60))
  assert losses(fresh) == losses(tmp_path / 'straight')
  assert _remote_steps(store)[-1] == 60


def _stale(store, ttl) -> bool:
  import json
  import time
  return time.time() - json.loads(store.read('LEASE'))['renewed_at'] > ttl + 0.2
