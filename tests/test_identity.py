"""Identity of a checkpoint and the resume check: every refusal from a real changed config."""

import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path

import jax
import ml_collections
import optax
import pytest
from conftest import REPO, TINY, read_events, tiny_config

from jaxckpt.errors import ResumeError
from jaxckpt.model import gpt as model_lib
from jaxckpt.records import identity, provenance
from jaxckpt.train import state as trainer_lib

ANDREA_12M = str(REPO / 'configs' / 'andrea_12m.py')
CHECKPOINT_FLAGS = {
    'checkpoint_every': 'checkpoint.every', 'checkpoint_secs': 'checkpoint.secs',
    'checkpoint_mode': 'checkpoint.mode', 'keep': 'checkpoint.keep',
    'keep_every': 'checkpoint.keep_every'
}


def ident(config, *, devices=None, tx=None, frozen=(), **kw):
  """The identity the trainer would record for `config` (abstract state: nothing is computed)."""
  trainer = trainer_lib.build_trainer(config, devices)
  state = trainer.abstract_state()
  opt_state = state.opt_state if tx is None else jax.eval_shape(tx.init, state.params)
  return identity.build(
      config=config,
      params=state.params,
      opt_state=opt_state,
      partition_specs=trainer.state_shardings.params,
      mesh_shape=dict(trainer.mesh.shape),
      devices=trainer.mesh.size,
      trainable=identity.trainable_fn(frozen),
      sources={},
      **kw)


@pytest.fixture(scope='module')
def saved():
  return ident(tiny_config())


def refused(code, saved, new):
  with pytest.raises(ResumeError) as e:
    identity.compare(saved, new, where='step_00000010')
  err = e.value
  assert err.code == code and err.exit_code == 2
  line = f'jaxckpt: {err.line()}'
  assert '\n' not in line and err.fix, line
  return line


# ---------------------------------------------------------------------------------- knobs
def test_knob_sources_default_config_file_and_flag():
  config = provenance.load_config_file(ANDREA_12M)
  config.train.lr, config.checkpoint.every, config.model.dtype = 5e-4, 10, 'bfloat16'
  config.model.tie_embeddings = False
  knobs = provenance.knob_table(
      config,
      default_config=provenance.load_default_config(ANDREA_12M),
      file_config=provenance.load_config_file(ANDREA_12M),
      flagged={'train.lr', 'checkpoint.every', 'model.dtype', 'model.tie_embeddings'})
  assert knobs['train.lr'] == {'value': 0.0005, 'source': 'flag'}
  assert knobs['checkpoint.every'] == {'value': 10, 'source': 'flag'}
  assert knobs['model.dtype']['source'] == 'flag'
  assert knobs['model.tie_embeddings']['source'] == 'flag'
  assert knobs['model.n_layer']['source'] == 'config file'  # andrea_12m sets it
  assert knobs['seed'] == {'value': 0, 'source': 'default'}
  assert knobs['data.heldout_fraction'] == {'value': 0.05, 'source': 'default'}
  assert json.loads(json.dumps(knobs)) == knobs
  assert set(knobs) == set(provenance.flatten_config(config))


def test_knob_values_are_json_safe():
  config = ml_collections.ConfigDict({'a': {'paths': ('x', ('y', 2))}, 'b': None, 'c': 1.5})
  assert provenance.knob_table(config) == {
      'a.paths': {'value': ['x', ['y', 2]], 'source': 'config file'},
      'b': {'value': None, 'source': 'config file'}, 'c': {'value': 1.5, 'source': 'config file'}
  }


# -------------------------------------------------------------------------------- sources
def test_source_hashes_cover_the_package_and_the_config_file():
  hashes = provenance.source_hashes(TINY)
  assert hashes[TINY] == hashlib.sha256(Path(TINY).read_bytes()).hexdigest()
  for module in ('jaxckpt/model/gpt.py', 'jaxckpt/train/loop.py', 'jaxckpt/checkpoint/manager.py',
                 'jaxckpt/records/identity.py'):
    assert hashes[module] == hashlib.sha256((REPO / module).read_bytes()).hexdigest()
  assert not [k for k in hashes if '__pycache__' in k]


def test_provenance_is_what_main_records():
  config = provenance.load_config_file(ANDREA_12M)
  config.checkpoint.keep = 5
  p = provenance.provenance(config, ANDREA_12M, flagged={'checkpoint.keep'})
  assert p['knobs']['checkpoint.keep'] == {'value': 5, 'source': 'flag'}
  assert p['knobs']['model.n_embd']['source'] == 'config file'
  assert p['knobs']['train.b1']['source'] == 'default'
  defaults = str(REPO / 'configs' / 'default.py')
  assert {ANDREA_12M, defaults} <= set(p['sources'])


# --------------------------------------------------------------- parameters, optimizer
def test_parameter_table_is_canonical_with_specs_and_trainable():
  config = tiny_config(**{'mesh.model': 2})
  rows = ident(config, frozen=('wte.*', 'wpe.embedding'))['parameters']
  assert [r['path'] for r in rows] == model_lib.parameter_names(config.model)
  by = {r['path']: r for r in rows}
  assert by['h.0.attn.c_attn.kernel'] == {
      'path': 'h.0.attn.c_attn.kernel', 'shape': [64, 192], 'dtype': 'float32', 'trainable': True,
      'spec': "(None, 'model')"
  }
  assert not by['wte.embedding']['trainable'] and not by['wpe.embedding']['trainable']
  assert sum(identity.element_offsets(rows)[-1][1:]) == model_lib.count_params(config.model)


def test_optimizer_table_names_the_states_of_each_parameter(saved):
  table = saved['optimizer']
  assert table['h.0.attn.c_attn.kernel'] == ['1/0/mu', '1/0/nu']
  assert table[identity.GLOBAL_STATES] == ['1/0/count', '1/2/count']
  assert set(table) - {identity.GLOBAL_STATES} == set(
      model_lib.parameter_names(tiny_config().model))


def test_a_config_without_a_gpt_model_gets_tree_order():
  params = {'b': jax.ShapeDtypeStruct((2,), 'float32'), 'a': jax.ShapeDtypeStruct((3,), 'float32')}
  for config in (ml_collections.ConfigDict({'seed': 1}), {'seed': 1},
                 ml_collections.ConfigDict({'model': {'width': 8}})):
    rows = identity.build(
        config=config,
        params=params,
        opt_state=(),
        mesh_shape={},
        devices=1,
        knobs={},
        sources={},
        versions={})['parameters']
    assert [r['path'] for r in rows] == ['a', 'b']


def test_a_bug_inside_parameter_names_is_raised_not_taken_for_another_model(monkeypatch):
  monkeypatch.setattr(model_lib, 'parameter_names', lambda model_cfg: model_cfg.n_layers)  # typo
  with pytest.raises(AttributeError, match='n_layers'):
    ident(tiny_config())


def test_build_records_where_and_what(saved):
  for key in ('config', 'knobs', 'sources', 'parameters', 'optimizer', 'counters', 'seed', 'mesh',
              'devices', 'processes', 'versions', 'finished'):
    assert key in saved
  assert saved['devices'] == 8 and saved['mesh'] == {'data': 8, 'model': 1}
  # What the README promises, read here from the packages themselves, not from provenance.versions().
  import flax
  import jaxlib
  import numpy
  import orbax.checkpoint

  import jaxckpt
  assert saved['versions'] == {
      'jaxckpt': jaxckpt.__version__,
      'python': platform.python_version(),
      'jax': jax.__version__,
      'jaxlib': jaxlib.__version__,
      'flax': flax.__version__,
      'optax': optax.__version__,
      'orbax-checkpoint': orbax.checkpoint.__version__,
      'tensorstore': importlib.metadata.version('tensorstore'),  # it has no __version__
      'numpy': numpy.__version__
  }
  assert json.loads(json.dumps(saved)) == saved


# ------------------------------------------------------------------------------ refusals
def test_same_config_resumes_with_no_diff(saved):
  assert not identity.compare(saved, ident(tiny_config()))


def test_param_001_a_parameter_new_or_gone(saved):
  line = refused('E-PARAM-001', saved, ident(tiny_config(**{'model.n_layer': 3})))
  assert 'new in the model: h.2.ln_1.scale' in line and '(+7 more)' in line
  line = refused('E-PARAM-001', saved, ident(tiny_config(**{'model.tie_embeddings': True})))
  assert 'gone from the model: lm_head.kernel' in line and 'start a new --workdir' in line


def test_param_002_shape_or_dtype_changed(saved):
  line = refused('E-PARAM-002', saved, ident(tiny_config(**{'model.block_size': 128})))
  assert 'wpe.embedding float32[64, 64] -> float32[128, 64]' in line
  retyped = json.loads(json.dumps(saved))
  retyped['parameters'][0]['dtype'] = 'bfloat16'  # params are float32 whatever model.dtype says
  assert 'wte.embedding bfloat16[256, 64] -> float32[256, 64]' in refused(
      'E-PARAM-002', retyped, saved)


def test_param_003_trainable_vs_frozen_changed(saved):
  line = refused('E-PARAM-003', saved, ident(tiny_config(), frozen=('wte.embedding',)))
  assert 'trainable in the checkpoint, frozen now: wte.embedding' in line
  line = refused('E-PARAM-003', ident(tiny_config(), frozen=('h.*',)), saved)
  assert 'frozen in the checkpoint, trainable now: h.0.ln_1.scale' in line


def test_opt_001_optimizer_structure_changed(saved):
  config = tiny_config()
  plain_adam = optax.adam(config.train.lr)  # no clipping in front: Adam moves in the chain
  line = refused('E-OPT-001', saved, ident(config, tx=plain_adam))
  assert 'optimizer state structure changed' in line and "['1/0/count', '1/2/count']" in line
  lion = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3))
  line = refused('E-OPT-001', saved, ident(config, tx=lion))
  assert "['1/0/mu', '1/0/nu'] -> ['1/0/mu']" in line


def test_manifest_without_identity_is_checked_by_its_tensor_table(saved):
  old = {
      'tensors': [{
          'name': 'params/' + r['path'].replace('.', '/'), 'shape': r['shape'], 'dtype': r['dtype'],
          'spec': r['spec']
      } for r in saved['parameters']], 'config': saved['config'], 'devices': 8,
      'mesh': saved['mesh']
  }
  assert not identity.compare(old, saved)
  refused('E-PARAM-001', old, ident(tiny_config(**{'model.n_layer': 3})))


# ------------------------------------------------------------------- allowed and recorded
def test_knob_and_source_changes_are_lines(saved, tmp_path):
  config_file = tmp_path / 'my_config.py'
  config_file.write_text('from configs import tiny\nget_config = tiny.get_config\n')
  before = dict(saved, sources=provenance.source_hashes(config_file))
  config_file.write_text('from configs import tiny\n\nget_config = tiny.get_config\n')
  new = dict(
      ident(tiny_config(**{'train.lr': 0.0005, 'model.dtype': 'bfloat16'})),
      sources=provenance.source_hashes(config_file))
  diff = identity.compare(before, new)
  old_h, new_h = before['sources'][str(config_file)], new['sources'][str(config_file)]
  assert diff.knobs == ('knob model.dtype "float32" -> "bfloat16"', 'knob train.lr 0.001 -> 0.0005')
  assert diff.sources == (f'source {config_file} {old_h[:12]} -> {new_h[:12]}',)
  assert diff.lines == [*diff.knobs, *diff.sources] and not diff.elastic


def test_device_and_mesh_changes_are_lines():
  eight = ident(tiny_config(**{'mesh.data': 4, 'mesh.model': 2}))
  four = ident(tiny_config(**{'mesh.data': 4, 'mesh.model': 1}), devices=jax.devices()[:4])
  diff = identity.compare(eight, four)
  assert diff.topology == ('devices 8 -> 4', "mesh {'data': 4, 'model': 2} -> "
                           "{'data': 4, 'model': 1}")
  assert diff.elastic
  assert [line for line in diff.knobs] == ['knob mesh.model 2 -> 1']


# -------------------------------------------------------------- through the real trainer
def test_trainer_refuses_and_records(trainer, tmp_path):
  flags = ('--config.train.steps=10', '--checkpoint_every=10')
  r = trainer.train(tmp_path, *flags)
  assert r.returncode == 0, r.stderr
  r = trainer.train(tmp_path, *flags, '--config.model.n_layer=3')
  assert r.returncode == 2, r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith('jaxckpt: E-PARAM-001: ')
  r = trainer.train(tmp_path, '--config.train.steps=12', '--checkpoint_every=10',
                    '--config.train.lr=0.0005')
  assert r.returncode == 0, r.stderr
  assert 'knob train.lr 0.001 -> 0.0005' in r.stderr
  assert 'knob train.lr 0.001 -> 0.0005' in json.dumps(read_events(tmp_path))
