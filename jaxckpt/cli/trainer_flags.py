"""The trainer's command line: its flags, `--help`, and one line for a config that fails.

`python -m jaxckpt.main` calls `define_trainer_flags` and parses with `parse_flags_or_exit`, so a
missing, broken or foreign config file, an unknown field or a bad flag is `jaxckpt: E-...: what;
fix` and exit 2, never a traceback; `--help` is jaxckpt's own flags with their defaults
(`jaxckpt.cli.trainer_help`, exit 0; with a `--config` that does not load, that file's one line
too, and exit 2), `--helpfull` absl's listing of every flag.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import sys
import traceback

import ml_collections
from absl import app, flags
from ml_collections.config_flags import config_flags  # is_config_flag is not re-exported

from jaxckpt.cli import trainer_help
from jaxckpt.cli.parser import exit_with
from jaxckpt.errors import ConfigError, UsageError
from jaxckpt.records import provenance
from jaxckpt.train.save_cadence import EveryFlagParser

_CONFIG_FIX = 'pass a file like configs/tiny.py, whose get_config() returns a ConfigDict'

# Flags that set a config field; the manifest records such values with source `flag`.
FLAG_FIELDS = {
    'checkpoint_every': 'checkpoint.every',
    'checkpoint_secs': 'checkpoint.secs',
    'checkpoint_mtbi': 'checkpoint.mtbi',
    'checkpoint_min_secs': 'checkpoint.min_secs',
    'checkpoint_max_secs': 'checkpoint.max_secs',
    'checkpoint_epochs': 'checkpoint.epochs',
    'checkpoint_mode': 'checkpoint.mode',
    'checkpoint_staging': 'checkpoint.staging',
    'remote': 'checkpoint.remote',
    'remote_lease_secs': 'checkpoint.remote_lease_secs',
    'remote_lease': 'checkpoint.remote_lease',
    'remote_rate': 'checkpoint.remote_rate',
    'stop_grace_secs': 'checkpoint.stop_grace_secs',
    'keep': 'checkpoint.keep',
    'replicas': 'checkpoint.replicas',
    'remote_every': 'checkpoint.remote_every',
    'remote_mtbi': 'checkpoint.remote_mtbi',
    'keep_every': 'checkpoint.keep_every',
    'keep_best': 'checkpoint.keep_best',
    'guard_finite': 'train.guard_finite',
    'export_every': 'export.every',
    'export_formats': 'export.formats',
    'export_keep': 'export.keep',
    'export_optimizer': 'export.optimizer',
}
# Former names that still work.
ALIASES = {'heartbeat_timeout_seconds': 'heartbeat_timeout_secs'}
# Only `--checkpoint_every=auto` reads these.
AUTO_ONLY = ('checkpoint_mtbi', 'checkpoint_min_secs', 'checkpoint_max_secs')
_HELP_FLAGS = ('help', 'helpshort', 'h', '?')


def _field(help_string: str, flag: str) -> str:
  """A config-field flag's help, with where its default comes from (`--helpfull` shows it)."""
  return f"{help_string} (default: the config's {FLAG_FIELDS[flag]})"


def define_trainer_flags() -> None:
  """Define `python -m jaxckpt.main`'s flags (once, at import of `jaxckpt.main`)."""
  define_config_file(
      'config', 'Path to a config file (configs/*.py); its fields are flags too: '
      '--config.train.steps=500.')
  flags.DEFINE_string('workdir', None, 'Directory of the run: checkpoints, logs, exports.')
  flags.DEFINE_string(
      'resume', None, 'latest | none | PATH of a step_<n> directory or of a step_NNNNNN.bin '
      '(default: $JAXCKPT_RESUME, else latest).')
  flags.DEFINE(
      EveryFlagParser(),
      'checkpoint_every',
      None,
      _field(
          'Steps between checkpoints (0: off), or auto (from the measured cost of a checkpoint '
          'and how often the run is interrupted).', 'checkpoint_every'),
      serializer=flags.ArgumentSerializer())
  flags.DEFINE_string(
      'checkpoint_mtbi', None,
      _field(
          'With --checkpoint_every=auto: the prior mean time between interruptions (90s, 15m, '
          '6h, 30d).', 'checkpoint_mtbi'))
  flags.DEFINE_float(
      'checkpoint_min_secs', None,
      _field('With --checkpoint_every=auto: the shortest interval (0: none).',
             'checkpoint_min_secs'))
  flags.DEFINE_float(
      'checkpoint_max_secs', None,
      _field('With --checkpoint_every=auto: the longest interval (0: none).',
             'checkpoint_max_secs'))
  flags.DEFINE_integer(
      'checkpoint_epochs', None,
      _field('Also save when every N-th epoch ends (0: off).', 'checkpoint_epochs'))
  flags.DEFINE_float('checkpoint_secs', None,
                     _field('Seconds between checkpoints (0: off).', 'checkpoint_secs'))
  flags.DEFINE_enum('checkpoint_mode', None, ['auto', 'async', 'sync'],
                    _field('How checkpoints are written.', 'checkpoint_mode'))
  flags.DEFINE_enum(
      'checkpoint_staging', None, ['auto', 'host', 'device'],
      _field(
          'Where save() copies the state first: host memory, or the devices (a second copy in '
          'device memory; the copy to host runs in the background).', 'checkpoint_staging'))
  flags.DEFINE_string(
      'remote', None,
      _field(
          'Durable copy of the checkpoints: s3://bucket/prefix, gs://bucket/prefix or a '
          'mounted path; an empty --workdir resumes from it.', 'remote'))
  flags.DEFINE_float(
      'remote_lease_secs', None,
      _field('A --remote lease not renewed for this long is taken over.', 'remote_lease_secs'))
  flags.DEFINE_enum(
      'remote_lease', None, ['on', 'off'],
      _field(
          'One writer per --remote prefix, enforced with a lease (off: for a store that ignores '
          'conditional writes; nothing stops a second writer).', 'remote_lease'))
  flags.DEFINE_string(
      'remote_rate', None,
      _field(
          "The whole job's requests a second to --remote, split evenly over its processes: auto "
          "(the store's documented limits x 0.9), off, or a number.", 'remote_rate'))
  flags.DEFINE_float(
      'stop_grace_secs', None,
      _field(
          'After a stop signal, seconds the upload of the last checkpoint may take before the '
          'process exits (clouds give about 30).', 'stop_grace_secs'))
  flags.DEFINE_integer('keep', None, _field('Newest checkpoints to keep (0: all).', 'keep'))
  flags.DEFINE_integer(
      'replicas', None,
      _field(
          "Each host's own disk, with --remote: each process also keeps the parts of this many "
          'other hosts, so a lost host is restored from its peers (0: off).', 'replicas'))
  flags.DEFINE_string(
      'remote_every', None,
      _field(
          'With --remote: upload every K-th checkpoint, or auto (every one; with --replicas and '
          '--checkpoint_every=auto, K for the failures the peers cannot cover).', 'remote_every'))
  flags.DEFINE_string(
      'remote_mtbi', None,
      _field(
          'With --replicas and --remote_every=auto: the mean time between losses the peers '
          'cannot cover (the whole job, or R+1 neighbouring hosts): 12h, 3d, 2w.', 'remote_mtbi'))
  flags.DEFINE_integer(
      'keep_every', None,
      _field('Keep every checkpoint whose step is divisible by this (0: off).', 'keep_every'))
  flags.DEFINE_integer(
      'keep_best', None,
      _field(
          'Also keep the N checkpoints with the lowest held-out loss (evaluated every '
          'config.train.eval_every steps; 0: off).', 'keep_best'))
  flags.DEFINE_bool(
      'guard_finite', None,
      _field(
          'Check params and optimizer state for NaN/inf before each checkpoint commits; stop '
          'the run instead of committing them.', 'guard_finite'))
  flags.DEFINE_integer(
      'export_every', None,
      _field(
          'Export the first checkpoint at or after each multiple of this many steps, and the '
          'last step (0: off; one process only).', 'export_every'))
  flags.DEFINE_string('export_formats', None,
                      _field('Comma list of export formats: safetensors,hf,bin.', 'export_formats'))
  flags.DEFINE_integer('export_keep', None,
                       _field('Newest exported steps to keep (0: all).', 'export_keep'))
  flags.DEFINE_bool(
      'export_optimizer', None,
      _field('Also export Adam m and v as optimizer.safetensors.', 'export_optimizer'))
  # One run across many hosts (README: Many hosts): jax.distributed.initialize's own arguments.
  flags.DEFINE_string(
      'coordinator_address', None, 'HOST:PORT of process 0, the same on every process (default: '
      'detected where JAX detects the cluster: TPU VMs, SLURM; else one process).')
  flags.DEFINE_integer('num_processes', None,
                       "Processes in the job, one per host (default: the cluster's, else 1).")
  flags.DEFINE_integer('process_id', None,
                       "This process: 0 .. num_processes-1 (default: the cluster's, else 0).")
  flags.DEFINE_float(
      'heartbeat_timeout_secs', 60.0, 'A process silent this long is lost: the others stop '
      '(E-DIST-006) and the next start resumes.')
  for old, new in ALIASES.items():
    flags.DEFINE_alias(old, new)
  flags.DEFINE_float(
      'barrier_timeout_secs', 600.0, 'How long a process waits for the others (a '
      "save's commit, an agreed stop) before failing, naming the missing ones.")
  flags.DEFINE_float(
      'init_timeout_secs', 300.0, 'How long a process waits for all the others to join the job '
      'at start (E-DIST-005 names the missing ones).')
  flags.DEFINE_float(
      'step_timeout_secs', None, 'A step not done within this many seconds is a hang: every '
      "thread's stack is logged and the run fails (E-DIST-010) (default: max(600, 50 x the "
      'median step time)).')


REQUIRED = {'config': 'configs/tiny.py', 'workdir': 'runs/tiny'}  # each with an example


def check_required(flag_values) -> None:
  """`--config` and `--workdir` given, else E-USAGE-001 naming the missing ones with an example
  (absl's own check would say `flag --config=None: Flag --config must have a value other than
  None`)."""
  missing = [name for name in REQUIRED if flag_values[name].value is None]
  if missing:
    raise UsageError(
        'E-USAGE-001', f'{" and ".join("--" + n for n in missing)} '
        f'{"is" if len(missing) == 1 else "are"} required',
        f'pass {"it" if len(missing) == 1 else "both"}, e.g. ' +
        ' '.join(f'--{n}={REQUIRED[n]}' for n in missing) + ' (see --help)')


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
  told here, naming the file or the `--config.*` field. `--help` and `--helpfull` print to
  stdout and exit 0 (`--help` with a `--config` that does not load: exit 2, saying why).
  """
  args = _args(argv)
  for path in config_paths(args).values():
    provenance.make_config_importable(path.split(':', 1)[0])
  if any(re.fullmatch(r'--?helpfull', a) for a in args):
    app.usage(writeto_stdout=True, exitcode=0)
  if any(a.lstrip('-') in _HELP_FLAGS and a.startswith('-') for a in args):
    print(
        trainer_help.render(
            config_paths(args).get('config'), load=load_config, fields=FLAG_FIELDS,
            aliases=ALIASES),
        end='',
        flush=True)
    sys.exit(0)
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


def check_auto_only(flag_values, config) -> None:
  """The flags only `--checkpoint_every=auto` reads, given without it: E-USAGE-006 (exit 2),
  not a value that is silently ignored."""
  given = [f'--{name}' for name in AUTO_ONLY if flag_values[name].present]
  every = config.checkpoint.every
  if given and not (isinstance(every, str) and every.strip().lower() == 'auto'):  # `parse_every`
    from jaxckpt.train.config import cadence_options  # pylint: disable=import-outside-toplevel
    cadence_options(config)  # a bad value is the first thing to fix
    names = ' and '.join(given)
    raise UsageError(
        'E-USAGE-006', f'{names} {"applies" if len(given) == 1 else "apply"} only with '
        f'--checkpoint_every=auto, but checkpoint.every is {every!r}',
        f'add --checkpoint_every=auto, or leave out {names}')


# Only a run with `--remote` reads these.
REMOTE_ONLY = ('remote_every', 'remote_mtbi', 'remote_lease', 'remote_lease_secs', 'remote_rate')


def check_remote_only(flag_values, config) -> None:
  """The flags only `--remote` reads, given without it: E-USAGE-006 (exit 2), not a value
  that is silently ignored."""
  given = [f'--{name}' for name in REMOTE_ONLY if flag_values[name].present]
  if given and not config.checkpoint.get('remote'):
    from jaxckpt.train.config import validate_config  # pylint: disable=import-outside-toplevel
    validate_config(config)  # a bad value is the first thing to fix
    names = ' and '.join(given)
    raise UsageError(
        'E-USAGE-006', f'{names} {"applies" if len(given) == 1 else "apply"} only with '
        '--remote, and there is none', f'add --remote=s3://bucket/prefix, or leave out {names}')


def resume_mode(flag_value: str | None, environ=os.environ) -> str:
  """`--resume`, else `$JAXCKPT_RESUME`, else `latest`. An empty value (`--resume=$STEP` with STEP
  unset) is refused (E-RESUME-005): taken as `latest`, it would resume from another checkpoint than
  the one meant."""
  for name, value in (('--resume', flag_value), ('JAXCKPT_RESUME', environ.get('JAXCKPT_RESUME'))):
    if value is None:
      continue
    if not value.strip():
      raise UsageError(
          'E-RESUME-005', f'{name} is empty',
          f"give {name} a value: latest, none, or a checkpoint's path" +
          (' (or unset it)' if name == 'JAXCKPT_RESUME' else ''))
    if name == 'JAXCKPT_RESUME' and value not in ('latest', 'none') and not os.path.exists(value):
      code = 'E-BIN-003' if value.lower().endswith('.bin') else 'E-RESUME-003'
      raise UsageError(
          code, f'JAXCKPT_RESUME={value}: no such file or directory',
          "set it to latest, none, or a checkpoint's path (or unset it, or pass --resume)")
    return value
  return 'latest'


def startup_line(flag_values, resume: str) -> str:
  """What this start is, before anything slow: config, workdir, processes, what it resumes."""
  config = config_flags.get_config_filename(flag_values['config'])
  count, index = flag_values.num_processes, flag_values.process_id
  where = (f'process {index} of {count}' if count and count > 1 else
           'one process' if count or not flag_values.coordinator_address else 'processes: '
           'from the cluster')
  intent = {
      'latest': 'resume: the newest committed checkpoint in the workdir, else a fresh start',
      'none': 'resume: none (a fresh start)'
  }.get(resume, f'resume: {resume}')
  return f'config {config}, workdir {flag_values.workdir}, {where}, {intent}'


DETERMINISTIC_OPS = '--xla_gpu_deterministic_ops'


def xla_flags(deterministic: bool, current: str) -> str:
  """The XLA_FLAGS a run starts its backend with: `current`, with deterministic GPU ops asked
  for when `deterministic` (`config.train.deterministic`), unless `current` already says either
  way (the environment's choice stands). A CPU or TPU ignores the flag."""
  if not deterministic or DETERMINISTIC_OPS in current:
    return current
  return f'{current} {DETERMINISTIC_OPS}=true'.strip()


# ----------------------------------------------------------------------------- the config
def _args(argv: list[str]) -> list[str]:
  """The command line's flags, flagfiles read, up to a `--`."""
  try:
    args = flags.FLAGS.read_flags_from_files(argv[1:], force_gnu=False)
  except flags.Error:
    args = argv[1:]
  return args[:args.index('--')] if '--' in args else args


def _config_flag_names() -> list[str]:
  return [name for name in flags.FLAGS if config_flags.is_config_flag(flags.FLAGS[name])]


def config_paths(args: list[str]) -> dict[str, str]:
  """{config flag: its `FILE[:ARG]`} as given in `args`."""
  paths = {}
  for name in _config_flag_names():
    for i, arg in enumerate(args):
      if re.fullmatch(rf'--?{name}(=.*)?', arg):
        paths[name] = arg.split('=', 1)[1] if '=' in arg else (args[i + 1] if i +
                                                               1 < len(args) else '')
  return paths


def config_problem(argv: list[str]) -> ConfigError | None:
  """What is wrong with the `--config` file or a `--config.*` field on `argv`; None: nothing."""
  args = _args(argv)
  paths = config_paths(args)
  for name in _config_flag_names():
    overrides = [m.group(1) for arg in args if (m := re.match(rf'--?(?:no)?{name}\.([^=]+)', arg))]
    if name not in paths:
      continue  # `check_required` says that it is missing
    config = load_config(name, paths[name])
    if isinstance(config, ConfigError):
      return config
    for field in overrides:
      problem = _unknown_field(name, config, field)
      if problem is not None:
        return problem
  return None


def load_config(name: str, path: str) -> ml_collections.ConfigDict | ConfigError:
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
