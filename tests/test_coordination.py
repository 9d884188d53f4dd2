"""What coordinating a job costs each process: only process 0 reads what every process posts.

Three real jax.distributed processes of this file (`python tests/test_coordination.py CMD ...`),
one CPU device each, counting their bytes through the key-value store at the project's own
calls (`jaxckpt.checkpoint.traffic`).
"""

import base64
import json
import sys

import numpy as np
from conftest import finish_processes, start_processes

LEAVES = 40  # each process's part record names 40 shards: 0.4 KB, far above a word


def worker(cmd: str, process: int, count: int, coordinator: str, directory: str) -> None:
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  from jaxckpt.checkpoint import traffic
  counted = traffic.count_traffic()
  import os
  import time

  from jaxckpt.hosts import distributed
  directory = directory.format(k=process)  # host{k}: each process's own disk

  # Process 1's records of a lost process take 2 s to write (a loaded machine, a slow disk):
  # process 0, the coordinator, must not exit first, or JAX aborts process 1 (-6), not exit 1.
  slow = (lambda line: time.sleep(2)) if cmd == 'vanish' and process == 1 else None
  distributed.initialize(
      coordinator, count, process, heartbeat_timeout_seconds=2.0, timeout_secs=120.0, on_lost=slow)
  if cmd == 'vanish':  # process 2 ends without a word: the others name it, told by process 0
    if process == 2:
      os._exit(0)
    time.sleep(120)  # the watchdog ends this process first
    return
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointError, CheckpointManager, CheckpointOptions
  mesh = Mesh(np.asarray(jax.devices()), ('data',))
  sharding = NamedSharding(mesh, P('data'))
  state = {
      f'params/layer_{i:03d}/kernel':
          jax.make_array_from_callback((count * 2, 4), sharding, lambda idx: np.ones(
              (count * 2, 4), np.float32)[idx]) for i in range(LEAVES)
  }
  mgr = CheckpointManager(directory, CheckpointOptions(barrier_timeout_secs=3.0))
  mgr.save(1, state, {'step': 1})
  mgr.wait_until_finished()
  before = counted.snapshot(but=('jaxckpt-watchdog',))
  if cmd == 'stall' and process == 2:
    return  # never saves step 2: the others give up within their timeout, naming it
  try:
    mgr.save(2, state, {'step': 2})
    mgr.wait_until_finished()
  except CheckpointError as e:
    print(f'ERROR {e}', flush=True)
    sys.exit(3)
  after = counted.snapshot(but=('jaxckpt-watchdog',))
  print('TRAFFIC ' + json.dumps({k: after[k] - before[k] for k in after}), flush=True)
  mgr.close()


def run(tmp, compile_cache, cmd: str, timeout: float = 180, directory: str | None = None):
  procs = start_processes(
      lambda k, coordinator:
      [sys.executable, __file__, cmd,
       str(k), '3', coordinator, directory or str(tmp)],
      3,
      cache=compile_cache)
  return finish_processes(procs, timeout)


def traffic(out: str) -> dict:
  return next(json.loads(line[8:]) for line in out.splitlines() if line.startswith('TRAFFIC '))


def test_a_save_sends_every_part_record_to_process_0_alone(tmp_path, compile_cache):
  results = run(tmp_path, compile_cache, 'save')
  for k, (code, out) in enumerate(results):
    assert code == 0, f'process {k} exited {code}:\n{out[-3000:]}'
  manifest = json.loads((tmp_path / 'step_00000002' / 'manifest.json').read_text())
  assert manifest['state_files'] == [f'state/process_{k}.safetensors' for k in range(3)]
  # Process 2's part record: at least its cells as it posted them, 8 bytes each in base64.
  table = json.loads((tmp_path / 'step_00000002' / 'shards.json').read_text())
  cells = np.frombuffer(base64.b64decode(table['cells']), '<u4').reshape(-1, 2)
  assert table['files'][2].endswith('_2.safetensors') and int((cells[:, 0] == 2).sum()) == LEAVES
  record = 8 * LEAVES * 4 // 3
  p0, p1, p2 = (traffic(out) for _, out in results)
  assert p0['received'] > 2 * record, p0  # process 0 reads both others' records
  for other in (p1, p2):  # the others read process 0's word, never a record
    assert other['received'] < record / 4, (other, record)


def test_on_each_hosts_own_disk_only_process_0_reads_the_part_records(tmp_path, compile_cache):
  """Each host commits its part under process 0's manifest; process 0's word lists the job's
  files (a line a process), so the others read no record: before, each read all three."""
  results = run(tmp_path, compile_cache, 'save', directory=f'{tmp_path}/host{{k}}')
  for k, (code, out) in enumerate(results):
    assert code == 0, f'process {k} exited {code}:\n{out[-3000:]}'
  hosts = [tmp_path / f'host{k}' / 'step_00000002' for k in range(3)]
  raw = (hosts[0] / 'manifest.json').read_bytes()
  assert json.loads(raw)['state_files'] == [f'state/process_{k}.safetensors' for k in range(3)]
  for k, host in enumerate(hosts):
    assert (host / 'manifest.json').read_bytes() == raw  # one commit, the same bytes
    assert (host / f'state/process_{k}.safetensors').is_file()
  record = 8 * LEAVES * 4 // 3
  p0, p1, p2 = (traffic(out) for _, out in results)
  assert p0['received'] > 2 * record, p0
  for other in (p1, p2):  # process 0's word with 4 files' sizes and CRCs, not 3 records
    assert other['received'] < record, (other, record)


def test_a_process_that_never_arrives_is_named_by_every_other(tmp_path, compile_cache):
  results = run(tmp_path, compile_cache, 'stall')
  for k in (0, 1):
    code, out = results[k]
    assert code == 3 and 'E-DIST-002' in out and 'process(es) [2] of 3' in out, out[-3000:]
  assert not (tmp_path / 'step_00000002' / 'manifest.json').exists()
  assert (tmp_path / 'step_00000001' / 'manifest.json').exists()


def test_a_vanished_process_is_named_by_every_other_from_process_0s_verdict(
    tmp_path, compile_cache):
  results = run(tmp_path, compile_cache, 'vanish', timeout=120)
  for k in (0, 1):
    code, out = results[k]
    assert code == 1 and 'E-DIST-006: process(es) [2] of 3 lost (no sign of life' in out, \
        out[-3000:]


if __name__ == '__main__':
  worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
