"""The trainer's command line: a `--config` file or `--config.*` field that fails is one line.

`python -m jaxckpt.main` defines its config flag with `define_config_file` and parses with
`parse_flags_or_exit`, so a missing, broken or foreign config file, an unknown field or a bad
flag is `jaxckpt: E-...: what; fix` and exit 2, never a traceback.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import sys
import traceback

import ml_collections
from absl import flags
from ml_collections.config_flags import config_flags  # is_config_flag is not re-exported

from jaxckpt.cli.parser import exit_with
from jaxckpt.errors import ConfigError, UsageError

_CONFIG_FIX = 'pass a file like configs/tiny.py, whose get_config() returns a ConfigDict'


def define_config_file(name: str, help_string: str) -> flags.FlagHolder:
  """ml_collections' `DEFINE_config_file` (locked), even when a --flagfile cannot be read.

  The config flag reads the command line's flagfiles when it is defined (at import); a bad one
  is left for `parse_flags_or_exit` to report, in one line.
  """
  try:
    return config_flags.DEFINE_config_file(name, None, help_string, lock_config=True)
  except flags.Error:
    return config_flags.DEFINE_config_file(
        name, None, help_string, lock_config=True, sys_argv=sys.argv[:1])


def parse_flags_or_exit(argv: list[str]) -> list[str]:
  """absl flag parsing, but bad input is one line on stderr and exit 2 (not 1 and a page).

  ml_collections runs a `--config` file while the flags are parsed (its errors come through
  here), and keeps a file it could not read as a config that fails when first used: both are
  told here, naming the file or the `--config.*` field.
  """
  try:
    rest = flags.FLAGS(argv)
  except Exception as e:  # pylint: disable=broad-except
    problem = config_problem(argv)
    if problem is None and not isinstance(e, flags.Error):
      raise  # not bad input: a bug
    exit_with(problem or UsageError('E-USAGE-001', ' '.join(str(e).split()), 'see --help'))
  for name in _config_flag_names():
    value = flags.FLAGS[name].value
    if value is not None and not isinstance(value, ml_collections.ConfigDict):
      exit_with(
          config_problem(argv)
          or ConfigError('E-CONFIG-007', f'--{name} did not load', _CONFIG_FIX))
  return rest


def _config_flag_names() -> list[str]:
  return [name for name in flags.FLAGS if config_flags.is_config_flag(flags.FLAGS[name])]


def config_problem(argv: list[str]) -> ConfigError | None:
  """What is wrong with the `--config` file or a `--config.*` field on `argv`; None: nothing."""
  try:
    args = flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error:
    args = argv[1:]
  if '--' in args:
    args = args[:args.index('--')]
  for name in _config_flag_names():
    path, overrides = None, []
    for i, arg in enumerate(args):
      if re.fullmatch(rf'--?{name}(=.*)?', arg):
        path = arg.split('=', 1)[1] if '=' in arg else (args[i + 1] if i + 1 < len(args) else '')
      elif match := re.match(rf'--?(?:no)?{name}\.([^=]+)', arg):
        overrides.append(match.group(1))
    if path is None:
      continue  # absl says that a required flag is missing
    config = _load_config(name, path)
    if isinstance(config, ConfigError):
      return config
    for field in overrides:
      problem = _unknown_field(name, config, field)
      if problem is not None:
        return problem
  return None


def _load_config(name: str, path: str) -> ml_collections.ConfigDict | ConfigError:
  """Load `path` (`file.py[:arg]`) as ml_collections does; what fails, as a ConfigError."""
  file, *arg = path.split(':', 1)
  fail = lambda what: ConfigError('E-CONFIG-007', f'--{name}={path}: {what}', _CONFIG_FIX)
  if not file:
    return fail('no file given')
  if not os.path.exists(file):
    return fail('no such file')
  if os.path.isdir(file):
    return fail('is a directory')
  loader = importlib.machinery.SourceFileLoader(f'_jaxckpt_config_check_{name}', file)
  module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
  try:
    loader.exec_module(module)
    if not callable(getattr(module, 'get_config', None)):
      return fail('defines no get_config()')
    config = module.get_config(*arg)
  except SyntaxError as e:
    return fail(f'{e.msg} at line {e.lineno}')
  except Exception as e:  # pylint: disable=broad-except
    lines = [
        f.lineno
        for f in traceback.extract_tb(e.__traceback__)
        if os.path.realpath(f.filename) == os.path.realpath(file)
    ]
    where = f' at line {lines[-1]}' if lines else ''
    return fail(f'{type(e).__name__}{where}: ' + ' '.join(str(e).split()))
  if not isinstance(config, ml_collections.ConfigDict):
    return fail(f'get_config() returned {type(config).__name__}, not a ConfigDict')
  return config


def _unknown_field(name: str, config: ml_collections.ConfigDict, field: str) -> ConfigError | None:
  """The error for `--<name>.<field>` when the config has no such field; None when it has."""
  node, parts = config, field.split('.')
  for i, part in enumerate(parts):
    section = '.'.join(parts[:i])
    if not isinstance(node, ml_collections.ConfigDict):
      return ConfigError('E-CONFIG-008', f'--{name}.{field}: {section} is a value, not a '
                         'section with fields', f'set --{name}.{section} itself')
    if part not in node:
      where = f'{section} has' if section else 'the config has'
      return ConfigError('E-CONFIG-008', f'--{name}.{field}: {where} no field {part!r}',
                         f'its fields are {", ".join(sorted(node))}')
    node = node[part]
  return None
