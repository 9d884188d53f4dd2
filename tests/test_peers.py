"""The peer tier of the checkpoint library: replicas of other processes' parts, and a restore
from them, across 3 real jax.distributed processes (one CPU device each, gloo), each with its
own directory (`host{k}`).

Each test starts the processes of this file (`python tests/test_peers.py CMD ...`, see `worker`);
those that start from one `save 10` share a single run of it (`saved_10`), each on its own copy.
The state's values are a pure function of nothing, so a restore checks what it got, byte for
byte; a replica is checked against its owner's file, byte for byte.
"""

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from conftest import finish_processes, mounted_tmpfs, start_processes

COUNT = 3
SPECS = {  # name: (shape, dtype, partition spec over ('data',))
    'params/w': ((6, 16), 'float32', ('data',)),  # split: each process holds a third
    'params/e': ((12, 8), 'float32', ()),  # replicated: every process holds it all
    'opt/mu': ((9, 4), 'float32', ('data',)),
    'opt/count': ((), 'int32', ()),
}

# Every array split over the processes: each process's devices need its own part alone.
SPLIT = {n: v for n, v in SPECS.items() if v[2]}


def expected(specs=SPECS) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(7)
  return {n: (rng.standard_normal(s) * 100).astype(d) for n, (s, d, _) in specs.items()}


def worker(cmd: str, process: int, coordinator: str, root: str, *rest: str):
  """`save STEP...` (replicas=1; each commit printed with its confirmed replica count), or `restore` (the peer tier brings this process's directory to
  what it needs; then every shard is checked and the sources printed as JSON). `-split`: the
  arrays of `SPLIT` alone; `-slow`: process 1's reads of the remote's parts take 12 s, process
  0's of its own files too, and the restore's group waits 6 s; `-cut`: process 0's shard table is cut short as it sends it; `-eio`: process
  0's disk fails while it plans; `-r0`: the restore keeps no replicas; `-dp`: it restores every
  array whole on every process (data parallel); `-flip` (save): process
  2's replica of step 10 differs from its owner's part; `-hang`: process 2's disk hangs in a
  write of what it receives; `-fetchhang`: its read of its part from the remote hangs, and the
  group waits 8 s; `-garbled`: process 0's plan arrives damaged on process 1 (the group waits
  8 s); `-short`: the store answers process 0 without process 2's word at the restore's end
  (`-shortheld`: at its start; the group waits 8 s). A
  restore's RESULT counts its rounds of
  point-to-point sends and its subsets spread to several processes at once."""
  specs, slow = SPLIT if '-split' in cmd else SPECS, '-slow' in cmd
  import jax
  jax.config.update('jax_num_cpu_devices', 1)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes=COUNT, process_id=process)
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, multihost, peers
  mesh = Mesh(np.asarray(jax.devices()), ('data',))
  want = expected(specs)
  shardings = {n: NamedSharding(mesh, P(*spec)) for n, (_, _, spec) in specs.items()}
  directory = Path(root) / f'host{process}'
  if cmd.startswith('save'):
    if '-flip' in cmd and process == 2:  # its replica of step 10 is not its owner's bytes
      from jaxckpt.checkpoint import replicas
      write = replicas.write

      def flipped(state_dir, copies):
        out = write(state_dir, copies)
        bad = state_dir.parent.name.startswith('step_00000010.')
        return {r: {**v, 'crc32': '00000000'} if bad else v for r, v in out.items()}

      replicas.write = flipped
    with CheckpointManager(
        directory,
        CheckpointOptions(replicas=1, keep=0, barrier_timeout_secs=60),
        on_commit=lambda i: print(f'COMMIT {i.step} {i.replicas}', flush=True)) as mgr:
      for step in map(int, rest):
        state = {
            n: jax.make_array_from_callback(x.shape, shardings[n], lambda i, x=x * step: x[i])
            for n, x in want.items()
        }
        mgr.save(step, state)
    print('saved', flush=True)
    return
  if '-dp' in cmd:  # restored data parallel: every array whole on every process's devices
    shardings = {n: NamedSharding(mesh, P()) for n in shardings}
  target = {
      n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[n]) for n, x in want.items()
  }
  remote = None
  if rest:  # the remote tier: its newest intact checkpoint, `rest[1]` ('none': it holds none)
    from jaxckpt.checkpoint.remote import Store, partial
    newest = None if rest[1] == 'none' else int(rest[1])
    remote = partial.peer_source(Store(rest[0]), newest, inspect=process == 0)
  from jaxckpt.checkpoint import CheckpointError, peerplan, sends, spreads
  sends.WINDOW = 256  # each part in several windows, the last one short: a real part's path
  timeout = 60
  if slow:  # a remote far slower than the group's timeout, for a part only its reader needs
    import time
    peers.FETCH_FLOOR = 8  # bytes/s: the others wait 6 s + about a minute for a ~500-byte part
    timeout, fetch = 6, remote.fetch
    if process == 1:
      remote.fetch = lambda *a: (time.sleep(12), fetch(*a))[1]
    if process == 0:  # the checkpoint's own files too, read while the others wait for its word
      meta = remote.meta
      remote.meta = lambda *a: (time.sleep(12), meta(*a))[1]
    multihost.Group(60).sync('ready', 'every process ready')  # none late from start-up
  if '-cut' in cmd and process == 0:  # its disk fails while it sends the shard table
    send = spreads.broadcast

    def broadcast(source, size, receive, disk=None):
      if source is not None and source.name == 'shards.json':
        source.write_bytes(source.read_bytes()[:size // 2])
      return send(source, size, receive, disk)

    spreads.broadcast = broadcast
  if '-garbled' in cmd:  # process 0's plan arrives damaged on process 1; the group waits 8 s
    timeout = 8
    multihost.Group(60).sync('ready', 'every process ready')  # none late from start-up
    if process == 1:
      share = spreads.share
      spreads.share = lambda data, size: (b'x' + share(data, size)[0][1:], None)
  if '-short' in cmd:  # the store answers process 0 short at the restore's end; waits of 8 s
    timeout = 8
    multihost.Group(60).sync('ready', 'every process ready')  # none late from start-up
  if '-short' in cmd and process == 0:  # its reads of the store, counted (`traffic`), cut
    from jaxckpt.checkpoint import traffic
    dir_get = traffic._Counted.key_value_dir_get
    where = '/peers/held/part/' if '-shortheld' in cmd else '/peers/done/10/part/'
    traffic._Counted.key_value_dir_get = lambda self, key, *a: (
        dir_get(self, key, *a)[:-1] if key.endswith(where) else dir_get(self, key, *a))
  if '-eio' in cmd and process == 0:  # its disk fails while it plans the restore

    def plan(*_):
      raise OSError(5, 'Input/output error')

    peerplan.build = plan
  if '-enospc' in cmd:  # subsets in windows of 64 bytes; process 2's disk full as they come
    sends.SMALL = 64
    if process == 2:
      import errno
      import os

      def full(*_):
        raise OSError(errno.ENOSPC, 'No space left on device')

      from jaxckpt.checkpoint import diskwork  # where a received file is written
      diskwork.os = type('os', (), {'__getattr__': lambda _, n: getattr(os, n), 'pwrite': full})()
  hangs = process == 2 and ('-hang' in cmd or '-fetchhang' in cmd)
  if hangs:  # its disk hangs in the first write of what it receives, or of what it reads
    import threading

    from jaxckpt.checkpoint import diskwork
    diskwork.DISK_WAIT_SECS = 3
    gate = threading.Event()
    if '-hang' in cmd:
      diskwork.Landing.write = lambda *_: gate.wait(120)
    else:  # from the remote (where it is the one to read its own part)
      remote.fetch = lambda *_: gate.wait(120)
  if '-fetchhang' in cmd:  # a read of the remote is given up at half the group's timeout
    timeout = 8
    multihost.Group(60).sync('ready', 'every process ready')  # none late from start-up
  from jaxckpt.checkpoint import traffic
  kv, build, planned = traffic.count_traffic(), peerplan.build, [0]

  def measured(*a):  # process 0's plan, its size as JSON
    plan = build(*a)
    planned[0] = len(json.dumps(plan)) if plan else 0
    return plan

  peerplan.build = measured
  collectives = {'rounds': 0, 'spreads': 0}  # how the parts moved: counted, then done as ever
  for name, real in (('rounds', sends._round), ('spreads', spreads.spread)):

    def counted(*a, name=name, real=real):
      collectives[name] += 1
      return real(*a)

    setattr(sends if name == 'rounds' else spreads, '_round' if name == 'rounds' else 'spread',
            counted)
  try:
    got = peers.restore_dir(
        directory, target, multihost.Group(timeout), remote, replicas=0 if '-r0' in cmd else 1)
  except CheckpointError as e:
    print(f'ERROR {e}', flush=True)
    if hangs:  # as the trainer's exit (`exit_within`) does: it
      import os  # leaves the job, then exits without waiting for the stuck thread
      try:
        jax.distributed.shutdown()
      finally:
        os._exit(3)
    sys.exit(3)
  if got is None:
    print('RESULT null', flush=True)
    return
  collectives.update(plan=planned[0], kv_received=kv.snapshot()['received'])
  mgr = CheckpointManager(directory, CheckpointOptions(barrier_timeout_secs=60))
  state, _ = mgr.restore(got.path, target)
  for name, x in state.items():
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), (want[name] * got.step)[shard.index])
  print('RESULT ' + json.dumps({'step': got.step, **got.sources, **collectives}), flush=True)


def _run(tmp_path, compile_cache, *args, code: int = 0) -> list[str]:
  procs = start_processes(
      lambda k, coord: [sys.executable, __file__, args[0],
                        str(k), coord,
                        str(tmp_path), *args[1:]],
      COUNT,
      cache=compile_cache)
  out = []
  for got, text in finish_processes(procs, timeout=180):
    assert got == code, text[-3000:]
    out.append(text)
  return out


def _results(outs: list[str]) -> list[dict]:
  return [json.loads(next(l for l in o.splitlines() if l.startswith('RESULT '))[7:]) for o in outs]


def _state(tmp_path, k: int, step: int) -> Path:
  return tmp_path / f'host{k}' / f'step_{step:08d}' / 'state'


def _uploaded_and_wiped(tmp_path, s3_server) -> tuple[str, Path]:
  """Step 10 as the 3 hosts' uploaders put it in a fresh bucket (its URL), a whole copy of it
  beside (`whole/step_00000010`), then every host's disk wiped: a job of fresh machines."""
  from jaxckpt.checkpoint.remote import Store, objects
  whole = tmp_path / 'whole' / 'step_00000010'
  shutil.copytree(tmp_path / 'host0' / 'step_00000010', whole)
  for k in (1, 2):
    shutil.copy(_state(tmp_path, k, 10) / f'process_{k}.safetensors', whole / 'state')
  url = s3_server.bucket()
  objects.upload(Store(url), whole, {}, may_write=lambda _: None, may_delete=lambda _: None)
  for k in range(COUNT):
    shutil.rmtree(tmp_path / f'host{k}')
  return url, whole


@pytest.fixture(scope='module')
def saved_10(tmp_path_factory, compile_cache) -> Path:
  """The 3 processes' `save 10` (host{k} each), run once for the tests that start from it: what
  it saves is a pure function of the step, and each test changes only a copy of it."""
  root = tmp_path_factory.mktemp('saved_10')
  _run(root, compile_cache, 'save', '10')
  return root


def test_each_process_keeps_a_byte_identical_replica_of_the_one_before_it(tmp_path, saved_10):
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  for k in range(COUNT):
    mine = sorted(p.name for p in _state(tmp_path, k, 10).iterdir())
    before = (k - 1) % COUNT
    assert mine == sorted([f'process_{k}.safetensors', f'process_{before}.safetensors'])
    assert (_state(tmp_path, k, 10) / f'process_{before}.safetensors').read_bytes() == \
        (_state(tmp_path, before, 10) / f'process_{before}.safetensors').read_bytes()


def test_a_replica_that_differs_from_its_owner_leaves_the_job_saying_the_peers_do_not_cover_it(
    tmp_path, compile_cache):
  outs = _run(tmp_path, compile_cache, 'save-flip', '10', '20')
  for text in outs:  # the same word on every process: step 10 has a part on one host alone
    assert [l for l in text.splitlines() if l.startswith('COMMIT')] == \
        ['COMMIT 10 0', 'COMMIT 20 1'], text[-2000:]
  assert not (_state(tmp_path, 2, 10) / 'process_1.safetensors').exists()  # not kept
  assert (_state(tmp_path, 2, 20) / 'process_1.safetensors').exists()


def test_a_wiped_host_is_restored_from_its_peers_and_a_damaged_replica_is_passed_over(
    tmp_path, compile_cache):
  _run(tmp_path, compile_cache, 'save', '10', '20')
  shutil.rmtree(tmp_path / 'host1')  # a replacement VM: nothing of its own
  # Process 1's part of step 20 is kept by process 2 alone: damaged there, step 20 cannot be
  # brought back from the peers, and step 10 is (process 1's own part of it from process 2's
  # intact replica; process 0's part, which process 1 also needs, from process 0).
  replica = _state(tmp_path, 2, 20) / 'process_1.safetensors'
  data = bytearray(replica.read_bytes())
  data[-1] ^= 0xFF
  replica.write_bytes(bytes(data))
  # Host 0 has a rotted copy of process 1's part of step 10 (no replica it keeps): passed over
  # and removed, once the tensors it needs of that part have come.
  rotted = _state(tmp_path, 0, 10) / 'process_1.safetensors'
  data = bytearray((_state(tmp_path, 2, 10) / 'process_1.safetensors').read_bytes())
  data[-1] ^= 0xFF
  rotted.write_bytes(bytes(data))
  # Process 2's run state of step 10 is damaged too: it is sent process 0's.
  run_state = tmp_path / 'host2' / 'step_00000010' / 'run_state.json'
  run_state.write_bytes(run_state.read_bytes().replace(b'10', b'11', 1))
  results = _results(_run(tmp_path, compile_cache, 'restore'))
  assert run_state.read_bytes() == (tmp_path / 'host0' / 'step_00000010' /
                                    'run_state.json').read_bytes()
  assert [r['step'] for r in results] == [10] * COUNT
  assert results[1]['own'] == 0 and results[1]['remote'] == 0 and results[1]['peers'] > 0
  assert all(r['remote'] == 0 and r['own'] > 0 for r in results[0::2])
  # Process 1's directory is a committed checkpoint again, its own part byte-identical.
  assert (_state(tmp_path, 1, 10) / 'process_1.safetensors').read_bytes() == \
      (_state(tmp_path, 2, 10) / 'process_1.safetensors').read_bytes()
  assert (tmp_path / 'host1' / 'step_00000010' / 'manifest.json').read_bytes() == \
      (tmp_path / 'host0' / 'step_00000010' / 'manifest.json').read_bytes()
  # Process 1 keeps the replica of process 0's part: it is sent that part whole, as it was.
  assert (_state(tmp_path, 1, 10) / 'process_0.safetensors').read_bytes() == \
      (_state(tmp_path, 0, 10) / 'process_0.safetensors').read_bytes()
  # Of process 1's part, process 0 needs the replicated arrays it holds alone: it is sent those
  # tensors (a state file of their own, each checked against its shard's CRC-32), not the part.
  part = _state(tmp_path, 2, 10) / 'process_1.safetensors'
  subset = _state(tmp_path, 0, 10) / 'process_1.safetensors.subset'
  assert not rotted.exists()
  got = safetensors.numpy.load_file(subset)
  whole = safetensors.numpy.load_file(part)
  assert got and set(got) < set(whole) and all(got[n].tobytes() == whole[n].tobytes() for n in got)
  assert results[0]['peers'] == subset.stat().st_size < part.stat().st_size / 4


@pytest.mark.parametrize('tier', ['no remote', 'an empty remote'])
def test_two_wiped_neighbours_without_a_remote_copy_stop_every_process_never_a_fresh_start(
    tmp_path, compile_cache, s3_server, saved_10, tier):
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  shutil.rmtree(tmp_path / 'host1')
  shutil.rmtree(tmp_path / 'host2')  # process 1's part was on 1 and 2: no one holds it
  remote = [] if tier == 'no remote' else [s3_server.bucket(), 'none']
  for text in _run(tmp_path, compile_cache, 'restore', *remote, code=3):
    assert 'E-RESUME-004: the 3 processes hold committed checkpoints (the newest, step 10, ' \
        'on process(es) [0]) but none whole' in text, text[-2000:]
  # Nothing was deleted: process 0's checkpoint is as it was.
  assert sorted(p.name for p in _state(tmp_path, 0, 10).iterdir()) == \
      ['process_0.safetensors', 'process_2.safetensors']


def test_with_no_checkpoint_anywhere_every_process_starts_fresh(tmp_path, compile_cache, s3_server):
  for k in range(COUNT):
    (tmp_path / f'host{k}').mkdir()
  outs = _run(tmp_path, compile_cache, 'restore', s3_server.bucket(), 'none')
  assert _results(outs) == [None] * COUNT


def test_the_remote_fills_in_the_part_no_peer_holds_each_byte_read_once(
    tmp_path, compile_cache, s3_server, saved_10):
  from jaxckpt.checkpoint.remote import Store, objects
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  whole = tmp_path / 'whole' / 'step_00000010'  # what the uploaders of the 3 hosts put there
  shutil.copytree(tmp_path / 'host0' / 'step_00000010', whole)
  shutil.copy(_state(tmp_path, 1, 10) / 'process_1.safetensors', whole / 'state')
  url = s3_server.bucket()
  objects.upload(Store(url), whole, {}, may_write=lambda _: None, may_delete=lambda _: None)
  shutil.rmtree(tmp_path / 'host1')
  shutil.rmtree(tmp_path / 'host2')  # process 1's part was on hosts 1 and 2 alone
  results = _results(_run(tmp_path, compile_cache, 'restore', url, '10'))
  assert [r['step'] for r in results] == [10] * COUNT
  part = (whole / 'state' / 'process_1.safetensors').stat().st_size
  assert sum(r['remote'] for r in results) == part  # read once in the job, by process 1
  assert results[1]['remote'] == part and results[2]['peers'] > 0
  for k in (1, 2):  # each a committed checkpoint again, its own part byte-identical
    assert (_state(tmp_path, k, 10) / f'process_{k}.safetensors').read_bytes() == \
        (whole / 'state' / f'process_{k}.safetensors').read_bytes()


def test_with_every_disk_wiped_each_process_reads_its_own_part_from_the_remote(
    tmp_path, compile_cache, s3_server, saved_10):
  """A job of fresh machines: process 0 commits the remote checkpoint's own files alone, then
  each part is read from the remote once in the job, by its own process (a third of the state
  each), and the replicated arrays' bytes reach the others over the collectives."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  url, whole = _uploaded_and_wiped(tmp_path, s3_server)
  results = _results(_run(tmp_path, compile_cache, 'restore', url, '10'))
  assert [r['step'] for r in results] == [10] * COUNT
  sizes = [(whole / 'state' / f'process_{k}.safetensors').stat().st_size for k in range(COUNT)]
  assert [r['remote'] for r in results] == sizes
  assert all(r['own'] == 0 for r in results) and sum(r['peers'] for r in results) > 0
  for k in range(COUNT):  # each a committed checkpoint, its own part byte-identical
    assert (tmp_path / f'host{k}' / 'step_00000010' / 'manifest.json').read_bytes() == \
        (whole / 'manifest.json').read_bytes()
    assert (_state(tmp_path, k, 10) / f'process_{k}.safetensors').read_bytes() == \
        (whole / 'state' / f'process_{k}.safetensors').read_bytes()


def test_a_subset_several_processes_need_goes_to_all_of_them_in_one_collective(
    tmp_path, compile_cache, s3_server, saved_10):
  """Every disk wiped, no replicas kept: each process reads its own part from the remote, and the
  replicated arrays in it are needed, alike, by both others. They get them together, spread
  in one collective per window (a fully sharded job of N processes: one, where rounds of
  point-to-point sends took N - 1), each a subset checked against the shard table."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  url, whole = _uploaded_and_wiped(tmp_path, s3_server)
  results = _results(_run(tmp_path, compile_cache, 'restore-r0', url, '10'))
  assert [r['step'] for r in results] == [10] * COUNT
  assert [r['rounds'] for r in results] == [0] * COUNT  # no part sent to one process at a time
  spread = [
      k for k in range(COUNT)
      if (_state(tmp_path, (k + 1) % COUNT, 10) / f'process_{k}.safetensors.subset').exists()
  ]
  assert spread and all(r['spreads'] == len(spread) for r in results)
  for k in spread:
    part = safetensors.numpy.load_file(whole / 'state' / f'process_{k}.safetensors')
    copies = [
        _state(tmp_path, j, 10) / f'process_{k}.safetensors.subset' for j in range(COUNT) if j != k
    ]
    assert copies[0].read_bytes() == copies[1].read_bytes()  # the same tensors to both
    got = safetensors.numpy.load_file(copies[0])
    assert got and set(got) < set(part) and all(got[n].tobytes() == part[n].tobytes() for n in got)
  assert [r['peers'] for r in results] == [
      sum((_state(tmp_path, j, 10) / f'process_{k}.safetensors.subset').stat().st_size
          for k in spread
          if k != j)
      for j in range(COUNT)
  ]


def test_a_part_every_other_process_lacks_goes_to_all_of_them_in_one_collective(
    tmp_path, compile_cache, s3_server, saved_10):
  """A job of fresh machines restored data parallel (every array whole on every process's
  devices): each process reads its own part from the remote, and both others need all of it.
  Each part goes to them together, one broadcast per window, compiled once, not in rounds of
  point-to-point sends (N - 1 rounds, each a collective compiled for its own pairs). Every host
  then holds every part, byte-identical. The plan, which lists every part, comes to the others
  over the interconnect too, not out of the coordinator's key-value store N - 1 times."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  url, whole = _uploaded_and_wiped(tmp_path, s3_server)
  results = _results(_run(tmp_path, compile_cache, 'restore-dp', url, '10'))
  assert [r['step'] for r in results] == [10] * COUNT
  assert [(r['rounds'], r['spreads']) for r in results] == [(0, COUNT)] * COUNT
  sizes = [(whole / 'state' / f'process_{k}.safetensors').stat().st_size for k in range(COUNT)]
  assert [r['remote'] for r in results] == sizes
  assert [r['peers'] for r in results] == [sum(sizes) - sizes[k] for k in range(COUNT)]
  # Process 0's plan (it grows with the processes) goes to the others over the interconnect:
  # each reads less of the key-value store than the plan's size, however many processes.
  assert results[0]['plan'] > 0 and [r['kv_received'] < results[0]['plan'] for r in results[1:]
                                    ] == [True] * (COUNT - 1), results
  for j in range(COUNT):
    for k in range(COUNT):
      assert (_state(tmp_path, j, 10) / f'process_{k}.safetensors').read_bytes() == \
          (whole / 'state' / f'process_{k}.safetensors').read_bytes()


@pytest.mark.parametrize(
    'cmd', ['restore-r0-enospc', 'restore-dp-enospc'], ids=['a subset', 'whole parts'])
def test_a_receiver_whose_disk_fills_while_a_part_spreads_stops_every_process_together(
    tmp_path, compile_cache, s3_server, saved_10, cmd):
  """A failed write of one window does not take that process out of the later windows'
  collectives (the others would wait there for ever): it takes part to the end, and every
  process then stops with E-CKPT-016 naming it. Where it was to send a part after that, its
  receivers' checks of what came (zeros) fail too: the error names its disk as the cause."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  url, _ = _uploaded_and_wiped(tmp_path, s3_server)
  for text in _run(tmp_path, compile_cache, cmd, url, '10', code=3):
    said = re.search(
        r'E-CKPT-016: the restore of step 10 from the peers failed on '
        r'process\(es\) \[([0-9, ]+)\]: (\S+): No space left on device', text)
    assert said and '2' in said[1].split(', ') and '/host2/' in said[2], text[-2000:]
  assert not list((tmp_path / 'host2').rglob('*.peer-tmp'))  # nothing half-received left


@pytest.mark.parametrize(
    'cmd,hung',
    [('restore-dp-hang', r'writing (\S+\.peer-tmp): not done after a wait of (3) s'),
     ('restore-dp-fetchhang', r'reading state/process_2.safetensors of step 10 from the remote '
      r'into (\S+): not done after a wait of ([0-9.]+) s')],
    ids=['a write of what it receives', 'a read of the remote'])
def test_a_disk_that_hangs_stops_every_process_together_naming_it(tmp_path, compile_cache,
                                                                  s3_server, saved_10, cmd, hung):
  """Process 2's disk hangs in a write of a part it receives, or in its read of its own part
  from the remote: after a bounded wait it gives that up (the read, half the group's timeout
  before the others stop waiting for it), takes part in every window to the end touching the
  disk no more, and every process stops with E-CKPT-023 naming the hang (not E-CKPT-016, after
  which the trainer has every host download: that host would hang there). Before, a read that
  hung left the others to stop with E-DIST-002, and process 2 in the read."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  url, _ = _uploaded_and_wiped(tmp_path, s3_server)
  for text in _run(tmp_path, compile_cache, cmd, url, '10', code=3):
    said = re.search(
        r'E-CKPT-023: the restore of step 10 from the peers stopped: a disk hung on '
        r'process\(es\) \[2\]: ' + hung + r' \(thread jaxckpt-receive\); a hung disk\?', text)
    # A read's wait: half the group's 8 s, less what came before it; the others wait all 8 s.
    assert said and '/host2/' in said[1] and 0 < float(said[2]) <= 4, text[-2000:]


def test_the_others_wait_for_a_slow_read_of_the_remote_past_the_groups_timeout(
    tmp_path, compile_cache, s3_server):
  """Every disk wiped, every array split: each process reads its own part from the remote and
  needs no other, so no collective holds the others while process 1's read takes twice the
  group's timeout; they wait for it, sized by the bytes it reads, and every restore completes.
  Before that, process 0's read of the checkpoint's own files takes as long: the others wait
  for its word as long as it said it needs (sized by those files and the records)."""
  _run(tmp_path, compile_cache, 'save-split', '10')
  url, whole = _uploaded_and_wiped(tmp_path, s3_server)
  results = _results(_run(tmp_path, compile_cache, 'restore-split-slow', url, '10'))
  sizes = [(whole / 'state' / f'process_{k}.safetensors').stat().st_size for k in range(COUNT)]
  assert [(r['step'], r['remote'], r['peers']) for r in results] == [(10, n, 0) for n in sizes]


def test_a_run_state_damaged_on_process_0_is_sent_it_from_a_process_that_holds_it_intact(
    tmp_path, compile_cache, saved_10):
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  run_state = tmp_path / 'host0' / 'step_00000010' / 'run_state.json'
  intact = run_state.read_bytes()
  run_state.write_bytes(intact.replace(b'10', b'11', 1))
  assert [r['step'] for r in _results(_run(tmp_path, compile_cache, 'restore'))] == [10] * COUNT
  assert run_state.read_bytes() == intact


def test_a_run_state_missing_on_a_host_does_not_hide_the_parts_it_holds(
    tmp_path, compile_cache, saved_10):
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  run_state = tmp_path / 'host1' / 'step_00000010' / 'run_state.json'
  run_state.unlink()
  (_state(tmp_path, 2, 10) / 'process_1.safetensors').unlink()  # host 1 holds the only copy
  assert [r['step'] for r in _results(_run(tmp_path, compile_cache, 'restore'))] == [10] * COUNT
  assert run_state.read_bytes() == (tmp_path / 'host0' / 'step_00000010' /
                                    'run_state.json').read_bytes()


def test_however_many_newer_steps_are_damaged_the_newest_whole_one_is_taken(
    tmp_path, compile_cache):
  steps = range(1, 11)
  _run(tmp_path, compile_cache, 'save', *map(str, steps))
  for step in steps[1:]:  # process 0's part of steps 2-10 damaged on host 0 and its replica's
    for k in (0, 1):
      path = _state(tmp_path, k, step) / 'process_0.safetensors'
      data = bytearray(path.read_bytes())
      data[-1] ^= 0xFF
      path.write_bytes(bytes(data))
  assert [r['step'] for r in _results(_run(tmp_path, compile_cache, 'restore'))] == [1] * COUNT


def test_a_file_process_0_fails_to_send_is_never_written_into_a_committed_step(
    tmp_path, compile_cache, saved_10):
  """Processes 1 and 2 hold step 10 but not its shard table, which only process 0's disk
  holds; process 0's copy is cut short while it sends it: every process stops together, and
  none is left with a bad shard table in its committed step."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  outs = _run(tmp_path, compile_cache, 'restore-cut', code=3)
  for k in (1, 2):
    assert not (tmp_path / f'host{k}' / 'step_00000010' / 'shards.json').exists()
  for text in outs:
    assert 'E-CKPT-016' in text and 'failed on process(es) [0, 1, 2]' in text, text[-2000:]


def test_process_0_failing_to_plan_stops_every_process_at_once(tmp_path, compile_cache, saved_10):
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  for text in _run(tmp_path, compile_cache, 'restore-eio', code=3):
    assert 'E-CKPT-016: process 0 could not decide a restore from the peers: OSError: ' \
        '[Errno 5] Input/output error' in text, text[-2000:]


def test_a_plan_that_arrives_damaged_stops_every_process_and_none_falls_back(
    tmp_path, compile_cache, saved_10):
  """Process 0's plan goes to the others in a collective, checked against the size and CRC-32
  it announced: where it arrives damaged, that process stops with E-DIST-003 (not E-CKPT-016,
  on which the trainer would have it alone download the remote's newest) and the others stop at
  their next wait, naming it."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  shutil.rmtree(tmp_path / 'host1')  # a replacement machine: the others send it its part
  texts = _run(tmp_path, compile_cache, 'restore-garbled', code=3)
  assert re.search(
      r'ERROR E-DIST-003: the plan of a restore from the peers arrived from process '
      r'0 damaged \(\d+ bytes, crc32 [0-9a-f]{8}; it sent \d+, [0-9a-f]{8}\)',
      texts[1]), texts[1][-2000:]
  for text in texts[0], texts[2]:
    assert re.search(r'ERROR E-DIST-002: .*process\(es\) \[1\] of 3 did not arrive', text), \
        text[-2000:]


@pytest.mark.parametrize(
    'cmd,what', [('restore-short', 'a restore of step 10 from the peers'),
                 ('restore-shortheld', 'a restore from the peers')],
    ids=['at its end', 'at its start'])
def test_a_store_that_answers_process_0_short_stops_every_process_naming_whose_word_is_missing(
    tmp_path, compile_cache, saved_10, cmd, what):
  """Process 0 reads what each process posts (what it holds, at the start; what went wrong, at
  the end): when the key-value store answers it without one process's word, it says whose (a
  shorter list would have each word taken for another process's: another host's parts, or a
  failed restore read as whole), and the others stop on its silence."""
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  shutil.rmtree(tmp_path / 'host1')
  texts = _run(tmp_path, compile_cache, cmd, code=3)
  assert f"ERROR E-DIST-002: {what}: every process arrived, but the key-value store's answer " \
      'lacks the word(s) of process(es) [2] of 3' in texts[0], texts[0][-2000:]
  for text in texts[1:]:
    assert f'ERROR E-DIST-002: {what}: no word from process 0' in text, text[-2000:]


def test_a_host_that_cannot_write_what_it_is_sent_stops_every_process_together(
    tmp_path, compile_cache, saved_10):
  shutil.copytree(saved_10, tmp_path, dirs_exist_ok=True)  # a copy of its own to change
  shutil.rmtree(tmp_path / 'host1')
  # A replacement host whose disk is full after the first part: it fails mid-transfer, yet takes
  # part in every collective to the end, so no process is left waiting in one.
  with mounted_tmpfs(tmp_path / 'host1', '8k'):
    outs = _run(tmp_path, compile_cache, 'restore', code=3)
  for text in outs:
    assert 'E-CKPT-016' in text and 'failed on process(es) [1]' in text, text[-2000:]
    assert 'No space left on device' in text, text[-2000:]


def test_a_restore_cut_short_leaves_nothing_half_received_for_the_next(tmp_path):
  """A SIGKILL during a peer restore can leave a file still being received in a committed step
  directory; the next restore removes it before anything else, and nothing of the checkpoint."""
  import jax.numpy as jnp

  from jaxckpt.checkpoint import CheckpointManager, peers
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(5, {'w': jnp.arange(8.0)})
  step_dir = tmp_path / 'step_00000005'
  kept = sorted(p for p in step_dir.rglob('*') if p.is_file())
  left = [
      step_dir / 'state' / 'process_1.safetensors.peer-tmp', step_dir / 'run_state.json.fetch-tmp'
  ]
  for path in left:
    path.write_bytes(b'half')
  assert sorted(peers.tidy(tmp_path)) == sorted(left)
  assert sorted(p for p in step_dir.rglob('*') if p.is_file()) == kept


def test_what_a_process_posts_it_holds_is_checked_before_process_0_counts_it():
  """A post is another process's word: an entry not of the shape `held` writes is left out
  (that checkpoint counts as not held there), never a crash of process 0's decision."""
  from jaxckpt.checkpoint import holdings
  good = {'seal': 'ab12cd34', 'files': {'state/process_1.safetensors': 512}}
  post = json.dumps({
      '10': good, 'x': good, '20': {'seal': 5, 'files': {}}, '30': {'seal': 's', 'files': []},
      '40': {'seal': 's', 'files': {'a': -1}}, '50': ['not', 'a',
                                                      'dict'], '²': good, '9' * 5000: good
  })
  assert holdings.view(1, post) == {'10': good}
  for raw in ('', 'null', '[1, 2]', '{"10": 3}', '{' * 5000):
    assert holdings.view(1, raw) == {}
  assert holdings.names('["a", "b"]') == ['a', 'b']
  assert holdings.names('["a", 3]') == holdings.names('{}') == holdings.names('nope') == []


if __name__ == '__main__':
  worker(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
