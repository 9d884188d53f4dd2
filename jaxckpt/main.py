"""Train a GPT, or continue the run in --workdir.

    python -m jaxckpt.main --config=configs/tiny.py --workdir=runs/tiny

The same command starts, restarts and continues a run: by default it resumes from the newest
committed checkpoint in <workdir>/checkpoints. `--config.train.steps=500` style flags override
config fields; the checkpoint flags below override `config.checkpoint.*`.
"""

import functools
import os

from absl import app, flags, logging
from ml_collections import config_flags

from jaxckpt.checkpoint import signals
from jaxckpt.cli import parser, trainer_flags
from jaxckpt.errors import UsageError
from jaxckpt.records import provenance as provenance_lib

FLAGS = flags.FLAGS
trainer_flags.define_trainer_flags()


def main(argv, watcher: signals.PreemptionWatcher | None = None):
  return parser.run_reporting_errors(lambda: train_from_flags(argv, watcher))


def train_from_flags(argv, watcher: signals.PreemptionWatcher | None = None) -> None:
  trainer_flags.check_required(FLAGS)
  if len(argv) > 1:
    raise UsageError('E-USAGE-004', f'unexpected argument(s): {" ".join(argv[1:])}',
                     'every input is a flag (--name=value): see --help')
  config = FLAGS.config
  with config.unlocked():
    for flag, field in trainer_flags.FLAG_FIELDS.items():
      if FLAGS[flag].value is not None:
        section, name = field.split('.')
        config[section][name] = FLAGS[flag].value
  trainer_flags.check_auto_only(FLAGS, config)
  trainer_flags.check_remote_only(FLAGS, config)
  resume = trainer_flags.resume_mode(FLAGS.resume)
  logging.info('%s', trainer_flags.startup_line(FLAGS, resume))  # before the slow imports
  provenance = provenance_lib.provenance(
      config,
      config_flags.get_config_filename(FLAGS['config']),
      flagged=provenance_lib.flagged_fields(FLAGS, trainer_flags.FLAG_FIELDS))
  # Read once, when the backend starts: before anything touches the devices.
  flags_now = os.environ.get('XLA_FLAGS', '')
  wanted = trainer_flags.xla_flags(config.train.get('deterministic', True), flags_now)
  if wanted != flags_now:
    os.environ['XLA_FLAGS'] = wanted
  from jaxckpt.hosts import distributed  # joins the job before anything touches the devices
  distributed.initialize(
      FLAGS.coordinator_address,
      FLAGS.num_processes,
      FLAGS.process_id,
      heartbeat_timeout_seconds=FLAGS.heartbeat_timeout_secs,
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
  # A thread stuck on a hung disk or store holds the exit EXIT_WAIT_SECS at most.
  parser.exit_within(lambda: app.run(
      functools.partial(main, watcher=watcher), flags_parser=trainer_flags.parse_flags_or_exit))
