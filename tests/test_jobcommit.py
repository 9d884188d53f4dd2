"""Process 0's word after a commit across processes (`jobcommit`): on each host's own disk it
carries the job's file table, which every other host's manifest lists byte for byte."""

import pytest

from jaxckpt.checkpoint import CheckpointError, jobcommit


def files(count: int) -> dict:
  out = {'shards.json': {'size': 4242, 'crc32': '0000beef'}}
  for k in range(count):
    out[f'state/process_{k}.safetensors'] = {'size': 2**40 + k, 'crc32': f'{k * 7919:08x}'}
  return out


@pytest.mark.parametrize('count', [1, 2, 1024])
def test_the_word_gives_back_the_files_it_was_given(count):
  kept = {'kept': ['keep_every', 'best'], 'best': {'metric': 'eval loss', 'value': 2.5}}
  said = jobcommit.word(1764800000.123456, files(count), count, kept, copies=count - 1)
  at, got, retention, copies = jobcommit.parse(said, 7, count)
  assert at == 1764800000.123456 and got == files(count) and retention == kept
  assert copies == count - 1  # the replicas the job confirmed of each part
  assert jobcommit.parse(jobcommit.word(1.5, files(count), count), 7, count)[3] is None
  # The order of each entry's fields is the manifest's: size, then CRC-32.
  assert all(list(f) == ['size', 'crc32'] for f in got.values())
  assert len(said) < 16 * count + 200  # 16 bytes a process, not every process's record


def test_a_shared_directorys_word_is_the_time_alone():
  assert jobcommit.word(1.5, None) == 'ok 1.5'
  assert jobcommit.parse('ok 1.5', 3, None) == (1.5, None, None, None)


@pytest.mark.parametrize(
    'said, count, what',
    [
        ('OSError: [Errno 28] No space left on device', 2, 'process 0 did not commit: OSError'),
        ('ok 1.5', 2, 'does not parse here (2 fields)'),  # a process 0 of before file tables
        (jobcommit.word(1.5, files(3), 3), 2, '3 state files for 2 processes'),
        ('ok 1.5 [] AAAA - {}', 2, 'does not parse here'),
        (jobcommit.word(1.5, files(2), 2).rsplit(' ', 1)[0], 2, '5 fields'),  # no retention
        (jobcommit.word(1.5, files(2), 2, copies=-1), 2, 'a replica count of -1'),
        (jobcommit.word(1.5, files(2), 2).replace(' - ', ' x ', 1), 2, 'does not parse here'),
        (jobcommit.word(1.5, files(2), 2).rsplit(' ', 1)[0] + ' []', 2, 'its retention record'),
        (jobcommit.word(1.5, files(2), 2, {'kept': 5}), 2, 'its retention record is not'),
        (jobcommit.word(1.5, files(2), 2).rsplit(' ', 1)[0] + ' ' + '[' * 100000, 2, 'parse here'),
        (jobcommit.word(1.5, {**files(2), 'shards.json': 1}, 2), 2, 'its file list is not'),
        (jobcommit.word(1.5, {**files(2), 'shards.json': {'size': 1, 'crc32': 'BEEF'}},
                        2), 2, 'its file list is not'),
        ('ok 1.5 {} not-base64!', 2, 'does not parse here'),
        ('ok soon {} ', 2, 'does not parse here'),
    ])
def test_a_word_not_as_expected_is_one_line_naming_process_0(said, count, what):
  with pytest.raises(CheckpointError) as e:
    jobcommit.parse(said, 9, count)
  assert e.value.code == 'E-DIST-003' and what in e.value.line(), e.value.line()
  assert '\n' not in e.value.line()
