"""`python -m jaxckpt.main --help`: the trainer's own flags, by concern, each with its default.

absl's `--help` lists every module's flags without most defaults (a flag whose default comes from
the config file shows none); this lists the flags `jaxckpt.cli.trainer_flags` defines, the
`--config=FILE` and `--config.<field>=VALUE` forms, and the default of each: a value, or the
config field it overrides with that field's value in configs/default.py (or in `--config=FILE`
when given with `--help`, whose fields are then listed too). A `--config=FILE` that does not load
gets the help without its fields, then its one-line error (E-CONFIG-007) and exit 2: the help
was given, but the file named is wrong.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_collections
from absl import flags

from jaxckpt.cli.parser import exit_with
from jaxckpt.errors import CheckpointError
from jaxckpt.records import provenance

# `--help`, by concern, in this order.
_GROUPS = {
    'The run': ('workdir', 'resume'),  # --config: its own paragraph
    'Checkpoints': ('checkpoint_every', 'checkpoint_secs', 'checkpoint_epochs', 'checkpoint_mtbi',
                    'checkpoint_min_secs', 'checkpoint_max_secs', 'checkpoint_mode',
                    'checkpoint_staging', 'keep', 'keep_every', 'keep_best', 'guard_finite'),
    'Remote copy': ('remote', 'remote_every', 'remote_mtbi', 'remote_lease', 'remote_lease_secs',
                    'remote_rate', 'stop_grace_secs'),
    'Exports during training':
        ('export_every', 'export_formats', 'export_keep', 'export_optimizer'),
    'Many hosts': ('coordinator_address', 'num_processes', 'process_id', 'heartbeat_timeout_secs',
                   'barrier_timeout_secs', 'init_timeout_secs', 'step_timeout_secs', 'replicas'),
}
# Flags whose default is neither a value nor a config field.
_DEFAULTS = {
    'workdir': 'none, required',
    'resume': '$JAXCKPT_RESUME, else latest',
    'coordinator_address': "the cluster's (TPU VMs, SLURM), else one process",
    'num_processes': "the cluster's, else 1",
    'process_id': "the cluster's, else 0",
    'step_timeout_secs': 'max(600, 50 x the median step time)',
}
_FORMS = {
    'workdir': 'DIR', 'resume': 'latest|none|PATH', 'checkpoint_every': 'N|auto',
    'checkpoint_mtbi': 'DURATION', 'remote': 'URL', 'remote_every': 'K|auto',
    'remote_rate': 'PER_S|auto|off', 'remote_mtbi': 'DURATION', 'export_formats': 'LIST',
    'coordinator_address': 'HOST:PORT'
}


def render(path: str | None, *, load: Callable[[str, str], Any], fields: Mapping[str, str],
           aliases: Mapping[str, str]) -> str:
  """`python -m jaxckpt.main --help`: the trainer's own flags with their defaults.

  Args:
    path: the `--config=FILE` given with `--help` (None: none): its fields are listed too, and
      the defaults of the flags that override them are its values.
    load: (flag name, path) -> a ConfigDict, or the error (`trainer_flags.load_config`).
    fields: {flag: the config field it sets}; aliases: {former name: flag}.

  A `path` that does not load: the help is printed here, without the file's fields, then the
  file's error as one line on stderr, and the process exits 2.
  """
  config, config_file, problem = None, None, None
  if path is not None:
    loaded = load('config', path)
    config = loaded if isinstance(loaded, ml_collections.ConfigDict) else None
    problem = loaded if isinstance(loaded, CheckpointError) else None
    config_file = path
  if config is None:  # the defaults every config file starts from, when they are at hand
    default = Path(provenance.__file__).resolve().parents[2] / 'configs' / 'default.py'
    if default.is_file():
      provenance.make_config_importable(str(default))
      loaded = load('config', str(default))
      if isinstance(loaded, ml_collections.ConfigDict):
        config, config_file = loaded, 'configs/default.py'
  doc = (sys.modules['__main__'].__doc__ or '').strip('\n')
  out = [doc, '', _CONFIG_HELP]
  for title, names in _GROUPS.items():
    out.append(f'{title}:')
    for name in names:
      if name in flags.FLAGS:
        out.append(_flag_help(flags.FLAGS[name], config, config_file, fields, aliases))
    out.append('')
  if path is not None and config is not None and config_file == path:
    out.append(f'Fields of {path} (set any with --config.<field>=VALUE):')
    out.extend(f'  {k} = {v!r}' for k, v in provenance.flatten_config(config).items())
    out.append('')
  out.append("--helpfull lists every flag, absl's and JAX's too.")
  text = '\n'.join(out) + '\n'
  if problem is not None:  # last, where it is seen after a page of help
    print(text, end='', flush=True)
    exit_with(problem)
  return text


_CONFIG_HELP = """\
The config:
  --config=FILE[:ARG]
      A Python file whose get_config() returns an ml_collections ConfigDict (configs/tiny.py,
      configs/andrea_12m.py, ...; required). Every field of it is a flag too:
  --config.<field>=VALUE
      Sets one field, checked against the file's: for example
        python -m jaxckpt.main --config=configs/tiny.py --workdir=runs/tiny \\
            --config.train.steps=500 --config.train.lr=3e-4 --config.model.n_layer=4
      configs/default.py documents every field; --help --config=FILE lists that file's fields.
      A flag below that names a config field overrides it the same way.
"""


def _flag_help(flag, config, config_file, fields, aliases) -> str:
  """One flag of `--help`: its form, what it does, its default."""
  kind = flag.flag_type()
  if flag.boolean:
    form = f'--[no]{flag.name}'
  elif 'enum' in kind:
    form = f'--{flag.name}={"|".join(flag.parser.enum_values)}'
  elif flag.name in _FORMS or flag.name.endswith('_secs'):
    form = f'--{flag.name}={_FORMS.get(flag.name, "SECS")}'
  else:
    form = f'--{flag.name}=' + {'int': 'N', 'float': 'X'}.get(kind, 'VALUE')
  former = [old for old, new in aliases.items() if new == flag.name]
  if former:
    form += f'  (also {", ".join("--" + a for a in former)}, its former name)'
  text = re.sub(r'^<[^>]*>: ', '', flag.help)  # absl's own enum prefix: the form says it
  text = re.sub(r' \(default: .*\)\.?$', '', text).rstrip('.')
  return f'  {form}\n' + textwrap.fill(
      f'{text}. Default: {_default_of(flag, config, config_file, fields)}.',
      width=96,
      initial_indent='      ',
      subsequent_indent='      ')


def _default_of(flag, config, config_file, fields) -> str:
  if flag.name in _DEFAULTS:
    return _DEFAULTS[flag.name]
  if flag.name in fields:
    field = fields[flag.name]
    if config is None:
      return f"the config's {field}"
    return f'config.{field} ({provenance.flatten_config(config).get(field)!r} in {config_file})'
  return f'{flag.default:g}' if isinstance(flag.default, float) else repr(flag.default)
