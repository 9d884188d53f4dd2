"""Where each config value came from, as the manifest's `knobs` record it, whatever the flags'
spelling: absl and ml_collections say which flags were given, `--flagfile` included."""

import json

from conftest import committed_steps


def test_values_from_a_flagfile_are_recorded_as_flags(trainer, tmp_path):
  flagfile = tmp_path / 'flags'
  flagfile.write_text('--config.train.lr=0.0005\n--checkpoint_every=5\n')
  workdir = tmp_path / 'run'
  r = trainer.train(workdir, '--config.train.steps=5', f'--flagfile={flagfile}')
  assert r.returncode == 0, r.stderr
  assert committed_steps(workdir) == [5]
  knobs = json.loads(
      (workdir / 'checkpoints' / 'step_00000005' / 'manifest.json').read_text())['knobs']
  assert knobs['train.lr'] == {'value': 0.0005, 'source': 'flag'}
  assert knobs['checkpoint.every'] == {'value': 5, 'source': 'flag'}
  assert knobs['train.steps'] == {'value': 5, 'source': 'flag'}
  assert knobs['train.b1']['source'] == 'default' and knobs['checkpoint.keep']['source'] != 'flag'
