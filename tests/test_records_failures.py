"""A run that fails once it has started leaves its records saying so: `status.json` failed and a
`failed` end record, whatever the exit code; a record that cannot be written is one line."""

import subprocess
import sys
import textwrap

import numpy as np
from conftest import REPO, events_of, subprocess_env
from test_cli_errors import assert_refused

from jaxckpt.records.runlog import read_status

# The trainer, with the load-time scan of token ids cut to 10 tokens: a larger source is then
# checked batch by batch, as a source over 2**28 tokens is.
_LAUNCH = textwrap.dedent("""
    import runpy, sys
    from jaxckpt.model import data
    data.SCAN_TOKENS = 10
    sys.argv = ['jaxckpt.main', *sys.argv[1:]]
    runpy.run_module('jaxckpt.main', run_name='__main__', alter_sys=True)
""")


def test_a_data_error_mid_run_marks_the_run_failed(trainer, tmp_path):
  source = tmp_path / 'tokens.bin'
  np.full(20_000, 999, np.uint16).tofile(source)  # every token beyond the tiny vocabulary
  flags = trainer.command(tmp_path / 'w', '--config.train.steps=3',
                          f'--config.data.sources.main=("{source}",)')[3:]
  r = subprocess.run([sys.executable, '-c', _LAUNCH, *flags],
                     capture_output=True,
                     text=True,
                     timeout=300,
                     cwd=REPO,
                     env=subprocess_env(trainer.cache))
  line = assert_refused(r, 'E-DATA-002')
  assert 'fix the data' in line and 'raise model.vocab_size' not in line, line  # E-PARAM-002
  assert read_status(tmp_path / 'w')['state'] == 'failed'  # not `running` for a dead pid
  ends = events_of(tmp_path / 'w', 'failed')
  assert len(ends) == 1 and 'E-DATA-002' in ends[0]['error']


def test_a_record_the_disk_does_not_take_is_one_line(trainer, tmp_path):
  workdir = tmp_path / 'w'
  workdir.mkdir()
  (workdir / 'loss.jsonl').symlink_to('/dev/full')  # every write: ENOSPC
  r = trainer.train(workdir, '--config.train.steps=3', '--config.train.log_every=1')
  assert r.returncode == 1, r.stderr
  assert 'Traceback' not in r.stderr
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxckpt: E-RECORD-001: cannot write the run record ') and \
      'loss.jsonl: No space left on device' in last, last
  assert read_status(workdir)['state'] == 'failed'
