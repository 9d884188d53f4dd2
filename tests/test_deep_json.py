"""JSON nested too deeply to parse (Python raises RecursionError, not ValueError) is malformed
input like any other wherever jaxckpt reads JSON it did not just write: one line, never a
traceback. Also the bound on a mirrored file's parts index read from a bucket."""

import json
import struct

import pytest

from jaxckpt.checkpoint import CheckpointError, atomic, statefile
from jaxckpt.checkpoint.remote import Store, mirror
from jaxckpt.records import runlog

DEEP = b'[' * 100_000


def test_a_state_file_header_nested_too_deep_is_a_damaged_file(tmp_path):
  path = tmp_path / 'process_0.safetensors'
  path.write_bytes(struct.pack('<Q', len(DEEP)) + DEEP)
  with pytest.raises(CheckpointError) as e:
    statefile.read_header(path)
  assert e.value.code == 'E-CKPT-012' and 'header is not valid JSON' in e.value.what, e.value


def test_a_json_file_nested_too_deep_is_unreadable(tmp_path):
  (tmp_path / 'run_state.json').write_bytes(DEEP)
  with pytest.raises(CheckpointError) as e:
    atomic.read_json(tmp_path / 'run_state.json')
  assert e.value.code == 'E-CKPT-004', e.value


def test_a_record_line_nested_too_deep_is_passed_over(tmp_path):
  (tmp_path / 'events.jsonl').write_bytes(b'{"event": "a"}\n' + DEEP + b'\n{"event": "b"}\n')
  assert runlog.read_jsonl(tmp_path / 'events.jsonl') == [{'event': 'a'}, {'event': 'b'}]


# A well-formed index padded past the bound: it is not read whole, whatever it says.
LARGE = json.dumps({'size': 1, 'crc32': '00000000', 'part_bytes': 1 << 20
                   }).encode() + b' ' * (65 << 10)


@pytest.mark.parametrize('index', [DEEP, LARGE], ids=['deep', 'large'])
def test_a_mirrored_file_whose_parts_index_is_not_one_is_refused(tmp_path, index):
  (tmp_path / 'bucket').mkdir()
  store = Store(f'file://{tmp_path}/bucket/run')
  store.write('exports/model.safetensors' + mirror.PARTS_INDEX, index)
  out = tmp_path / 'model.safetensors'
  with pytest.raises(CheckpointError) as e:
    mirror.download_file(store, 'exports/model.safetensors', out)
  assert e.value.code == 'E-STORE-012' and mirror.PARTS_INDEX in e.value.what, e.value
  assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / 'bucket']
