"""Train a GPT, or continue the run in --workdir.

    python -m jaxckpt.main --config=configs/tiny.py --workdir=runs/tiny

The same command starts, restarts and continues a run: by default it resumes from the newest
committed checkpoint in <workdir>/checkpoints. `--config.train.steps=500` style flags override
config fields; the checkpoint flags below override `config.checkpoint.*`.
"""

import functools
import os

from absl import app, flags
from ml_collections import config_flags

from jaxckpt.checkpoint import signals
from jaxckpt.cli import parser, trainer_flags
from jaxckpt.errors import UsageError
from jaxckpt.records import provenance as provenance_lib
from jaxckpt.train.save_cadence import EveryFlagParser

FLAGS = flags.FLAGS
trainer_flags.define_config_file('config', 'Path to a config file (configs/*.py).')
flags.DEFINE_string('workdir', None, 'Directory of the run: checkpoints, logs, exports.')
flags.DEFINE_string(
    'resume', None, 'latest (default) | none | PATH of a step_<n> directory '
    'or of a step_NNNNNN.bin. Default: $JAXCKPT_RESUME, else latest.')
flags.DEFINE(
    EveryFlagParser(),
    'checkpoint_every',
    None, 'Steps between checkpoints (0: off), or auto (from the measured cost of a checkpoint '
    'and how often the run is interrupted).',
    serializer=flags.ArgumentSerializer())
flags.DEFINE_string('checkpoint_mtbi', None, 'auto: prior mean time between interruptions '
                    '(90s, 15m, 6h, 30d).')
flags.DEFINE_float('checkpoint_min_secs', None, 'auto: the shortest interval (0: none).')
flags.DEFINE_float('checkpoint_max_secs', None, 'auto: the longest interval (0: none).')
flags.DEFINE_integer('checkpoint_epochs', None, 'Also save when every N-th epoch ends (0: off).')
flags.DEFINE_float('checkpoint_secs', None, 'Seconds between checkpoints (0: off).')
flags.DEFINE_enum('checkpoint_mode', None, ['auto', 'async', 'sync'],
                  'How checkpoints are written.')
flags.DEFINE_enum(
    'checkpoint_staging', None, ['auto', 'host', 'device'],
    'Where save() copies the state first: host memory, or the devices (a second '
    'copy in device memory; the copy to host runs in the background).')
flags.DEFINE_string(
    'remote', None, 'Durable copy of every checkpoint: s3://bucket/prefix, gs://bucket/prefix '
    'or a mounted path; an empty --workdir resumes from it.')
flags.DEFINE_float('remote_lease_secs', None,
                   'A --remote lease not renewed for this long is taken over.')
flags.DEFINE_enum(
    'remote_lease', None, ['on', 'off'], 'One writer per --remote prefix, enforced with a lease '
    '(off: for a store that ignores conditional writes; nothing stops a second writer).')
flags.DEFINE_float(
    'stop_grace_secs', None, 'After a stop signal, seconds the upload of the last checkpoint '
    'may take before the process exits (clouds give about 30).')
flags.DEFINE_integer('keep', None, 'Newest checkpoints to keep (0: all).')
flags.DEFINE_integer('keep_every', None, 'Keep every checkpoint whose step is divisible by this.')
flags.DEFINE_integer(
    'keep_best', None, 'Also keep the N checkpoints with the lowest held-out loss '
    '(evaluated every config.train.eval_every steps; 0: off).')
flags.DEFINE_bool(
    'guard_finite', None, 'Check params and optimizer state for NaN/inf before '
    'each checkpoint commits; stop the run instead of committing them.')
flags.DEFINE_integer(
    'export_every', None, 'Export the first checkpoint at or after each '
    'multiple of this many steps, and the last step (0: off).')
flags.DEFINE_string('export_formats', None, 'Comma list of export formats: safetensors,hf,bin.')
flags.DEFINE_integer('export_keep', None, 'Newest exported steps to keep (0: all).')
flags.DEFINE_bool('export_optimizer', None, 'Also export Adam m and v as optimizer.safetensors.')
# One run across many hosts (README: Many hosts): jax.distributed.initialize's own arguments.
flags.DEFINE_string(
    'coordinator_address', None, 'HOST:PORT of process 0, the same on every '
    'process (omit where JAX detects the cluster: TPU VMs, SLURM).')
flags.DEFINE_integer('num_processes', None, 'Processes in the job (one per host).')
flags.DEFINE_integer('process_id', None, 'This process: 0 .. num_processes-1.')
flags.DEFINE_float(
    'heartbeat_timeout_seconds', 60.0, 'A process silent this long is lost: the '
    'others stop (E-DIST-006) and the next start resumes.')
flags.DEFINE_float(
    'barrier_timeout_secs', 600.0, 'How long a process waits for the others (a '
    "save's commit, an agreed stop) before failing, naming the missing ones.")
flags.DEFINE_float(
    'init_timeout_secs', 300.0, 'How long a process waits for all the others to join the job '
    'at start (E-DIST-005 names the missing ones).')
flags.DEFINE_float(
    'step_timeout_secs', None, 'A step not done within this many seconds is a hang: every '
    "thread's stack is logged and the run fails (E-DIST-010). Default: max(600, 50 x the "
    'median step time).')
flags.mark_flags_as_required(['config', 'workdir'])

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
    'stop_grace_secs': 'checkpoint.stop_grace_secs',
    'keep': 'checkpoint.keep',
    'keep_every': 'checkpoint.keep_every',
    'keep_best': 'checkpoint.keep_best',
    'guard_finite': 'train.guard_finite',
    'export_every': 'export.every',
    'export_formats': 'export.formats',
    'export_keep': 'export.keep',
    'export_optimizer': 'export.optimizer',
}


def main(argv, watcher: signals.PreemptionWatcher | None = None):
  return parser.run_reporting_errors(lambda: train_from_flags(argv, watcher))


def train_from_flags(argv, watcher: signals.PreemptionWatcher | None = None) -> None:
  if len(argv) > 1:
    raise UsageError('E-USAGE-004', f'unexpected argument(s): {" ".join(argv[1:])}',
                     'every input is a flag (--name=value): see --help')
  config = FLAGS.config
  with config.unlocked():
    for flag, field in FLAG_FIELDS.items():
      if FLAGS[flag].value is not None:
        section, name = field.split('.')
        config[section][name] = FLAGS[flag].value
  provenance = provenance_lib.provenance(
      config,
      config_flags.get_config_filename(FLAGS['config']),
      flagged=provenance_lib.flagged_fields(FLAGS, FLAG_FIELDS))
  resume = FLAGS.resume or os.environ.get('JAXCKPT_RESUME') or 'latest'
  from jaxckpt.hosts import distributed  # joins the job before anything touches the devices
  distributed.initialize(
      FLAGS.coordinator_address,
      FLAGS.num_processes,
      FLAGS.process_id,
      heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_seconds,
      timeout_secs=FLAGS.barrier_timeout_secs,
      init_timeout_secs=FLAGS.init_timeout_secs,
      stop_signal=lambda: watcher and watcher.stop_signal)
  from jaxckpt.train import loop as train  # after flag parsing: jax is slow to import
  train.train_and_evaluate(
      config,
      FLAGS.workdir,
      resume=resume,
      provenance=provenance,
      watcher=watcher,
      step_timeout_secs=FLAGS.step_timeout_secs)


if __name__ == '__main__':
  # First, before the slow imports: from here to exit a signal is a flag, never a kill.
  watcher = signals.PreemptionWatcher().install_until_exit()
  parser.configure_logging()
  app.run(functools.partial(main, watcher=watcher), flags_parser=trainer_flags.parse_flags_or_exit)
