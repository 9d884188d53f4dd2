"""What a peer restore sends a process that needs a few tensors of a part (`sends`): a state
file of those tensors alone, whose size and CRC-32 every process computes from the shard
table's rows without the bytes, read from the sender's copy of the part."""

import errno
import os
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import safetensors.numpy

from jaxckpt.checkpoint import CheckpointError, diskwork, sends, statefile


@pytest.fixture
def part(tmp_path):
  state = {
      'a': np.arange(40, dtype=np.float32).reshape(5, 8),
      'b': np.full((3,), 7, np.int32),
      'c': np.linspace(0, 1, 1000).astype(np.float32),
  }
  _, crcs = statefile.write(tmp_path, state)
  return tmp_path / statefile.file_name(0), state, crcs


def stream(path, tensors, size) -> bytes:
  """The bytes the sender sends, a window of 100 at a time (windows that cut segments)."""
  fd = os.open(path, os.O_RDONLY)
  try:
    segments = sends.segments_of(path, fd, tensors, size)
    out = bytearray(size)
    for lo in range(0, size, 100):
      sends.fill_window(fd, path, segments, memoryview(out)[lo:lo + 100], lo)
    return bytes(out)
  finally:
    os.close(fd)


def test_a_subset_is_a_state_file_of_those_tensors_its_crc_known_without_its_bytes(part, tmp_path):
  path, state, crcs = part
  tensors = [[n, statefile.CODES[str(state[n].dtype)],
              list(state[n].shape), crcs[n]] for n in ('c', 'a')]
  spec = sends.subset_spec(tensors)
  data = stream(path, tensors, spec['size'])
  assert f'{zlib.crc32(data):08x}' == spec['crc32'] and len(data) == spec['size']
  (tmp_path / 'subset.safetensors').write_bytes(data)
  got = safetensors.numpy.load_file(tmp_path / 'subset.safetensors')
  assert sorted(got) == ['a', 'c'] and all(got[n].tobytes() == state[n].tobytes() for n in got)
  assert spec['size'] < path.stat().st_size


def test_a_sender_whose_copy_is_not_as_the_shard_table_says_is_named(part):
  path, _, crcs = part
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(CheckpointError) as e:
      sends.segments_of(path, fd, [['a', 'F32', [8, 5], crcs['a']]], 0)
    assert e.value.code == 'E-CKPT-012' and 'a is not F32[8, 5]' in e.value.what
  finally:
    os.close(fd)


def test_a_subset_whose_bytes_differ_from_the_shard_table_fails_its_check(part):
  path, state, crcs = part
  tensors = [['b', 'I32', [3], crcs['a']]]  # another tensor's CRC-32: as a rotted tensor reads
  spec = sends.subset_spec(tensors)
  assert f'{zlib.crc32(stream(path, tensors, spec["size"])):08x}' != spec['crc32']


def _valid(pairs, rounds):
  assert sorted(p for r in rounds for p in r) == sorted(pairs)  # each pair once
  for r in rounds:  # no process sends, or receives, twice in a round
    assert len({src for _, src, _ in r}) == len(r) == len({dst for _, _, dst in r})


@pytest.mark.parametrize('count', [2, 3, 7, 40])
def test_when_every_process_sends_to_every_other_the_rounds_are_the_n_minus_1_shifts(count):
  """A data-parallel job of fresh machines: each process reads its part and every other needs
  it. The fewest rounds there can be (each process receives N - 1 parts, one a round)."""
  pairs = [(f'process_{s}', s, d) for s in range(count) for d in range(count) if d != s]
  got = sends.rounds(pairs)
  _valid(pairs, got)
  assert len(got) == count - 1


def test_rounds_of_any_pairs_are_valid_and_the_same_on_every_process():
  rng = np.random.default_rng(3)
  for _ in range(200):
    count = int(rng.integers(2, 10))
    pairs = [(f'f{int(rng.integers(20))}', int(s), int(d))
             for s, d in rng.integers(0, count, (int(rng.integers(0, 60)), 2))
             if s != d]
    got = sends.rounds(pairs)
    _valid(pairs, got)
    assert got == sends.rounds(list(pairs))  # what every process computes from the same list


def test_a_received_file_goes_in_only_whole_and_as_its_manifest_says(tmp_path):
  """What a receiver writes window by window is renamed in only when its size and CRC-32 are
  what they should be; otherwise nothing is left under its name or beside it."""
  data = np.frombuffer(os.urandom(1000), np.uint8)
  crc = f'{zlib.crc32(data.tobytes()):08x}'
  path = tmp_path / 'process_1.safetensors'
  problems = []
  landing = sends.Landing(path, 1000, problems)
  for lo in range(0, 1000, 256):  # windows of 256; the last one's tail past the file dropped
    window = np.zeros(256, np.uint8)
    window[:min(256, 1000 - lo)] = data[lo:lo + 256]
    landing.write(lo, window)
  assert landing.finish(crc, 'its manifest') is None and not problems
  assert path.read_bytes() == data.tobytes() and os.listdir(tmp_path) == [path.name]

  other = tmp_path / 'process_2.safetensors'
  landing = sends.Landing(other, 1000, problems)
  landing.write(0, data[:600])  # cut short
  problem = landing.finish(crc, 'its manifest')
  assert problem.startswith(f'{other}: what was received does not match its manifest')
  assert os.listdir(tmp_path) == [path.name]  # neither it nor its temporary name

  problems.append('OSError: the sender could not read')  # a problem met during the windows
  landing = sends.Landing(other, 1000, problems)
  landing.write(0, data)
  assert landing.finish(crc, 'its manifest') == 'OSError: the sender could not read'
  assert os.listdir(tmp_path) == [path.name]

  short = tmp_path / 'process_3.safetensors'  # all it was sent is intact, but not all came
  landing = sends.Landing(short, 1000, [])
  landing.write(0, data[:600])
  problem = landing.finish(f'{zlib.crc32(data[:600].tobytes()):08x}', 'its manifest')
  assert problem and '600 bytes' in problem and os.listdir(tmp_path) == [path.name]


def test_a_received_file_that_cannot_be_renamed_in_is_said_and_leaves_nothing(tmp_path):
  data = np.frombuffer(os.urandom(100), np.uint8)
  path = tmp_path / 'process_1.safetensors'
  (path / 'in-the-way').mkdir(parents=True)  # a directory where the file goes: rename fails
  landing = sends.Landing(path, 100, [])
  landing.write(0, data)
  problem = landing.finish(f'{zlib.crc32(data.tobytes()):08x}', 'its manifest')
  assert problem and problem.startswith(f'{path}'), problem
  assert sorted(os.listdir(tmp_path)) == [path.name] and os.listdir(path) == ['in-the-way']


def test_a_broadcast_hands_each_window_on_intact_however_slowly_it_is_written(monkeypatch):
  """The sender reads the next windows while the ones before are still being written: what each
  receiver keeps is each window's bytes, in order, even when its disk is slow (one process
  here, where the collective hands the sender's buffer back itself)."""
  from jaxckpt.checkpoint import spreads
  monkeypatch.setattr(sends, 'WINDOW', 4096)
  data = os.urandom(70_000)  # past SMALL: 18 windows of 4096, the last one short
  kept = []

  def fill(view, lo):
    view[:] = data[lo:lo + len(view)]

  def keep(lo, window):
    time.sleep(0.005)  # a slow disk: the reader runs windows ahead of it
    kept.append((lo, window.tobytes()))

  with diskwork.Disk() as disk:
    assert spreads._broadcast(len(data), fill, True, keep, disk) is None
  assert [lo for lo, _ in kept] == list(range(0, len(data), 4096))
  assert b''.join(w for _, w in kept) == data


@pytest.fixture
def hung(monkeypatch):
  """A disk that hangs: what waits on it blocks until the test ends (then it is let go)."""
  monkeypatch.setattr(diskwork, 'DISK_WAIT_SECS', 0.5)
  gate = threading.Event()

  def hang(*_):
    gate.wait(60)
    raise OSError('let go')

  yield hang
  gate.set()


def hung_line(what, thread):
  return f'{what}: not done after a wait of 0.5 s (thread {thread}); a hung disk?'


@pytest.mark.parametrize('where', ['read', 'write'])
def test_a_broadcast_whose_disk_hangs_names_it_and_still_takes_every_window(
    hung, monkeypatch, where):
  """A window's read (or write) that never returns: the broadcast goes on to its last window
  (sending zeros), since the other processes wait for each, and says what hung; the disk is
  then stuck, and nothing more runs on it."""
  from jax.experimental import multihost_utils

  from jaxckpt.checkpoint import spreads
  monkeypatch.setattr(sends, 'WINDOW', 4096)
  real, windows = multihost_utils.broadcast_one_to_all, []
  monkeypatch.setattr(multihost_utils, 'broadcast_one_to_all',
                      lambda x, is_source: windows.append(1) or real(x, is_source=is_source))
  data = os.urandom(70_000)
  kept = []

  def fill(view, lo):
    if where == 'read' and lo >= 3 * 4096:
      hung()
    view[:] = data[lo:lo + len(view)]

  def keep(lo, window):
    if where == 'write' and lo >= 3 * 4096:
      hung()
    kept.append((lo, window.tobytes()))

  started = time.monotonic()
  with diskwork.Disk() as disk:
    problem = spreads._broadcast(
        len(data), fill, True, keep, disk, 'reading /disk/part', 'writing /disk/part.tmp')
  assert time.monotonic() - started < 30
  line = hung_line('reading /disk/part', 'jaxckpt-send') if where == 'read' else hung_line(
      'writing /disk/part.tmp', 'jaxckpt-receive')
  assert problem == line == disk.stuck
  assert len(windows) == 18  # every window went through the collective
  assert b''.join(w for _, w in kept) == data[:3 * 4096]  # none kept once the disk hung


def test_a_task_that_times_out_itself_is_its_own_error_not_a_hang():
  """A read that fails at once with ETIMEDOUT (a soft NFS mount) is that error, and the disk is
  not taken for hung."""
  from jaxckpt.checkpoint import spreads

  def fill(view, lo):
    raise TimeoutError(errno.ETIMEDOUT, 'Connection timed out', '/nfs/part')

  with diskwork.Disk() as disk:
    problem = spreads._broadcast(100_000, fill, True, lambda *_: None, disk)
  assert problem == "[Errno 110] Connection timed out: '/nfs/part'" and disk.stuck is None


@pytest.fixture
def syscalls(monkeypatch):
  """The disk calls made (open, close, fsync, unlink, mkdir, rename) and the collectives run."""
  made = []
  for name in ('open', 'close', 'fsync', 'unlink', 'mkdir', 'replace', 'rename'):
    real = getattr(os, name)
    monkeypatch.setattr(
        os, name, lambda *a, real=real, name=name, **kw: made.append(name) or real(*a, **kw))
  from jax.experimental import multihost_utils
  moves, real_move = [], sends._move
  monkeypatch.setattr(sends, '_move', lambda *a: moves.append(1) or real_move(*a))
  real_bcast = multihost_utils.broadcast_one_to_all
  monkeypatch.setattr(multihost_utils, 'broadcast_one_to_all',
                      lambda x, is_source: moves.append(1) or real_bcast(x, is_source=is_source))
  return made, moves


@pytest.mark.parametrize('where', ['round', 'spread'])
def test_a_received_file_whose_write_hangs_is_named_and_its_disk_touched_no_more(
    part, hung, monkeypatch, tmp_path, syscalls, where):
  """Point to point (one process sending to itself) or to all at once: the write of a window
  never returns. The collectives go on to the end and the hang is named; the file in place is as
  it was, and the temporary one is left for the next restart, open (a call on a hung disk would
  hang too). The next sends on that disk make no disk call at all, and still take every
  window."""
  from jaxckpt.checkpoint import spreads
  path, _, _ = part
  before = path.read_bytes()
  monkeypatch.setattr(sends, 'WINDOW', 4096)
  monkeypatch.setattr(sends, 'SMALL', 1024)  # the part goes in windows of 4096 either way
  monkeypatch.setattr(diskwork.Landing, 'write', lambda *_: hung())
  made, moves = syscalls
  entry = {'size': len(before), 'crc32': f'{zlib.crc32(before):08x}'}
  into = path if where == 'round' else tmp_path / 'into' / path.name
  into.parent.mkdir(exist_ok=True)
  tmp = into.with_name(into.name + sends.layout.PEER_TMP)
  line = hung_line(f'writing {tmp}', 'jaxckpt-receive')
  windows = -(-len(before) // 4096)
  with diskwork.Disk() as disk:
    if where == 'round':
      got = sends.carry([(path.name, 0, 0)], {path.name: entry},
                        0,
                        lambda rel: path.parent / rel,
                        disk=disk)
    else:
      got = spreads.spread(path, None, into, entry, disk)
    assert got == (0, line) and disk.stuck == line and len(moves) == windows
    assert path.read_bytes() == before and tmp.exists() and not (into != path and into.exists())
    assert 'close' not in made and 'unlink' not in made and 'replace' not in made
    # Another carry, a spread and a broadcast with the same disk: no disk call, every window.
    made.clear()
    moves.clear()
    other = tmp_path / 'other'
    assert sends.carry([(path.name, 0, 0)], {path.name: entry},
                       0,
                       lambda rel: path.parent / rel,
                       disk=disk) == (0, line)
    assert spreads.spread(path, None, other, entry, disk) == (0, line)
    assert spreads.broadcast(path, 100, True, disk) == (b'', line)
    assert made == [] and len(moves) == 2 * windows + 1
  assert not other.exists() and not other.with_name('other' + sends.layout.PEER_TMP).exists()


def test_a_path_that_cannot_be_found_is_said_and_every_window_still_goes(part, syscalls):
  """A part's path that fails on one process (a link out of the checkpoint): that process says
  so and takes part in every window, sending zeros, rather than leaving the others waiting."""
  path, _, _ = part
  _, moves = syscalls
  entry = {'size': path.stat().st_size, 'crc32': '00000000'}

  def path_of(rel):
    raise CheckpointError('E-CKPT-005', f'{rel}: a link that leads out of it', 'do not load it')

  with diskwork.Disk() as disk:
    got = sends.carry([(path.name, 0, 0)], {path.name: entry}, 0, path_of, disk=disk)
  assert got == (0, f'E-CKPT-005: {path.name}: a link that leads out of it; do not load it')
  assert len(moves) == -(-entry['size'] // sends.WINDOW)


def test_a_task_that_moves_bytes_is_waited_for_longer_by_them(monkeypatch):
  """The fsync of a large file received flushes what the page cache holds of it: its wait grows
  with its bytes, so a slow but working disk is not taken for hung; the same task with no bytes
  counted is."""
  monkeypatch.setattr(diskwork, 'DISK_WAIT_SECS', 0.1)
  monkeypatch.setattr(diskwork, 'DISK_BYTES_PER_SEC', 100)
  with diskwork.Disk() as disk:
    assert disk.run('t', 'syncing a', lambda: time.sleep(0.3) or 'done', nbytes=300) == 'done'
    assert disk.stuck is None
    with pytest.raises(diskwork.Stuck, match='syncing b: not done after a wait of 0.1 s'):
      disk.run('t', 'syncing b', time.sleep, 1)


def test_a_task_given_its_own_wait_is_waited_for_that_long(monkeypatch):
  """A read of the remote is given up before the others stop waiting for it: its wait is its
  own, not the disk's default, either way."""
  monkeypatch.setattr(diskwork, 'DISK_WAIT_SECS', 0.1)
  with diskwork.Disk() as disk:
    assert disk.run('t', 'reading a', lambda: time.sleep(0.3) or 'done', wait=5) == 'done'
    with pytest.raises(diskwork.Stuck, match='reading b: not done after a wait of 0.2 s'):
      disk.run('t', 'reading b', time.sleep, 1, nbytes=10**9, wait=0.2)


def test_a_process_whose_disk_hung_exits_without_waiting_for_the_stuck_thread():
  """A library caller (not the trainer, which leaves with `os._exit`) returns from its script
  after a restore stopped on a hung disk: its process exits, the stuck thread left behind."""
  script = ('import threading\n'
            'from jaxckpt.checkpoint import diskwork\n'
            'diskwork.DISK_WAIT_SECS = 0.2\n'
            'with diskwork.Disk() as disk:\n'
            '  try:\n'
            "    disk.run('jaxckpt-receive', 'writing part', threading.Event().wait)\n"
            '  except diskwork.Stuck as e:\n'
            '    print(e)\n'
            "print('done')\n")
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == [
      'writing part: not done after a wait of 0.2 s (thread jaxckpt-receive); a hung disk?', 'done'
  ]


def test_a_disk_task_handed_over_after_the_disk_was_left_is_refused_at_once():
  """Its thread was let go: the task would never run, and waiting for it would call the disk
  hung after DISK_WAIT_SECS."""
  with diskwork.Disk() as disk:
    assert disk.run('t', 'reading a', lambda: 'done') == 'done'
  with pytest.raises(RuntimeError, match='after it was let go'):
    disk.run('t', 'reading b', lambda: 'done')
