"""A part of a shard read into its place (`jaxckpt.checkpoint.boxread`): straight when it is the
whole shard and one run of its buffer, else in windows of rows that never read more than
`WINDOW` bytes at once, CRC-checked when the part is the whole shard."""

import os
import zlib

import numpy as np
import pytest

from jaxckpt.checkpoint import CheckpointError, boxread
from jaxckpt.checkpoint.directio import pread_into

SHAPE = (64, 48)  # a shard of float32: rows of 192 bytes, 12 KiB in all


@pytest.fixture
def shard_file(tmp_path):
  data = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
  path = tmp_path / 'part.bin'
  path.write_bytes(b'\0' * 100 + data.tobytes())  # the shard's bytes start at offset 100
  fd = os.open(path, os.O_RDONLY)
  yield fd, data
  os.close(fd)


@pytest.fixture
def reads(monkeypatch):
  """The length of every read `boxread` makes, the real reads done."""
  got = []

  def counted(fd, view, offset):
    got.append(len(view))
    return pread_into(fd, view, offset)

  monkeypatch.setattr(boxread, 'pread_into', counted)
  monkeypatch.setattr(boxread, 'WINDOW', 1024)
  return got


def shard(start=(0, 0)):
  return {'shape': list(SHAPE), 'start': list(start), 'file': 'state/p.safetensors', 'tensor': 'w'}


def test_a_column_strip_is_read_in_windows_of_rows(shard_file, reads):
  fd, data = shard_file
  local, box = [(0, 64), (8, 40)], ((0, 64), (8, 40))  # a new mesh splits the columns
  buf = np.zeros((64, 32), np.float32)
  boxread._read_into(fd, 100, shard(), local, box, buf, np.dtype(np.float32), None)
  assert buf.tobytes() == data[:, 8:40].tobytes()
  assert max(reads) <= 1024 and sum(reads) < data.nbytes, reads  # not the 12 KiB range at once


def test_a_whole_shard_beside_another_is_read_in_windows_and_crc_checked(shard_file, reads):
  fd, data = shard_file
  box = ((0, 64), (0, 96))  # this shard is the left half of the box: not one run of it
  expect = f'{zlib.crc32(data.tobytes()):08x}'
  buf = np.zeros((64, 96), np.float32)
  boxread._read_into(fd, 100, shard(), [(0, 64), (0, 48)], box, buf, np.dtype(np.float32), expect)
  assert buf[:, :48].tobytes() == data.tobytes() and not buf[:, 48:].any()
  assert max(reads) <= 1024 and sum(reads) == data.nbytes, reads
  with pytest.raises(CheckpointError) as e:
    boxread._read_into(fd, 100, shard(), [(0, 64), (0, 48)], box, buf, np.dtype(np.float32),
                       '00000000')
  assert e.value.code == 'E-CKPT-003' and 'checksum mismatch' in e.value.what


def test_a_whole_shard_that_is_one_run_of_its_box_is_read_straight_into_place(shard_file, reads):
  fd, data = shard_file
  buf = np.zeros((128, 48), np.float32)  # rows 64..127 of the box: a split of leading rows
  boxread._read_into(fd, 100, shard((64, 0)), [(0, 64), (0, 48)], ((0, 128), (0, 48)), buf,
                     np.dtype(np.float32), f'{zlib.crc32(data.tobytes()):08x}')
  assert buf[64:].tobytes() == data.tobytes() and reads == [data.nbytes]


def test_a_shard_that_ends_early_is_named(tmp_path, reads):
  path = tmp_path / 'short.bin'
  path.write_bytes(b'\0' * 1000)
  fd = os.open(path, os.O_RDONLY)
  try:
    with pytest.raises(CheckpointError) as e:
      boxread._read_into(fd, 0, shard(), [(0, 64), (8, 40)], ((0, 64), (8, 40)),
                         np.zeros((64, 32), np.float32), np.dtype(np.float32), None)
  finally:
    os.close(fd)
  assert e.value.code == 'E-CKPT-012' and 'w ends early' in e.value.what


def test_a_leading_row_longer_than_a_window_is_read_a_dimension_down(tmp_path, reads):
  data = np.arange(2 * 16 * 64, dtype=np.float32).reshape(2, 16, 64)  # stacked layers' kernels
  path = tmp_path / 'stacked.bin'
  path.write_bytes(data.tobytes())
  fd = os.open(path, os.O_RDONLY)
  try:
    buf = np.zeros((2, 16, 32), np.float32)
    part = {**shard(), 'shape': [2, 16, 64], 'start': [0, 0, 0]}
    boxread._read_into(fd, 0, part, [(0, 2), (0, 16), (8, 40)], ((0, 2), (0, 16), (8, 40)), buf,
                       np.dtype(np.float32), None)
  finally:
    os.close(fd)
  assert buf.tobytes() == data[:, :, 8:40].tobytes()
  assert max(reads) <= 1024, reads  # a layer's range is 3,968 bytes
