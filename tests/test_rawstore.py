"""The raw array store on its own: host numpy arrays in, the same bytes out."""

import zlib

import ml_dtypes
import numpy as np
import pytest

from jaxckpt.checkpoint import checksum, rawstore
from jaxckpt.errors import CheckpointError

MIB = 1 << 20


def arrays():
  """Every layout case `read` groups differently: empty, scalar, small runs, huge-page sized
  buffers, one spanning several read chunks, odd byte counts that need padding."""
  rng = np.random.default_rng(0)
  return {
      'a/empty': np.zeros((0, 3), np.float32),
      'b/step': np.array(7, np.int32),
      'c/ln_scale': rng.standard_normal(768).astype(np.float32),
      'd/odd': rng.integers(0, 255, 4099, dtype=np.uint8),
      'e/bf16': rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
      'f/wte': rng.standard_normal((1024, 768)).astype(np.float32),  # 3 MiB: its own buffer
      'g/bias': rng.standard_normal(3072).astype(np.float32),
      'h/big': rng.integers(0, 1 << 30, (70 * MIB + 12) // 4, dtype=np.int32),  # > one chunk
      'i/tail': np.arange(5, dtype=np.float32),
  }


@pytest.fixture(scope='module')
def written(tmp_path_factory):
  directory = tmp_path_factory.mktemp('raw')
  state = arrays()
  table = rawstore.write(directory, state)
  return directory, state, table[rawstore.DATA]['crc32']


def test_round_trip_is_byte_exact_with_the_file_crc_checked(written):
  directory, state, crc = written
  got = rawstore.read(directory, expect_crc32=crc)
  assert list(got) == sorted(state)
  for name, x in state.items():
    assert got[name].dtype == x.dtype and got[name].shape == x.shape, name
    assert got[name].tobytes() == x.tobytes(), name


def test_the_recorded_crc_is_zlibs_crc32_of_the_file(written):
  directory, _, crc = written
  data = (directory / rawstore.DATA).read_bytes()
  assert f'{zlib.crc32(data):08x}' == crc
  assert checksum.crc32(data) == zlib.crc32(data)
  assert checksum.crc32(data[5000:], checksum.crc32(data[:5000])) == zlib.crc32(data)


@pytest.mark.parametrize('direct', [True, False])
def test_a_subset_is_read_alone(written, direct):
  directory, state, _ = written
  names = ['i/tail', 'c/ln_scale', 'f/wte', 'b/step']
  got = rawstore.read(directory, names, direct=direct)
  assert sorted(got) == sorted(names)
  for name in names:
    assert got[name].tobytes() == state[name].tobytes(), name


def test_restored_arrays_are_page_aligned_and_writable(written):
  directory, _, crc = written
  for name, x in rawstore.read(directory, expect_crc32=crc).items():
    assert x.ctypes.data % rawstore.ALIGN == 0, name  # what zero-copy device_put needs
    x[...] = 0  # numpy consumers (exports, torch.from_numpy) may write


def test_a_flipped_byte_is_a_checksum_error(tmp_path):
  state = arrays()
  crc = rawstore.write(tmp_path, state)[rawstore.DATA]['crc32']
  with open(tmp_path / rawstore.DATA, 'r+b') as f:
    f.seek(rawstore.padded(state['a/empty'].nbytes) + 3 * MIB)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 1]))
  with pytest.raises(CheckpointError, match='E-CKPT-003.*checksum mismatch'):
    rawstore.read(tmp_path, expect_crc32=crc)


def test_a_subset_is_checked_against_its_own_checksums(tmp_path):
  state = arrays()
  crc = rawstore.write(tmp_path, state)[rawstore.DATA]['crc32']
  index = rawstore.read_index(tmp_path)
  with open(tmp_path / rawstore.DATA, 'r+b') as f:  # damage f/wte only
    f.seek(index['f/wte']['offset'] + 12345)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 1]))
  intact = rawstore.read(tmp_path, ['c/ln_scale', 'h/big'], expect_crc32=crc)
  assert intact['h/big'].tobytes() == state['h/big'].tobytes()
  with pytest.raises(CheckpointError, match='E-CKPT-003.*f/wte: checksum mismatch'):
    rawstore.read(tmp_path, ['c/ln_scale', 'f/wte'], expect_crc32=crc)


def test_a_truncated_file_is_an_error_not_a_hang(tmp_path):
  state = {'w': np.ones(3 * MIB // 4, np.float32)}
  rawstore.write(tmp_path, state)
  with open(tmp_path / rawstore.DATA, 'r+b') as f:
    f.truncate(MIB)
  with pytest.raises(CheckpointError, match='E-CKPT-003.*shorter'):
    rawstore.read(tmp_path)


def test_aligned_empty_buffers_are_zero_padded(tmp_path):
  for populate in (True, False):
    for shape in [(3,), (1024, 1024)]:
      x = rawstore.aligned_empty(shape, np.float32, populate=populate)
      assert x.ctypes.data % rawstore.ALIGN == 0
      x[...] = 1
      view = rawstore._padded_view(x)
      assert len(view) == rawstore.padded(x.nbytes)
      assert not any(bytes(view[x.nbytes:]))


@pytest.mark.skipif(not hasattr(__import__('os'), 'O_DIRECT'), reason='no O_DIRECT here')
def test_a_filesystem_that_fails_direct_transfers_falls_back_to_buffered(
    tmp_path, monkeypatch, caplog):
  """Some mounts accept O_DIRECT at open and fail each transfer with EINVAL: write and read
  still work (buffered + fsync), and the path taken is logged once."""
  import errno
  import fcntl
  import logging
  import os
  real_pwrite, real_preadv = os.pwrite, os.preadv

  def refuse_direct(real):

    def transfer(fd, *args):
      if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
        raise OSError(errno.EINVAL, 'Invalid argument')
      return real(fd, *args)

    return transfer

  monkeypatch.setattr(os, 'pwrite', refuse_direct(real_pwrite))
  monkeypatch.setattr(os, 'preadv', refuse_direct(real_preadv))
  monkeypatch.setattr(rawstore, '_said', set())
  caplog.set_level(logging.INFO, logger=rawstore.__name__)
  state = arrays()
  table = rawstore.write(tmp_path, state)
  out = rawstore.read(tmp_path, expect_crc32=table[rawstore.DATA]['crc32'])
  assert {k: v.tobytes() for k, v in out.items()} == {k: v.tobytes() for k, v in state.items()}
  fallbacks = [r for r in caplog.records if 'fails its transfers' in r.getMessage()]
  assert len(fallbacks) == 1
