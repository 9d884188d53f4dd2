"""The state file on its own: host arrays in, a standard safetensors file, the same bytes out."""

import errno
import fcntl
import json
import logging
import os
import zlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch

from jaxckpt.checkpoint import checksum, directio, staging, statefile
from jaxckpt.errors import CheckpointError

MIB = 1 << 20


def arrays():
  """Every layout case: empty, scalar, small runs, tensors of several item sizes and of sizes
  that are not multiples of 64 bytes, one spanning several write chunks."""
  rng = np.random.default_rng(0)
  return {
      'a/empty': np.zeros((0, 3), np.float32),
      'b/step': np.array(7, np.int32),
      'c/ln_scale': rng.standard_normal(768).astype(np.float32),
      'd/odd': rng.integers(0, 255, 4099, dtype=np.uint8),
      'e/bf16': rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
      'f/wte': rng.standard_normal((1024, 768)).astype(np.float32),
      'g/count': np.array(123456789, np.int64),
      'h/big': rng.integers(0, 1 << 30, (70 * MIB + 12) // 4, dtype=np.int32),  # > one chunk
      'i/tail': np.arange(5, dtype=np.float32),
      'j/mask': np.array([True, False, True]),
  }


@pytest.fixture(scope='module')
def written(tmp_path_factory):
  directory = tmp_path_factory.mktemp('state')
  state = arrays()
  files, crcs = statefile.write(directory, state)
  return directory, state, files[statefile.file_name(0)]['crc32'], crcs


def same(a, b) -> bool:
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_round_trip_is_byte_exact_with_the_file_crc_checked(written):
  directory, state, crc, _ = written
  got = statefile.read(directory, expect_crc32=crc)
  assert sorted(got) == sorted(state)
  assert all(same(got[n], x) for n, x in state.items())


def test_any_safetensors_reader_loads_it(written):
  directory, state, _, _ = written
  path = directory / statefile.file_name(0)
  plain = {n: x for n, x in state.items() if n != 'e/bf16'}  # numpy has no bfloat16
  loaded = safetensors.numpy.load_file(path)
  assert all(same(loaded[n], x) for n, x in plain.items())
  tensors = safetensors.torch.load_file(path)
  assert sorted(tensors) == sorted(state)
  assert tensors['e/bf16'].view(dtype=__import__('torch').int16).numpy().tobytes() == \
      state['e/bf16'].tobytes()
  assert tensors['f/wte'].numpy().tobytes() == state['f/wte'].tobytes()


def test_the_layout_keeps_data_aligned_and_the_file_exact(written):
  directory, state, crc, crcs = written
  path = directory / statefile.file_name(0)
  header_len, entries, meta = statefile.read_header(path)
  assert header_len % directio.ALIGN == 0  # the data region starts 4 KiB-aligned
  assert path.stat().st_size == header_len + sum(x.nbytes for x in state.values())
  for name, entry in entries.items():
    b, _ = entry['data_offsets']
    assert b % state[name].dtype.itemsize == 0, name
    if state[name].nbytes % 64 == 0:
      assert b % 64 == 0, name
  assert meta['format'] == statefile.FORMAT
  assert {n: meta[f'crc32/{n}'] for n in state} == crcs
  assert crcs['f/wte'] == f'{zlib.crc32(state["f/wte"].tobytes()):08x}'
  assert f'{zlib.crc32(path.read_bytes()):08x}' == crc  # the manifest's value is zlib's


@pytest.mark.parametrize('direct', [True, False])
def test_a_subset_is_read_alone(written, direct):
  directory, state, _, crcs = written
  names = ['i/tail', 'c/ln_scale', 'f/wte', 'b/step', 'e/bf16']
  got = statefile.read(directory, names, tensor_crc32=crcs, direct=direct)
  assert sorted(got) == sorted(names) and all(same(got[n], state[n]) for n in names)


def test_restored_tensors_are_aligned_and_writable(written):
  directory, state, crc, _ = written
  for name, x in statefile.read(directory, expect_crc32=crc).items():
    assert x.ctypes.data % x.dtype.itemsize == 0, name
    x[...] = 0  # numpy consumers (exports, torch.from_numpy) may write


def test_placing_sees_every_tensor_once(written):
  directory, state, crc, _ = written
  batches = []
  got = statefile.read(directory, expect_crc32=crc, place=lambda a: batches.append(list(a)) or a)
  assert sorted(n for b in batches for n in b) == sorted(state) and len(got) == len(state)


@pytest.mark.parametrize('whole', [True, False])
def test_a_read_holds_two_windows_of_host_memory_not_the_state(tmp_path, monkeypatch, whole):
  """On an accelerator the read buffers are copied to the device and dropped: a read allocates
  a buffer per window of tensors (a larger tensor: its own), the next one while this one is
  placed, never one for the whole state."""
  state = {f'w/{i}': np.full(3000 + i, i, np.float32) for i in range(8)}  # ~12 KB each
  state['big'] = np.arange(40_000, dtype=np.int32)  # 160 KB: over the window
  files, crcs = statefile.write(tmp_path, state)
  monkeypatch.setattr(statefile, '_WINDOW', 32 << 10)
  buffers = []

  def recorded(*args, **kw):
    buffers.append(real(*args, **kw))
    return buffers[-1]

  real = statefile.aligned_empty
  monkeypatch.setattr(statefile, 'aligned_empty', recorded)
  taken = []  # which buffer each placed batch lies in, and how many were allocated by then

  def place(batch):
    for x in batch.values():
      at = next(i for i, b in enumerate(buffers) if np.shares_memory(b, x))
      taken.append((at, len(buffers)))
    return batch

  expect = {'expect_crc32': files[statefile.file_name(0)]['crc32']
           } if whole else {'tensor_crc32': crcs}
  got = statefile.read(tmp_path, None if whole else sorted(state), place=place, **expect)
  assert all(same(got[n], x) for n, x in state.items())
  data = [b for b in buffers if b.nbytes > directio.ALIGN]  # the header's own read aside
  largest = max(b.nbytes for b in data if not np.shares_memory(b, got['big']))
  assert len(data) >= 4 and largest <= (32 << 10) + 2 * directio.ALIGN
  assert all(allocated <= at + 2 for at, allocated in taken)  # this window and the next


@pytest.mark.parametrize('names', [None, ['b/empty']])
def test_an_empty_tensor_after_one_over_the_window_is_read(tmp_path, monkeypatch, names):
  state = {'a/big': np.arange(16 << 10, dtype=np.float32), 'b/empty': np.zeros((0, 4), np.float32)}
  files, crcs = statefile.write(tmp_path, state)
  monkeypatch.setattr(statefile, '_WINDOW', 32 << 10)  # 'a/big' (64 KiB) is a window alone
  got = statefile.read(
      tmp_path, names, expect_crc32=files[statefile.file_name(0)]['crc32'], tensor_crc32=crcs)
  assert all(same(got[n], state[n]) for n in (names or state))


def flip(path, offset):
  with open(path, 'r+b') as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 1]))


def test_a_flipped_data_byte_is_a_checksum_error_and_a_subset_checks_its_own(tmp_path):
  state = arrays()
  files, crcs = statefile.write(tmp_path, state)
  path = tmp_path / statefile.file_name(0)
  header_len, entries, _ = statefile.read_header(path)
  flip(path, header_len + entries['f/wte']['data_offsets'][0] + 12345)
  with pytest.raises(CheckpointError, match='E-CKPT-003.*checksum mismatch'):
    statefile.read(tmp_path, expect_crc32=files[statefile.file_name(0)]['crc32'])
  intact = statefile.read(tmp_path, ['c/ln_scale', 'h/big'], tensor_crc32=crcs)
  assert same(intact['h/big'], state['h/big'])
  with pytest.raises(CheckpointError, match='E-CKPT-003.*f/wte: crc32'):
    statefile.read(tmp_path, ['c/ln_scale', 'f/wte'], tensor_crc32=crcs)


def small_file(tmp_path):
  state = {'w': np.arange(12, dtype=np.float32).reshape(3, 4), 'b': np.arange(3, dtype=np.int32)}
  statefile.write(tmp_path, state)
  return tmp_path / statefile.file_name(0)


def rewrite_header(path, edit):
  """Replace the header with `edit(header dict)`, keeping the data; lengths as the edit makes."""
  raw = path.read_bytes()
  n = int.from_bytes(raw[:8], 'little')
  header = json.loads(raw[8:8 + n])
  text = json.dumps(edit(header)).encode()
  path.write_bytes(len(text).to_bytes(8, 'little') + text + raw[8 + n:])


def shift_w(header):
  header['w']['data_offsets'] = [o + 4 for o in header['w']['data_offsets']]
  return header


def grow_shape(header):
  header['w']['shape'] = [4, 4]
  return header


def bad_dtype(header):
  header['w']['dtype'] = 'F31'
  return header


@pytest.mark.parametrize('damage, says', [
    (lambda p: p.write_bytes(p.read_bytes()[:-3]), 'truncated or padded'),
    (lambda p: p.write_bytes(p.read_bytes() + b'\0' * 5), 'truncated or padded'),
    (lambda p: rewrite_header(p, shift_w), 'hole or an overlap'),
    (lambda p: rewrite_header(p, grow_shape), 'do not hold'),
    (lambda p: rewrite_header(p, bad_dtype), 'is not valid'),
    (lambda p: p.write_bytes((10**9).to_bytes(8, 'little') + p.read_bytes()[8:]), 'limit'),
    (lambda p: p.write_bytes(p.read_bytes()[:5]), 'shorter than a safetensors header'),
    (lambda p: flip(p, 8), 'not valid JSON'),
])
def test_a_state_file_that_lies_is_one_line_naming_it(tmp_path, damage, says):
  path = small_file(tmp_path)
  damage(path)
  with pytest.raises(CheckpointError) as e:
    statefile.read(tmp_path)
  assert e.value.code == 'E-CKPT-012' and str(path) in e.value.what and says in e.value.what
  assert '\n' not in e.value.line()


def test_a_dtype_safetensors_cannot_hold_is_refused_before_writing(tmp_path):
  with pytest.raises(CheckpointError, match='E-CKPT-013.*complex64'):
    statefile.write(tmp_path, {'z': np.zeros(3, np.complex64)})


def test_arrays_anywhere_in_memory_give_the_same_file_as_the_staging_region(tmp_path):
  """A save without a staged copy gathers the tensors through bounce buffers; a staged save
  writes the stager's region as it is: the two files are the same bytes."""
  state = arrays()
  stager = staging.HostStager()
  staged = stager.stage(state)
  statefile.write(tmp_path / 'staged', staged, region=stager.region)
  statefile.write(tmp_path / 'gathered', state)
  name = statefile.file_name(0)
  assert (tmp_path / 'staged' / name).read_bytes() == (tmp_path / 'gathered' / name).read_bytes()
  stager.close()


def test_many_tiny_tensors_round_trip(tmp_path):
  """A state of 20k tensors (optimizer states of many-layer models come close) is written and
  read back whole, and as a subset, with every checksum checked."""
  state = {
      f't/{i:05d}': np.full(i % 5 + 1, i, np.int32 if i % 2 else np.float32) for i in range(20_000)
  }
  files, crcs = statefile.write(tmp_path, state)
  got = statefile.read(tmp_path, expect_crc32=files[statefile.file_name(0)]['crc32'])
  assert sorted(got) == sorted(state) and all(same(got[n], x) for n, x in state.items())
  subset = sorted(state)[::7]
  got = statefile.read(tmp_path, subset, tensor_crc32=crcs)
  assert sorted(got) == subset and all(same(got[n], state[n]) for n in subset)


def test_crc32_and_its_combine_match_zlib():
  data = np.random.default_rng(1).bytes(10000)
  assert checksum.crc32(data) == zlib.crc32(data)
  for cut in (0, 1, 4096, 9999, 10000):
    a, b = zlib.crc32(data[:cut]), zlib.crc32(data[cut:])
    assert checksum.crc32_combine(a, b, len(data) - cut) == zlib.crc32(data)


def test_aligned_empty_buffers_are_zero_padded():
  for populate in (True, False):
    for shape in [(3,), (1024, 1024)]:
      x = directio.aligned_empty(shape, np.float32, populate=populate)
      assert x.ctypes.data % directio.ALIGN == 0
      x[...] = 1
      view = directio.padded_view(x)
      assert len(view) == directio.padded(x.nbytes)
      assert not any(bytes(view[x.nbytes:]))


@pytest.mark.skipif(not hasattr(os, 'O_DIRECT'), reason='no O_DIRECT here')
def test_a_filesystem_that_fails_direct_transfers_falls_back_to_buffered(
    tmp_path, monkeypatch, caplog):
  """Some mounts accept O_DIRECT at open and fail each transfer with EINVAL: write and read
  still work (buffered + fsync), and the path taken is logged once."""
  real_pwrite, real_preadv = os.pwrite, os.preadv

  def refuse_direct(real):

    def transfer(fd, *args):
      if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
        raise OSError(errno.EINVAL, 'Invalid argument')
      return real(fd, *args)

    return transfer

  monkeypatch.setattr(os, 'pwrite', refuse_direct(real_pwrite))
  monkeypatch.setattr(os, 'preadv', refuse_direct(real_preadv))
  monkeypatch.setattr(directio, '_said', set())
  caplog.set_level(logging.INFO, logger=directio.__name__)
  state = arrays()
  files, _ = statefile.write(tmp_path, state)
  out = statefile.read(tmp_path, expect_crc32=files[statefile.file_name(0)]['crc32'])
  assert all(same(out[n], x) for n, x in state.items())
  fallbacks = [r for r in caplog.records if 'fails its transfers' in r.getMessage()]
  assert len(fallbacks) == 1
