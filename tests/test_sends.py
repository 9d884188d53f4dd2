"""What a peer restore sends a process that needs a few tensors of a part (`sends`): a state
file of those tensors alone, whose size and CRC-32 every process computes from the shard
table's rows without the bytes, read from the sender's copy of the part."""

import os
import zlib

import numpy as np
import pytest
import safetensors.numpy

from jaxckpt.checkpoint import CheckpointError, sends, statefile


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
    segments = sends._segments(path, fd, tensors, size)
    out = bytearray(size)
    for lo in range(0, size, 100):
      sends._fill(fd, path, segments, memoryview(out)[lo:lo + 100], lo)
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
      sends._segments(path, fd, [['a', 'F32', [8, 5], crcs['a']]], 0)
    assert e.value.code == 'E-CKPT-012' and 'a is not F32[8, 5]' in e.value.what
  finally:
    os.close(fd)


def test_a_subset_whose_bytes_differ_from_the_shard_table_fails_its_check(part):
  path, state, crcs = part
  tensors = [['b', 'I32', [3], crcs['a']]]  # another tensor's CRC-32: as a rotted tensor reads
  spec = sends.subset_spec(tensors)
  assert f'{zlib.crc32(stream(path, tensors, spec["size"])):08x}' != spec['crc32']
