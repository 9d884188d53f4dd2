"""Edges of the data sources and the run's records: a `.BIN` token file, the memory a text source
costs, a config file spelled another way on resume, and `jaxckpt plot --out=DIR/` for a missing
DIR."""

import json
import os
import shutil
import tracemalloc

import ml_collections
import numpy as np
from conftest import REPO, call_cli, tiny_config

from jaxckpt.model import data
from jaxckpt.records import identity, provenance
from jaxckpt.records.workdir import LOSSES


def _config(*paths):
  config = tiny_config()
  with config.unlocked():
    config.data.sources = ml_collections.ConfigDict({'main': tuple(map(str, paths))})
  return config


def _batches(ds) -> list[np.ndarray]:
  return [ds.batch(step)[0] for step in range(0, 40, 3)] + [x for x, _ in ds.heldout_batches(3)]


# ------------------------------------------------------------------------------------- data
def test_an_upper_case_bin_suffix_is_a_token_file(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 256, size=5000, dtype=np.uint16)
  for name in ('x.bin', 'y.BIN'):
    tokens.astype('<u2').tofile(tmp_path / name)
  lower, upper = (data.load_tokens([str(tmp_path / name)]) for name in ('x.bin', 'y.BIN'))
  np.testing.assert_array_equal(upper, tokens)
  np.testing.assert_array_equal(upper, lower)


def test_a_text_source_costs_no_copy_and_gives_the_same_batches(tmp_path):
  text = tmp_path / 'corpus.txt'
  text.write_bytes(np.random.default_rng(1).integers(0, 256, size=8 << 20, dtype=np.uint8))
  # What a text source was before it was mapped: its bytes read, then widened to uint16.
  before = np.frombuffer(text.read_bytes(), np.uint8).astype(np.uint16)
  as_bin = tmp_path / 'corpus.bin'
  before.astype('<u2').tofile(as_bin)

  tracemalloc.start()
  try:
    ds = data.from_config(_config(text))
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  # Reading it whole and widening it held 3x its size (a 10 GB corpus: 30 GB, then the OOM killer).
  assert peak < text.stat().st_size // 4, f'{peak} bytes allocated for {text.stat().st_size}'

  got = data.load_tokens([str(text)])
  assert got.dtype == np.uint16
  np.testing.assert_array_equal(got, before)
  expected = _batches(data.from_config(_config(as_bin)))
  assert all(np.array_equal(a, b) for a, b in zip(_batches(ds), expected, strict=True))


# ------------------------------------------------------------------------------- provenance
def test_a_config_file_spelled_another_way_on_resume_is_no_change(tmp_path, monkeypatch):
  shutil.copytree(REPO / 'configs', tmp_path / 'configs')
  monkeypatch.chdir(tmp_path)
  config = provenance.load_config_file('configs/tiny.py')
  typed = provenance.provenance(config, 'configs/tiny.py')
  absolute = provenance.provenance(config, str(tmp_path / 'configs' / 'tiny.py'))
  dotted = provenance.provenance(config, './configs/../configs/tiny.py')
  for later in (absolute, dotted):
    assert identity.compare(typed, later).lines == []
    assert identity.compare(later, typed).lines == []

  # A real change to the file is still a line, named as the resuming run spells it.
  tiny = tmp_path / 'configs' / 'tiny.py'
  tiny.write_text(tiny.read_text() + '# changed\n')
  changed = provenance.provenance(config, str(tiny))
  old, new = typed['sources']['configs/tiny.py'], changed['sources'][str(tiny)]
  assert identity.compare(typed, changed).lines == [f'source {tiny} {old[:12]} -> {new[:12]}']


# ------------------------------------------------------------------------------------- plot
def test_plot_refuses_an_out_ending_in_a_separator_whose_directory_is_missing(tmp_path, capsys):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / LOSSES).write_text(''.join(
      json.dumps({'step': s, 'segment': 0, 'loss': 5.0 - s / 10}) + '\n' for s in range(1, 4)))
  scratch = sorted(os.listdir(tmp_path))
  out = f'{tmp_path / "newplots"}{os.sep}'
  code, stdout, err = call_cli(['plot', f'--workdir={workdir}', f'--out={out}'], capsys)
  assert code == 2, err
  assert err.startswith('jaxckpt: E-PLOT-002: ') and err.count('\n') == 1, err
  assert 'Traceback' not in err and str(tmp_path / 'newplots') in err and not stdout
  assert not (tmp_path / 'newplots.png').exists()
  assert sorted(os.listdir(tmp_path)) == scratch and os.listdir(workdir) == [LOSSES]


def test_data_that_changed_between_stop_and_resume_is_said(trainer, tmp_path):
  corpus = tmp_path / 'corpus.txt'
  corpus.write_bytes((REPO / 'README.md').read_bytes() * 4)
  flags = (f'--config.data.sources.main={corpus}', '--checkpoint_every=2')
  first = trainer.train(tmp_path / 'w', '--config.train.steps=2', *flags)
  assert first.returncode == 0, first.stderr
  same = trainer.train(tmp_path / 'w', '--config.train.steps=3', *flags)
  assert same.returncode == 0 and 'source data:main' not in same.stderr, same.stderr
  with open(corpus, 'ab') as f:
    f.write(b'a corpus grown between two starts\n')
  grown = trainer.train(tmp_path / 'w', '--config.train.steps=4', *flags)
  assert grown.returncode == 0, grown.stderr
  assert 'changed since the checkpoint: source data:main ' in grown.stderr, grown.stderr
  resumed = [
      json.loads(line)
      for line in (tmp_path / 'w' / 'events.jsonl').read_text().splitlines()
      if '"resumed"' in line
  ]
  assert [any(c.startswith('source data:main') for c in e.get('changes', [])) for e in resumed
         ] == [False, True]


def test_data_fingerprints_name_each_source_and_skip_the_embedded_corpus(tmp_path):
  a, b = tmp_path / 'a.bin', tmp_path / 'b.bin'
  np.arange(1000, dtype=np.uint16).tofile(a)
  np.arange(2000, dtype=np.uint16).tofile(b)
  config = _config(a, b)
  with config.unlocked():
    config.data.sources.web = ('embedded',)
  got = provenance.data_fingerprints(config)
  assert list(got) == ['data:main'] and len(got['data:main']) == 64
  config.data.sources.main = (str(b), str(a))  # the order is the data too
  assert provenance.data_fingerprints(config)['data:main'] != got['data:main']


def test_lines_that_are_no_records_of_ours_are_passed_over(tmp_path, capsys):
  """A foreign line in the records (a list, an object without an event) breaks neither the next
  start's segment count nor `jaxckpt plot`."""
  from jaxckpt.records.runlog import RunLog
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / LOSSES).write_text('[1]\n{"x": 1}\n' + ''.join(
      json.dumps({'step': s, 'segment': 0, 'loss': 5.0 - s / 10}) + '\n' for s in range(1, 4)))
  (workdir / 'events.jsonl').write_text('[1]\n{"x": 1}\n"started"\n{"event": "started"}\n'
                                        '{"event": "resumed"}\n{"event": "pivot", "step": 2}\n')
  assert RunLog(workdir).segment == 1
  code, stdout, err = call_cli(['plot', f'--workdir={workdir}'], capsys)
  assert code == 0 and stdout == f'{workdir / "loss.png"}\n', err
