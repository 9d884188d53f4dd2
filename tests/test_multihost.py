"""The checkpoint library across real jax.distributed processes (CPU, gloo), one machine.

Each test starts N processes of this file (`python tests/test_multihost.py CMD ...`, see
`worker`), each with 2 CPU devices; the mesh spans every process's devices. The state's values
are a pure function of nothing, so any process count can check what it restored, byte for byte.
One trainer start (`python -m jaxckpt.main`) checks what the processes agree to resume from.
"""

import json
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, assert_same_bytes, finish_processes, start_processes

SPECS = {  # name: (shape, dtype, partition spec over ('data', 'model'))
    'params/w': ((8, 16), 'float32', ('data', 'model')),
    'params/b': ((16,), 'float32', ('model',)),
    'params/e': ((12, 8), 'float32', ()),
    'params/rows': ((8, 5), 'float32', ('data', None)),
    'opt/count': ((), 'int32', ()),
    'opt/h': ((6,), 'bfloat16', ()),
}


def expected() -> dict[str, np.ndarray]:
  import ml_dtypes
  rng = np.random.default_rng(0)
  out = {}
  for name, (shape, dtype, _) in SPECS.items():
    values = rng.standard_normal(shape) * 100
    out[name] = values.astype(ml_dtypes.bfloat16 if dtype == 'bfloat16' else dtype)
  return out


def worker(cmd: str, process: int, count: int, coordinator: str, directory: str, *rest: str):
  """One process: `save STEP [storage]`, `restore [storage]` (check every shard, save STEP+1),
  `stall` (open the manager, never save), `local STEP` (save with a process-local leaf), `stuck`
  (restore beside `meanwhile` with reads that never return) or `replay STEP LOSER` (save STEP
  kept by keep_every, lose it from process LOSER's directory, save it again under options that
  keep nothing)."""
  import jax
  # `local`: one CPU device per process (gloo's collectives can hang with several, openxla/xla
  # #16430); the older commands keep their two.
  jax.config.update('jax_num_cpu_devices', 1 if cmd == 'local' else 2)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.config.update('jax_enable_preemption_service', False)
  if count > 1:
    jax.distributed.initialize(coordinator, num_processes=count, process_id=process)
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointError, CheckpointManager, CheckpointOptions
  devices = jax.devices()
  mesh = Mesh(np.asarray(devices).reshape(len(devices) // 2, 2), ('data', 'model'))
  want = expected()
  shardings = {n: NamedSharding(mesh, P(*spec)) for n, (_, _, spec) in SPECS.items()}
  storage = rest[-1] if rest and not rest[-1].isdigit() else 'auto'
  timeout = 3.0 if cmd == 'stall' else 120.0
  directory = directory.format(k=process, pair=process // 2)  # 'host{k}': each its own disk
  mgr = CheckpointManager(directory,
                          CheckpointOptions(storage=storage, barrier_timeout_secs=timeout))
  if cmd in ('save', 'stall', 'local', 'replay'):
    state = {
        n: jax.make_array_from_callback(x.shape, shardings[n], lambda i, x=x: x[i])
        for n, x in want.items()
    }
    if cmd == 'replay':  # STEP kept by keep_every; process LOSER's disk loses it; `mgr` saves it
      mgr.close()  # one writer per directory: the earlier run's, then the replay's
      first = CheckpointManager(
          directory,
          CheckpointOptions(storage=storage, barrier_timeout_secs=timeout, keep_every=int(rest[0])))
      first.save(int(rest[0]), state, {'note': 'hello'})
      first.close()
      if process == int(rest[1]):
        shutil.rmtree(Path(directory) / f'step_{int(rest[0]):08d}')
      mgr = CheckpointManager(directory,
                              CheckpointOptions(storage=storage, barrier_timeout_secs=timeout))
    if cmd == 'local':  # one leaf on this process's device alone: each process has its own
      state['opt/local'] = jax.device_put(np.arange(3) + process, jax.local_devices()[0])
    if cmd == 'stall' and process == 1:
      return  # never saves: process 0 must give up within its timeout, naming it
    try:
      mgr.save(int(rest[0]), state, {'note': 'hello'})
      mgr.close()
    except CheckpointError as e:
      print(f'ERROR {e}', flush=True)
      sys.exit(3)
    print('saved', flush=True)
    return
  target = {
      n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[n]) for n, x in want.items()
  }
  step = mgr.latest_step()
  if cmd == 'stuck':  # a read that never returns (a hung mount) beside meanwhile: E-CKPT-017
    from jaxckpt.checkpoint import boxread, reading
    reading.READ_WAIT_SECS, reading.READ_WAIT_BYTES_PER_SEC = 0.5, 1e18
    never, pread = threading.Event(), boxread.pread_into
    boxread.pread_into = lambda *args: never.wait() if threading.current_thread().name.startswith(
        'jaxckpt-shard') else pread(*args)
    try:
      mgr.restore(step, target, meanwhile=lambda: None)
    except CheckpointError as e:
      print(f'ERROR {e}', flush=True)
      os._exit(3)  # the stuck reader's pool would hold a normal exit (the trainer bounds it)
    os._exit(0)
  # The trainer compiles its first step `meanwhile`: each process reads its byte ranges beside
  # it (orbax reads after it), so a read that waited for `meanwhile` would fail here.
  from jaxckpt.checkpoint import boxrestore, reading
  read, real, readers = threading.Event(), boxrestore.read_boxes, []

  def watched(*args, **kwargs):
    readers.append(threading.current_thread().name)
    try:
      return real(*args, **kwargs)
    finally:
      read.set()

  def meanwhile():
    if storage != 'orbax':
      assert read.wait(60), f'process {process} read nothing while meanwhile ran'

  boxrestore.read_boxes = watched
  state, run_state = mgr.restore(step, target, meanwhile=meanwhile)
  assert readers == ([reading.READER] if storage != 'orbax' else []), readers
  assert run_state['note'] == 'hello', run_state
  for name, x in state.items():
    for shard in x.addressable_shards:
      got = np.asarray(shard.data)
      assert got.tobytes() == want[name][shard.index].tobytes(), (name, shard.index)
  mgr.save(step + 1, state, {'note': 'hello'})  # and the run goes on from what it restored
  mgr.close()
  print(f'restored {step} on {count} process(es)', flush=True)


def run(tmp, compile_cache, cmd: str, count: int, *args: str, timeout: float = 240):
  procs = start_processes(
      lambda k, coordinator:
      [sys.executable, __file__, cmd,
       str(k), str(count), coordinator,
       str(tmp), *args],
      count,
      cache=compile_cache)
  return finish_processes(procs, timeout)


def assert_all_ok(results, word: str) -> None:
  for k, (code, out) in enumerate(results):
    assert code == 0 and word in out, f'process {k} exited {code}:\n{out[-3000:]}'


def step_dir(tmp, step: int) -> Path:
  return Path(tmp) / f'step_{step:08d}'


def test_four_processes_write_their_shards_once_and_restore_on_two_then_one(
    tmp_path, compile_cache):
  from safetensors.numpy import load_file

  from jaxckpt.checkpoint import CheckpointError
  from jaxckpt.checkpoint.formats import read_host_arrays
  assert_all_ok(run(tmp_path, compile_cache, 'save', 4, '1'), 'saved')
  meta = json.loads((step_dir(tmp_path, 1) / 'manifest.json').read_text())
  files = [f'state/process_{k}.safetensors' for k in range(4)]
  assert meta['state_files'] == files and all(f in meta['files'] for f in files)
  # Each shard is written once in the whole job, and the four files share the work.
  held = {f: load_file(step_dir(tmp_path, 1) / f) for f in files}
  assert all(held.values()), {f: list(t) for f, t in held.items()}
  # The shards are in shards.json, covered by the sealed manifest; no tensor row lists them.
  from jaxckpt.checkpoint import manifest, shardtable
  assert meta['format_version'] == 3 and meta['shard_table'] == 'shards.json'
  assert meta['files']['shards.json'] == shardtable.entry(
      (step_dir(tmp_path, 1) / 'shards.json').read_bytes())
  shards = shardtable.shard_table(step_dir(tmp_path, 1), meta, None)
  for row in meta['tensors']:
    assert 'shards' not in row
    total = sum(int(np.prod(s['shape'])) for s in shards[row['name']])
    assert total == int(np.prod(row['shape'])), row
  # Any reader assembles the arrays from the shards, bytes as saved.
  assert_same_bytes(read_host_arrays(step_dir(tmp_path, 1)), expected())

  assert_all_ok(run(tmp_path, compile_cache, 'restore', 2), 'restored 1 on 2')
  assert_same_bytes(read_host_arrays(step_dir(tmp_path, 2)), expected())
  assert len(json.loads((step_dir(tmp_path, 2) / 'manifest.json').read_text())['state_files']) == 2
  assert_all_ok(run(tmp_path, compile_cache, 'restore', 1), 'restored 2 on 1')
  # One process writes the single-process file, exactly as before.
  meta = json.loads((step_dir(tmp_path, 3) / 'manifest.json').read_text())
  assert 'state_files' not in meta and 'shards' not in meta['tensors'][0]
  assert meta['format_version'] == 1 and 'shards.json' not in meta['files']
  assert_same_bytes(load_file(step_dir(tmp_path, 3) / 'state/process_0.safetensors'), expected())
  # A checkpoint from before the grid (manifest format 2, shards.json of JSON rows, each
  # process's copied as posted) still reads, bytes as saved.
  rows_dir = tmp_path / 'rows' / step_dir(tmp_path, 1).name
  shutil.copytree(step_dir(tmp_path, 1), rows_dir)
  parts = [[{'array': name, **row}
            for name, rows in shards.items()
            for row in rows
            if row['file'] == f]
           for f in files]
  body = json.dumps({'format': 'jaxckpt.shards', 'parts': parts}).encode()
  (rows_dir / 'shards.json').write_bytes(body)
  old = {**json.loads((rows_dir / 'manifest.json').read_text()), 'format_version': 2}
  old['files'] = {**old['files'], 'shards.json': shardtable.entry(body)}
  (rows_dir / 'manifest.json').write_bytes(manifest.sealed_json(old))
  assert_same_bytes(read_host_arrays(rows_dir), expected())
  # A shard table that is not the one the manifest seals is never used: no reader places bytes.
  table = step_dir(tmp_path, 1) / 'shards.json'
  body = bytearray(table.read_bytes())
  body[-8] ^= 1  # a bit of the last cell's CRC-32
  table.write_bytes(bytes(body))
  with pytest.raises(CheckpointError) as e:
    read_host_arrays(step_dir(tmp_path, 1))
  assert e.value.code == 'E-CKPT-003' and 'shards.json' in e.value.what


def test_one_process_checkpoint_restores_on_two(tmp_path, compile_cache):
  assert_all_ok(run(tmp_path, compile_cache, 'save', 1, '5'), 'saved')
  assert_all_ok(run(tmp_path, compile_cache, 'restore', 2), 'restored 5 on 2')
  # Step 6, of 2 processes, read on 1 beside `meanwhile` by reads that never return: named.
  [(code, out)] = run(tmp_path, compile_cache, 'stuck', 1)
  assert code == 3 and 'ERROR E-CKPT-017: reading ' in out and 'step_00000006' in out, out[-3000:]


def test_orbax_saves_and_restores_across_two_processes(tmp_path, compile_cache):
  from jaxckpt.checkpoint.formats import read_host_arrays
  assert_all_ok(run(tmp_path, compile_cache, 'save', 2, '1', 'orbax'), 'saved')
  meta = json.loads((step_dir(tmp_path, 1) / 'manifest.json').read_text())
  assert meta['storage'] == 'orbax'
  assert_all_ok(run(tmp_path, compile_cache, 'restore', 2, 'orbax'), 'restored 1 on 2')
  assert_same_bytes(read_host_arrays(step_dir(tmp_path, 2)), expected())


def test_on_each_host_own_disk_each_commits_its_part_under_the_whole_manifest(
    tmp_path, compile_cache):
  from jaxckpt.checkpoint import manifest
  from jaxckpt.checkpoint.formats import read_host_arrays
  (tmp_path / 'host1' / 'step_00000007.tmp-000000000007').mkdir(parents=True)  # a crash's debris
  (tmp_path / 'host1' / '.jaxckpt-shared-1234-00ff-1').write_bytes(b'')  # an open cut short
  assert_all_ok(run(f'{tmp_path}/host{{k}}', compile_cache, 'save', 2, '7'), 'saved')
  hosts = [step_dir(tmp_path / f'host{k}', 7) for k in range(2)]
  files = [f'state/process_{k}.safetensors' for k in range(2)]
  manifests = [json.loads((h / 'manifest.json').read_text()) for h in hosts]
  for k, (host, meta) in enumerate(zip(hosts, manifests)):
    assert sorted(meta['files']) == ['run_state.json', 'shards.json', *files], meta['files']
    assert sorted(str(p.relative_to(host)) for p in host.rglob('*.safetensors')) == [files[k]]
  # One commit: the same manifest bytes on both hosts. Process 1 read no record of process 0's
  # and holds no shard table (process 0's word lists the files): a restart's peer restore, or
  # the remote, brings it.
  assert (hosts[1] / 'manifest.json').read_bytes() == (hosts[0] / 'manifest.json').read_bytes()
  assert (hosts[0] / 'shards.json').is_file() and not (hosts[1] / 'shards.json').exists()
  assert not (tmp_path / 'host1' / 'step_00000007.tmp-000000000007').exists()
  assert not list(tmp_path.rglob('.jaxckpt-shared*'))  # no probe is left behind
  # Brought together (what a download from the remote tier does), the parts are the state.
  (hosts[0] / files[1]).write_bytes((hosts[1] / files[1]).read_bytes())
  assert manifest.audit(hosts[0])[1] == []
  assert_same_bytes(read_host_arrays(hosts[0]), expected())


@pytest.mark.parametrize('loser', [1, 0])
def test_a_replay_on_own_disks_commits_one_manifest_keeping_what_any_host_kept(
    tmp_path, compile_cache, loser):
  """Step 7 is kept by keep_every; one host's disk then loses it (a replacement machine), and a
  run that keeps nothing saves step 7 again. A replay keeps what the step's earlier commit was
  kept for, which only the other host's disk holds: every host's manifest must be the same bytes
  (or the hosts would hold different commits of step 7, and a restart would not find it whole
  on their disks), and still keep the step for keep_every, whichever host lost it."""
  assert_all_ok(run(f'{tmp_path}/host{{k}}', compile_cache, 'replay', 2, '7', str(loser)), 'saved')
  raw = [(step_dir(tmp_path / f'host{k}', 7) / 'manifest.json').read_bytes() for k in range(2)]
  assert raw[1] == raw[0]
  assert json.loads(raw[0])['retention'] == {'kept': ['keep_every'], 'keep_every': 7}, raw[0][:2000]


def test_a_directory_shared_by_some_processes_and_not_others_is_refused(tmp_path, compile_cache):
  results = run(f'{tmp_path}/host{{pair}}', compile_cache, 'save', 3, '1')  # 0 and 1 share
  for k, (code, out) in enumerate(results):
    assert code != 0 and 'E-DIST-007' in out and '{0: [0, 1], 1: [0, 1]}' in out, (k, out[-2000:])
  assert not list(tmp_path.rglob('step_*'))


def test_a_process_local_leaf_is_refused_before_anything_is_written(tmp_path, compile_cache):
  """Saved, each process would write its own value as the one array, and no restore could tell
  which is right: every process refuses the save at once, naming the leaf and the fix."""
  for k, (code, out) in enumerate(run(tmp_path, compile_cache, 'local', 2, '1')):
    line = next((s for s in out.splitlines() if s.startswith('ERROR ')), out[-2000:])
    assert code == 3 and 'E-DIST-011' in line and 'opt/local' in line, (k, out[-3000:])
    assert 'SingleDeviceSharding' in line and 'NamedSharding' in line, line
  assert not list(tmp_path.glob('step_*'))  # nothing written, not even a temporary directory


def test_a_process_that_never_arrives_is_named_and_nothing_is_committed(tmp_path, compile_cache):
  (code0, out0), (code1, _) = run(tmp_path, compile_cache, 'stall', 2, '1')
  assert code0 == 3 and 'E-DIST-002' in out0 and 'process(es) [1] of 2' in out0, out0[-3000:]
  assert not (step_dir(tmp_path, 1) / 'manifest.json').exists()


def test_hosts_holding_different_commits_of_one_step_refuse_to_resume(tmp_path, trainer,
                                                                      compile_cache):
  """Each host's own disk holds step_00000010, whole, but the two are different commits (here
  the same state committed at other times: another history's would do the same). The processes
  compare the manifests' seals, not the names, and stop before the first step with E-DIST-008."""
  from jaxckpt.checkpoint import manifest
  remote = tmp_path / 'remote'
  flags = ('--config.train.steps=10', '--checkpoint_every=10', f'--remote={remote}')
  r = trainer.train(tmp_path / 'host0', *flags)
  assert r.returncode == 0, r.stderr
  shutil.copytree(tmp_path / 'host0', tmp_path / 'host1')
  other = tmp_path / 'host1' / 'checkpoints' / 'step_00000010'
  m = manifest.read(other)
  m['committed_at'] += 1
  (other / 'manifest.json').write_bytes(manifest.sealed_json(m))
  seals = [
      manifest.read(tmp_path / f'host{k}' / 'checkpoints' / other.name)[manifest.SEAL]
      for k in range(2)
  ]
  procs = start_processes(
      lambda k, coordinator: [
          sys.executable, '-m', 'jaxckpt.main', f'--config={TINY}', f'--workdir={tmp_path}/host{k}',
          *flags, f'--coordinator_address={coordinator}', '--num_processes=2', f'--process_id={k}'
      ],
      2,
      cache=compile_cache)
  for k, (code, out) in enumerate(finish_processes(procs)):
    line = next((s for s in out.splitlines() if 'E-DIST-008' in s), out[-3000:])
    assert code == 1 and line.startswith('jaxckpt: E-DIST-008: '), (k, code, out[-3000:])
    assert all(seal in line for seal in seals), line


if __name__ == '__main__':
  worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
