"""--replicas=1 on 3 real jax.distributed processes, each with its own workdir (`host{k}`) and
--remote on a moto server, every third checkpoint uploaded (--remote_every=3): every process is
SIGKILLed, a host's disk is wiped (a replacement VM), and the same command continues the run,
its lost part brought back from a peer, bit-identical to a run never stopped."""

import shutil
import signal
from pathlib import Path

import pytest
from conftest import (assert_same_bytes, committed_steps, events_of, finish_processes, losses,
                      remote_steps, start_trainers, train_all, wait_for)

from jaxckpt.checkpoint.formats import read_host_arrays
from jaxckpt.checkpoint.remote import Store, objects

COUNT = 3
FLAGS = ('--config.train.steps=40', '--checkpoint_every=5', '--config.train.log_every=5',
         '--config.train.batch_size=12')


def _launch(cache, workdir, *flags):
  return start_trainers(cache, workdir, COUNT, *FLAGS, *flags)


def _train(cache, workdir, *flags):
  return train_all(cache, workdir, COUNT, *FLAGS, *flags, timeout=300)


@pytest.fixture(scope='module')
def straight(tmp_path_factory, compile_cache) -> Path:
  """The run never stopped, on 3 processes and one workdir."""
  workdir = tmp_path_factory.mktemp('straight')
  _train(compile_cache, workdir)
  return workdir


def test_a_wiped_host_comes_back_from_its_peer_and_the_run_is_bit_identical(
    tmp_path, compile_cache, s3_server, straight):
  url = s3_server.bucket()
  store = Store(url)
  hosts = [tmp_path / f'host{k}' for k in range(COUNT)]
  tiers = (f'--remote={url}', '--replicas=1', '--remote_every=3', '--remote_lease_secs=2')
  procs = _launch(compile_cache, tmp_path / 'host{k}', *tiers)
  try:
    # Process 0 logs `uploaded` after the remote commit lands: wait for the log, not the bucket.
    wait_for(
        lambda: any(s >= 15 for s in remote_steps(store)) and events_of(hosts[0], 'uploaded'),
        procs[0],
        timeout=240)
  finally:
    for p in procs:
      p.send_signal(signal.SIGKILL)
  finish_processes(procs)
  # Each host kept its own part and the part of the process before it on the ring.
  newest = max(committed_steps(hosts[0]))
  for k, host in enumerate(hosts):
    names = {p.name for p in (host / 'checkpoints' / f'step_{newest:08d}' / 'state').iterdir()}
    assert names == {f'process_{k}.safetensors', f'process_{(k - 1) % COUNT}.safetensors'}

  shutil.rmtree(hosts[1])  # host 1's VM is replaced; hosts 0 and 2 keep their disks
  # Processes 1 and 2 uploaded their parts of the steps process 0 said: the first is 15, not 5.
  assert [e['step'] for e in events_of(hosts[0], 'uploaded')][:1] == [15]
  _train(compile_cache, tmp_path / 'host{k}', *tiers)
  resumed = events_of(hosts[0], 'resumed')[-1]
  sources = resumed['sources']['processes']
  assert resumed['step'] >= 15 and len(sources) == COUNT
  assert sources[1]['own'] == 0 and sources[1]['remote'] == 0 and sources[1]['peers'] > 0
  assert all(s['remote'] == 0 for s in sources)
  final = hosts[0] / 'checkpoints' / 'step_00000040'
  whole = objects.download(store, 40, tmp_path / 'downloaded')[0]
  assert_same_bytes(
      read_host_arrays(whole), read_host_arrays(straight / 'checkpoints' / final.name))
  assert losses(hosts[0]) == losses(straight)


def test_replicas_without_own_disks_or_a_remote_are_refused(tmp_path, compile_cache):
  results = finish_processes(
      _launch(compile_cache, tmp_path / 'shared', '--replicas=1'), timeout=120)
  for k, (code, out) in enumerate(results):
    assert code == 2 and 'E-CONFIG-010' in out and 'Traceback' not in out, (k, out[-3000:])
  assert not list(tmp_path.rglob('step_*'))
