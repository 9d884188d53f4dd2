"""A run's config, checked once at the start with errors that name the field.

Configs are `configs/*.py` files whose `get_config()` returns an `ml_collections.ConfigDict`
(every field is documented in `configs/default.py`); `validate_config` is the one place that
decides whether a config can run, before anything is compiled or written.
"""

from __future__ import annotations

import math
import numbers

from jaxckpt.checkpoint import ArgumentError, CheckpointOptions, cadence
from jaxckpt.checkpoint.remote import StoreError, pacing, parse_url
from jaxckpt.errors import ConfigError
from jaxckpt.export import during_training
from jaxckpt.hosts import upload_cadence
from jaxckpt.model import bandit as bandit_lib
from jaxckpt.train import init_from as init_from_lib


def validate_config(config) -> None:
  """Check the config once, at the start, with errors that name the field."""
  m, t = config.model, config.train
  positive = {
      'model.n_layer': m.n_layer, 'model.n_head': m.n_head, 'model.n_embd': m.n_embd,
      'model.block_size': m.block_size, 'model.vocab_size': m.vocab_size, 'train.steps': t.steps,
      'train.batch_size': t.batch_size, 'train.lr': t.lr, 'train.log_every': t.log_every
  }
  for field, value in positive.items():
    if not value > 0:
      raise ConfigError('E-CONFIG-001', f'{field}={value} must be positive',
                        f'set --config.{field}')
  warmup = t.get('warmup_steps', 0)
  if isinstance(warmup, bool) or not isinstance(warmup, numbers.Integral) or warmup < 0:
    raise ConfigError('E-CONFIG-001', f'train.warmup_steps={warmup!r} must be a whole number >= 0',
                      'set --config.train.warmup_steps to the steps of linear warmup (0: none)')
  if m.n_embd % m.n_head:
    raise ConfigError('E-CONFIG-001', f'model.n_embd={m.n_embd} is not a multiple of '
                      f'model.n_head={m.n_head}', 'change one of them')
  if not 0 < config.data.heldout_fraction < 1:
    raise ConfigError(
        'E-CONFIG-001', f'data.heldout_fraction={config.data.heldout_fraction} '
        'must be between 0 and 1', 'set --config.data.heldout_fraction')
  if m.dtype not in ('float32', 'bfloat16'):
    raise ConfigError('E-CONFIG-001', f'model.dtype={m.dtype!r} is not float32 or bfloat16',
                      'set --config.model.dtype')
  in_flight = t.get('max_steps_in_flight', 2)
  if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
    raise ConfigError('E-CONFIG-001',
                      f'train.max_steps_in_flight={in_flight!r} must be a whole number >= 0',
                      'set --config.train.max_steps_in_flight (2: the default; 0: no bound)')
  if config.samples.keep < 0:
    raise ConfigError('E-CONFIG-001', f'samples.keep={config.samples.keep} is negative',
                      'set --config.samples.keep to the rounds to keep (0: none)')
  if len(config.samples.prompt.encode()) >= m.block_size:
    raise ConfigError('E-CONFIG-001', 'samples.prompt is as long as model.block_size',
                      'shorten --config.samples.prompt')
  _validate_sources(config.data.sources)
  bandit_lib.validate(config.bandit, list(config.data.sources))
  init_from_lib.validate(config)
  checkpoint_options(config)  # validates mode and counts
  cadence_options(config)  # validates the automatic cadence's prior and bounds
  _validate_remote(config.checkpoint)
  during_training.options_from_config(config)  # validates export cadence, formats, retention


def _validate_sources(sources) -> None:
  """Each data source names its files (a tuple of paths, one path, a comma-separated string or
  a glob: `jaxckpt.model.data.source_paths`): `--config.data.sources.main=5` parses as `(5,)`."""
  for name, paths in sources.items():
    if isinstance(paths, str):
      continue
    if not isinstance(paths, (tuple, list)) or not all(isinstance(p, str) for p in paths):
      raise ConfigError(
          'E-CONFIG-001', f'data.sources.{name}={paths!r} is not a tuple of file paths',
          f"set --config.data.sources.{name}=\"('file.txt',)\" or =a.bin,b.bin (text files, "
          "uint16 .bin files, globs or 'embedded')")


def _validate_remote(c) -> None:
  """The remote tier's URL form and times (the store itself is checked before step 1)."""
  try:
    parse_url(c.get('remote', '') or '.')
  except StoreError as e:  # before the workdir is touched; its `what` starts with the URL
    raise ConfigError(e.code, f'--remote={e.what}', e.fix) from None
  if not c.get('remote_lease_secs', 60.0) > 0:
    raise ConfigError('E-CONFIG-004', f'checkpoint remote_lease_secs={c.remote_lease_secs} is not '
                      'positive', 'set --remote_lease_secs to seconds, e.g. 60')
  upload_cadence.parse_remote_every(c.get('remote_every', cadence.AUTO))
  upload_cadence.parse_remote_mtbi(c.get('remote_mtbi', upload_cadence.DEFAULT_REMOTE_MTBI))
  try:
    pacing.parse_rate(c.get('remote_rate', 'auto'))
  except ValueError as e:
    raise ConfigError(
        'E-CONFIG-004', f'checkpoint remote_rate={e}', 'set --remote_rate=auto (the '
        "store's documented limits), off, or the job's requests a second") from None
  if c.get('remote_lease', 'on') not in ('on', 'off'):
    raise ConfigError('E-CONFIG-004', f'checkpoint remote_lease={c.remote_lease!r} is not on or '
                      'off', 'set --remote_lease=on (one writer per prefix) or off')
  if not c.get('stop_grace_secs', 25.0) >= 0:
    raise ConfigError('E-CONFIG-004', f'checkpoint stop_grace_secs={c.stop_grace_secs} is '
                      'negative', 'set --stop_grace_secs to seconds (0: do not wait)')


# The checkpoint options the trainer hands the library: config field -> (its flag, what it may
# be). The library's own names: every -> every_steps, secs -> every_secs, the others the same.
_CHECKPOINT_FLAGS = {
    'every': ('--checkpoint_every', 'a whole number of steps (0: off) or auto'),
    'secs': ('--checkpoint_secs', 'a number of seconds, 0 or more (0: off)'),
    'mode': ('--checkpoint_mode', 'auto, async or sync'),
    'staging': ('--checkpoint_staging', 'auto, host or device'),
    'storage': ('--config.checkpoint.storage', 'auto, safetensors or orbax'),
    'keep': ('--keep', 'the newest checkpoints to keep, 0 or more (0: all)'),
    'keep_every': ('--keep_every', 'a step multiple, 0 or more (0: off)'),
    'keep_best': ('--keep_best', 'a number of checkpoints, 0 or more (0: off)'),
    'replicas': ('--replicas', "a number of other hosts' parts to keep, 0 or more (0: off)"),
}


def _bad_checkpoint_option(field: str, value, problem: str) -> ConfigError:
  """E-CONFIG-004 naming the flag of `config.checkpoint.<field>` and what it may be."""
  flag, valid = _CHECKPOINT_FLAGS[field]
  shown = f'{value:g}' if isinstance(value, float) else repr(value)
  alias = '' if flag.startswith('--config.') else f' (or --config.checkpoint.{field})'
  return ConfigError('E-CONFIG-004', f'{flag}={shown} is {problem}',
                     f'set {flag}{alias} to {valid}')


def checkpoint_options(config):
  """The checkpoint library's options for `config.checkpoint`; a bad value is a ConfigError
  naming its flag."""
  c = config.checkpoint
  try:
    every = cadence.parse_every(c.every)
  except ArgumentError:
    raise _bad_checkpoint_option('every', c.every, 'not a step count or auto') from None
  secs = c.secs
  if isinstance(secs, bool) or not isinstance(secs, numbers.Real) or not math.isfinite(secs):
    raise _bad_checkpoint_option('secs', secs, 'not a number of seconds')
  if secs < 0:
    raise _bad_checkpoint_option('secs', secs, 'negative')
  counts = {
      'keep': c.keep, 'keep_every': c.keep_every, 'keep_best': c.get('keep_best', 0),
      'replicas': c.get('replicas', 0)
  }
  for field, value in counts.items():
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise _bad_checkpoint_option(field, value, 'not a whole number')
    if value < 0:
      raise _bad_checkpoint_option(field, value, 'negative')
  named = {'mode': c.mode, 'staging': c.get('staging', 'auto'), 'storage': c.storage}
  for field, value in named.items():
    try:
      CheckpointOptions(**{field: value})
    except ArgumentError:
      raise _bad_checkpoint_option(field, value, f'not {_CHECKPOINT_FLAGS[field][1]}') from None
  return CheckpointOptions(
      every_steps=0 if every == cadence.AUTO else every,  # auto: the trainer's SaveCadence
      every_secs=float(secs),
      keep=int(counts['keep']),
      keep_every=int(counts['keep_every']),
      keep_best=int(counts['keep_best']),
      replicas=int(counts['replicas']),
      **named)


def cadence_options(config) -> cadence.CadenceOptions:
  """What `--checkpoint_every=auto` is told (`config.checkpoint.mtbi`, `min_secs`, `max_secs`)
  and the per-epoch rule checked; a bad value is a ConfigError."""
  c = config.checkpoint
  try:
    if c.get('epochs', 0) < 0:
      raise ArgumentError('E-CONFIG-004', f'checkpoint epochs={c.epochs} is negative',
                          'use 0 to turn it off')
    return cadence.CadenceOptions(
        mtbi_s=cadence.parse_duration(c.get('mtbi', cadence.DEFAULT_MTBI_S)),
        min_secs=c.get('min_secs', 0.0),
        max_secs=c.get('max_secs', 0.0))
  except ArgumentError as e:
    raise ConfigError(
        e.code, f'checkpoint cadence: {e.what}', f'{e.fix} (--checkpoint_mtbi, '
        '--checkpoint_min_secs, --checkpoint_max_secs, --checkpoint_epochs)') from None
