"""Token data at real size: `.bin` shards are memory-mapped, a source is any number of shard files,
and the batches depend on the tokens alone, not on how they are split into files."""

import subprocess
import sys
import textwrap

import ml_collections
import numpy as np
import pytest
from conftest import REPO, subprocess_env

from jaxckpt.errors import ConfigError
from jaxckpt.model import data

GiB = 1 << 30


def _config(source):
  from conftest import tiny_config
  config = tiny_config()
  with config.unlocked():  # a fresh dict: a config file may name one source by a string
    config.data.sources = ml_collections.ConfigDict({'main': source})
  return config


def _tokens(n=60_000, seed=0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint16)


def _batches(ds) -> list[np.ndarray]:
  return [ds.batch(step)[0] for step in range(0, 40, 3)] + [x for x, _ in ds.heldout_batches(3)]


def test_one_file_and_the_same_tokens_in_three_shards_give_the_same_batches(tmp_path):
  tokens = _tokens()
  whole = tmp_path / 'whole.bin'
  tokens.astype('<u2').tofile(whole)
  (tmp_path / 'shards').mkdir()
  shards = []
  for k, part in enumerate(np.split(tokens, [7, 31_001])):  # uneven: windows span the seams
    shards.append(tmp_path / 'shards' / f'train_{k:03d}.bin')
    part.astype('<u2').tofile(shards[-1])
  expected = _batches(data.from_config(_config((str(whole),))))
  forms = {
      'tuple': tuple(map(str, shards)),
      'comma-separated (as a flag gives it)': (','.join(map(str, shards)),),
      'one string': ','.join(map(str, shards)),
      'glob': (str(tmp_path / 'shards' / 'train_*.bin'),),
  }
  for form, source in forms.items():
    got = _batches(data.from_config(_config(source)))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected)), form
  ds = data.from_config(_config(forms['glob']))
  (main,) = ds.sources
  assert len(main.train) + len(main.heldout) == len(tokens)
  np.testing.assert_array_equal(np.asarray(main.heldout), tokens[len(main.train):])
  # A window across a seam holds the tokens on both sides of it.
  np.testing.assert_array_equal(main.train.take(np.arange(3, 12)), tokens[3:12])


@pytest.mark.parametrize('kind, code', [('missing', 'E-DATA-001'), ('odd', 'E-DATA-005'),
                                        ('empty', 'E-DATA-006'), ('no match', 'E-DATA-001')])
def test_a_bad_shard_is_refused_by_name(tmp_path, kind, code):
  good = tmp_path / 'a.bin'
  _tokens().astype('<u2').tofile(good)
  bad = tmp_path / ('b_*.bin' if kind == 'no match' else 'b.bin')
  if kind == 'odd':
    bad.write_bytes(b'\x01\x00\x02')
  elif kind == 'empty':
    bad.write_bytes(b'')
  with pytest.raises(ConfigError) as e:
    data.from_config(_config((str(good), str(bad))))
  assert e.value.code == code and str(bad) in e.value.line() and '\n' not in e.value.line()


def test_the_trainer_refuses_a_bad_shard_with_one_line(trainer, tmp_path):
  odd = tmp_path / 'odd.bin'
  odd.write_bytes(b'\x01\x00\x02')
  r = trainer.train(tmp_path / 'run', f'--config.data.sources.main={odd}')
  assert r.returncode == 2, r.stderr
  (line,) = [s for s in r.stderr.splitlines() if s.startswith('jaxckpt: ')]
  assert line.startswith('jaxckpt: E-DATA-005: ') and str(odd) in line
  assert 'Traceback' not in r.stderr


def test_an_out_of_vocabulary_token_in_a_large_shard_is_refused_when_read(tmp_path):
  big = tmp_path / 'big.bin'
  with open(big, 'wb') as f:
    f.truncate(2 * (data.SCAN_TOKENS + 1000))  # sparse: past the size scanned whole at the start
  ds = data.from_config(_config((str(big),)))
  ds.batch(0), ds.heldout_batches(1)  # zeros: in range
  with open(big, 'r+b') as f:  # the held-out split's first window; the map sees the file as is
    f.seek(2 * len(ds.sources[0].train))
    f.write(np.full(100, 999, '<u2').tobytes())
  with pytest.raises(ConfigError, match='E-DATA-002.*token id 999'):
    ds.heldout_batches(1)


_MEASURE = textwrap.dedent("""
    import sys
    from conftest import tiny_config
    from jaxckpt.model import data

    def rss():
      for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
          return int(line.split()[1]) * 1024

    config = tiny_config()
    warm = data.from_config(config)  # imports and first allocations, before the baseline
    warm.batch(0), warm.heldout_batches(8)
    before = rss()
    with config.unlocked():
      config.data.sources.main = tuple(sys.argv[1:])
    ds = data.from_config(config)
    for step in range(200):
      ds.batch(step)
    ds.heldout_batches(8)
    print(len(ds.sources[0].train) + len(ds.sources[0].heldout), rss() - before)
""")


def test_a_multi_gigabyte_bin_feeds_batches_without_growing_resident_memory(tmp_path):
  shards = [tmp_path / 'a.bin', tmp_path / 'b.bin']
  for shard in shards:  # sparse: 4 GiB of zero tokens that cost no disk
    with open(shard, 'wb') as f:
      f.truncate(2 * GiB)
  r = subprocess.run([sys.executable, '-c', _MEASURE, *map(str, shards)],
                     capture_output=True,
                     text=True,
                     timeout=120,
                     cwd=REPO,
                     env=subprocess_env(tmp_path, PYTHONPATH=f'{REPO}:{REPO / "tests"}'))
  assert r.returncode == 0, r.stderr
  tokens, grown = map(int, r.stdout.split())
  assert tokens == 2 * GiB  # every token of both shards, 4 GiB of them
  # 200 batches of 4 x 65 tokens touch at most a few pages each: far below one shard.
  assert grown < 64 << 20, f'resident memory grew by {grown / 2**20:.0f} MiB'


def test_a_run_trains_on_a_multi_gigabyte_bin(trainer, tmp_path):
  big = tmp_path / 'big.bin'
  with open(big, 'wb') as f:
    f.truncate(4 * GiB)
  hwm = tmp_path / 'hwm'
  wrapper = ('import atexit, runpy, sys\n'
             f'atexit.register(lambda: open({str(hwm)!r}, "w").write('
             '[s for s in open("/proc/self/status") if s.startswith("VmHWM")][0]))\n'
             'sys.argv = ["jaxckpt.main", *sys.argv[1:]]\n'
             'runpy.run_module("jaxckpt.main", run_name="__main__")\n')
  command = trainer.command(tmp_path / 'run', f'--config.data.sources.main={big}',
                            '--config.train.steps=5', '--config.train.log_every=5')
  r = subprocess.run([sys.executable, '-c', wrapper, *command[3:]],
                     capture_output=True,
                     text=True,
                     timeout=300,
                     cwd=REPO,
                     env=subprocess_env(trainer.cache))
  assert r.returncode == 0, r.stderr
  assert (tmp_path / 'run' / 'checkpoints' / 'step_00000005' / 'manifest.json').is_file()
  peak = int(hwm.read_text().split()[1]) * 1024
  assert peak < 2 * GiB, f'the trainer peaked at {peak / GiB:.1f} GiB for a 4 GiB file'
