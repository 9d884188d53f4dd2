"""End to end through `python -m jaxckpt.main --remote=URL` against real servers on loopback.

A VM that is lost takes its workdir with it: a fresh machine with an empty workdir and the same
--remote continues the run bit-exactly from the remote tier. A store that goes away never stops
training, and never shows a partial checkpoint as complete. One trainer per remote prefix.
"""

import json
import shutil
import signal
import threading
import time

import pytest
from conftest import (assert_same_bytes, checkpoint_arrays, committed_steps, events_of, jaxckpt_cli,
                      losses, remote_steps, wait_for)

from jaxckpt.checkpoint.errors import CheckpointError
from jaxckpt.checkpoint.remote import Store, StoreError, objects
from jaxckpt.checkpoint.remote import segments
from jaxckpt.records.runlog import read_status

STEPS = 160
RUN_FLAGS = (f'--config.train.steps={STEPS}', '--checkpoint_every=10',
             '--config.train.log_every=10', '--keep=2')


@pytest.fixture(scope='module')
def straight(trainer, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('straight')
  r = trainer.train(workdir, *RUN_FLAGS)
  assert r.returncode == 0, r.stderr
  return workdir


def _wait_until_stale(store, ttl: float) -> None:
  holder = json.loads(store.read('LEASE'))
  wait_for(lambda: time.time() - holder['renewed_at'] > ttl + 0.2)


# The GCS variant runs with -m slow: the trainer's remote logic is the same on every store, and
# tests/test_remote_store.py runs the store's own calls on the GCS emulator.
@pytest.mark.parametrize(
    'server', ['s3_server', pytest.param('gcs_server', marks=pytest.mark.slow)])
def test_a_fresh_machine_continues_from_the_remote_bit_exactly(trainer, straight, tmp_path, request,
                                                               server):
  url = request.getfixturevalue(server).bucket()
  store = Store(url)
  first_vm = tmp_path / 'vm1'
  exports = ('--config.export.every=10', '--config.export.formats=safetensors',
             '--config.export.keep=0')
  # The GCS emulator ignores conditional writes: no lease can be held there.
  lease = ('--remote_lease=off',) if server == 'gcs_server' else ('--remote_lease_secs=2',)
  proc = trainer.start(first_vm, *RUN_FLAGS, *exports, f'--remote={url}', *lease)
  wait_for(lambda: any(e['step'] >= 20 for e in events_of(first_vm, 'uploaded')), proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  at_kill = max(remote_steps(store))
  assert at_kill < STEPS, 'the run finished before it could be killed'
  # The lost VM's exports of steps before the one the next resumes from: never exported again.
  earlier = {k: store.read(k) for k in store.list('exports/') if _export_step(k) < at_kill}
  assert earlier, store.list('exports/')
  shutil.rmtree(first_vm)  # the VM and its disk are gone
  if server == 's3_server':
    _wait_until_stale(store, 2)  # the replacement comes up after the lost VM's lease lapsed

  off = lease if server == 'gcs_server' else ()
  again = trainer.train(tmp_path / 'vm2', *RUN_FLAGS, *exports, f'--remote={url}', *off)
  assert again.returncode == 0, again.stderr
  fresh = tmp_path / 'vm2'
  assert [e['step'] for e in events_of(fresh, 'fetched')] == [at_kill]
  assert [e['step'] for e in events_of(fresh, 'resumed')] == [at_kill]
  # The checkpoint came down while the first step compiled: nothing was left to compile after.
  assert f'fetching step {at_kill} from {url} ' in again.stderr
  assert 'while the train step compiles' in again.stderr
  assert 'compiling the train step' not in again.stderr
  assert_same_bytes(checkpoint_arrays(fresh, STEPS), checkpoint_arrays(straight, STEPS))
  assert losses(fresh) == losses(straight)  # the loss history came down with the checkpoint
  assert sorted(losses(fresh)) == list(range(1, STEPS + 1))
  assert f'step {STEPS} is durable in {url}/checkpoints/step_{STEPS:08d}' in again.stderr
  assert remote_steps(store)[-1] == STEPS
  assert len(remote_steps(store)) == 2  # remote retention follows --keep=2
  export = f'exports/step_{STEPS:08d}/model.safetensors'  # the exports went up too
  assert store.read(export) == (fresh / export).read_bytes()
  assert {k: store.read(k) for k in earlier} == earlier  # and the lost VM's are still there
  # The loss history and events went up by segment (records/): the last commit rebuilds them
  # byte for byte, and every segment the kept commits name is there (what they do not name is
  # removed a lease's time after a sweep first finds it: tests/test_remote_segments.py).
  _, records = objects.download(store, STEPS, tmp_path / 'check')
  for name in ('loss.jsonl', 'events.jsonl'):
    assert (fresh / name).read_bytes().startswith(records[name]), name
  assert b'"finished"' in records['events.jsonl']
  named = set().union(
      *(segments.named(objects.inspect(store, s)[2]['records']) for s in remote_steps(store)))
  assert named and named <= set(store.list('records/'))
  status = read_status(fresh)
  assert (status['remote_step'], status['remote_lag_steps'], status['remote_error']) == (STEPS, 0,
                                                                                         None)


def _export_step(key: str) -> int:
  return int(key.split('/')[1][5:])


def test_a_replayed_step_is_never_claimed_durable_before_it_is_uploaded(
    trainer, s3_server, tmp_path):
  """After --resume from an older checkpoint the remote's newer steps are another history's:
  a stop with the store down says the step is committed locally only."""
  url = s3_server.bucket()
  workdir = tmp_path / 'run'
  first = trainer.train(workdir, '--config.train.steps=300', '--checkpoint_every=100', '--keep=0',
                        f'--remote={url}')
  assert first.returncode == 0, first.stderr
  assert remote_steps(Store(url)) == [100, 200, 300]
  proc = trainer.start(workdir, f'--resume={workdir}/checkpoints/step_00000100',
                       '--config.train.steps=100000', '--checkpoint_every=100000', '--keep=0',
                       '--config.train.log_every=5', f'--remote={url}', '--stop_grace_secs=3')
  try:
    wait_for(lambda: 105 <= read_status(workdir).get('step', 0) < 250, proc)
    s3_server.stop()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
  finally:
    s3_server.start()
  assert proc.returncode == 128 + signal.SIGTERM, out
  stopped = events_of(workdir, 'interrupted')[-1]['step']
  assert 100 < stopped < 300, stopped  # a step the remote holds too, from the run before
  assert f'step {stopped} is durable' not in out
  assert f'jaxckpt: step {stopped} is committed locally only' in out, out[-3000:]
  assert not events_of(workdir, 'remote_final')[-1]['durable']


def test_a_store_that_goes_away_never_stops_training(trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  seen, damaged, stop = [], [], threading.Event()

  def reader():  # what `latest` sees is always complete, whenever it looks
    while not stop.is_set():
      try:
        step, _ = objects.latest_intact(store)
        if step is not None and step not in seen:
          seen.append(step)
          objects.download(store, step, tmp_path / f'read-{step}')
      except StoreError:
        pass  # the store is down
      except CheckpointError as e:
        damaged.append(e.line())
      time.sleep(0.05)

  thread = threading.Thread(target=reader, daemon=True)
  thread.start()
  workdir = tmp_path / 'run'
  flags = ('--config.train.steps=300', '--checkpoint_every=10', '--keep=0', f'--remote={url}')
  proc = trainer.start(workdir, *flags)
  try:
    wait_for(lambda: any(s >= 20 for s in remote_steps(store)), proc)
    s3_server.stop()
    wait_for(lambda: events_of(workdir, 'upload_failed'), proc)
    down_at = max(committed_steps(workdir))
    wait_for(lambda: max(committed_steps(workdir)) >= down_at + 30, proc)  # training went on
  finally:
    s3_server.start()
  assert proc.wait(timeout=300) == 0, proc.stdout.read()
  stop.set()
  thread.join()
  assert not damaged
  assert remote_steps(store)[-1] == 300  # the newest went up once the store was back
  status = read_status(workdir)
  assert status['remote_step'] == 300 and status['remote_error'] is None
  failed = events_of(workdir, 'upload_failed')
  assert failed and all('E-STORE' in e['error'] for e in failed)


def test_one_trainer_per_remote_prefix(trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  first = trainer.start(tmp_path / 'a', '--config.train.steps=100000', '--checkpoint_every=10',
                        f'--remote={url}', '--remote_lease_secs=3')
  try:
    wait_for(lambda: remote_steps(store), first)
    second = trainer.train(tmp_path / 'b', f'--remote={url}')
    assert second.returncode == 2
    line = second.stderr.strip().splitlines()[-1]
    assert line.startswith(f'jaxckpt: E-STORE-006: {url} is in use by another trainer')
    assert f'pid {first.pid} ' in line
    assert not (tmp_path / 'b' / 'checkpoints').exists()
  finally:
    first.send_signal(signal.SIGKILL)
    first.wait()
  _wait_until_stale(store, 3)
  third = trainer.train(tmp_path / 'c', '--config.train.steps=10', f'--remote={url}')
  assert third.returncode == 0, third.stderr
  taken = events_of(tmp_path / 'c', 'lease_taken_over')
  assert [e['previous']['pid'] for e in taken] == [first.pid]
  assert store.read('LEASE') is None  # released at the end


def test_sigterm_makes_the_last_checkpoint_durable_within_the_grace(trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  workdir = tmp_path / 'run'
  proc = trainer.start(workdir, '--config.train.steps=100000', '--checkpoint_every=1000',
                       f'--remote={url}', '--stop_grace_secs=60')
  wait_for(lambda: (workdir / 'status.json').exists() and read_status(workdir).get('step', 0) >= 20,
           proc)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, out
  stopped = events_of(workdir, 'interrupted')[0]['step']
  assert committed_steps(workdir) == [stopped]  # the step it stopped at, and only that one
  assert remote_steps(store) == [stopped]
  assert f'jaxckpt: step {stopped} is durable in {url}/checkpoints/step_{stopped:08d}/' in out


def test_a_damaged_remote_checkpoint_is_passed_over_and_replaced(trainer, s3_server, tmp_path):
  url = s3_server.bucket()
  store = Store(url)
  flags = ('--checkpoint_every=10', '--keep=0', f'--remote={url}')
  first = trainer.train(tmp_path / 'vm1', '--config.train.steps=20', *flags)
  assert first.returncode == 0, first.stderr
  key = objects.object_key(store, 20, 'state/process_0.safetensors')
  data = bytearray(store.read(key))
  data[len(data) // 2] ^= 1
  store.write(key, bytes(data))

  again = trainer.train(tmp_path / 'vm2', '--config.train.steps=30', *flags)
  assert again.returncode == 0, again.stderr
  assert 'passing over remote step 20: E-STORE-012' in again.stderr
  assert [e['step'] for e in events_of(tmp_path / 'vm2', 'fetched')] == [10]
  assert remote_steps(store) == [10, 20, 30]
  verify = jaxckpt_cli('verify', url)  # step 20 was trained again and its upload replaced it
  assert verify.returncode == 0, verify.stdout
