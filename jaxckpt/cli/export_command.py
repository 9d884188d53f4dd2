"""`jaxckpt export SOURCE --format=safetensors|hf|bin --out=PATH`: a checkpoint or `.bin` as
files other tools read (`jaxckpt.export.offline`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Mapping

import ml_collections

from jaxckpt.cli import config_arg, remote_args
from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.errors import ConfigError, UsageError
from jaxckpt.export.offline import (FORMATS, check_bin_format, check_config_model, check_out,
                                    export_bin, export_checkpoint)


def _parser():
  parser = ArgumentParser(
      prog='jaxckpt export',
      description='Export a committed checkpoint, or a .bin, for other '
      'tools: flat safetensors, a Hugging Face GPT-2 directory, or the raw ANDREA .bin.')
  parser.add_argument(
      'source',
      help='a committed checkpoints/step_<n> directory, the URL of a remote run (its newest '
      'intact checkpoint) or checkpoint, or a step_NNNNNN.bin (then --config is needed)')
  parser.add_argument(
      '--format',
      required=True,
      metavar='|'.join(FORMATS),
      help='safetensors: OUT/model.safetensors (+ optimizer.safetensors with --optimizer); hf: a '
      'GPT2LMHeadModel directory; bin: the raw ANDREA file (checkpoints only)')
  parser.add_argument(
      '--out',
      required=True,
      help='the directory (safetensors, hf) or file (bin) to write; an earlier export of the same '
      'format there is replaced whole and atomically, anything else is refused')
  parser.add_argument(
      '--config',
      help='configs/<name>.py: the model config (required for a '
      ".bin, which holds none; overrides the manifest's for a checkpoint)")
  # Weights only by default, as exports during training (`export.optimizer`, off by default).
  # None: not given. A format that cannot do what the flag says refuses it (`_check_optimizer`).
  parser.add_argument(
      '--optimizer',
      action=argparse.BooleanOptionalAction,
      default=None,
      help='safetensors: also write optimizer.safetensors (Adam m and v); default: weights only. '
      'hf holds the weights only and a .bin always holds m and v: there the flag is refused')
  return parser


def _check_optimizer(fmt: str, optimizer: bool | None) -> None:
  """Refuse an --optimizer/--no-optimizer the format cannot honour, rather than ignore it."""
  if fmt == 'hf' and optimizer:
    raise UsageError(
        'E-USAGE-001', 'jaxckpt export: --optimizer does not apply to --format=hf: a Hugging '
        'Face directory holds the weights only', 'leave out --optimizer, or export '
        '--format=safetensors --optimizer for Adam m and v')
  if fmt == 'bin' and optimizer is False:
    raise UsageError(
        'E-USAGE-001', 'jaxckpt export: --no-optimizer does not apply to --format=bin: a .bin '
        'always holds Adam m and v (8 + 12n bytes)', 'leave out --no-optimizer, or export '
        '--format=safetensors or --format=hf for the weights only')


def _model_of(path: str):
  """The model config of the --config file `path`, checked before anything is read or written:
  a file whose get_config() gives no config, or a model the exporters cannot use, is exit 2."""
  config = config_arg.load(path)
  if not isinstance(config, (Mapping, ml_collections.ConfigDict)):
    raise UsageError(
        'E-USAGE-001', f'--config={path}: get_config() returned '
        f'{type(config).__name__}, not a ConfigDict', 'pass a configs/<name>.py file')
  if 'model' not in config:
    raise ConfigError('E-CONFIG-001', f'--config={path} has no model config (config.model)',
                      'pass the config the model was trained with (configs/<name>.py)')
  check_config_model(config['model'], f'--config={path}')
  return config['model']


def main(argv: list[str]) -> int:
  """`jaxckpt export SOURCE --format=safetensors|hf|bin --out=PATH [--config=FILE]`.

    jaxckpt export runs/tiny/checkpoints/step_00000300 --format=hf --out=out/tiny_hf
    jaxckpt export runs/tiny/exports/step_000300.bin --format=hf --config=configs/tiny.py \\
        --out=out/tiny_hf

  `argv` excludes the subcommand. Usage errors raise `UsageError` (one line, exit 2).
  """
  args = _parser().parse_args(argv)
  source = Path(args.source)
  if source.suffix == '.bin':
    check_bin_format(source, args.format)
  _check_optimizer(args.format, args.optimizer)
  optimizer = bool(args.optimizer)
  model_cfg = _model_of(args.config) if args.config else None
  check_out(args.format, Path(args.out))  # before a remote checkpoint is downloaded
  if source.suffix == '.bin':
    if model_cfg is None:
      raise UsageError('E-USAGE-003', f'{source} is a .bin, which holds no model config',
                       'pass --config=configs/<name>.py, the config it was trained with')
    out = export_bin(source, args.format, args.out, model_cfg, optimizer=optimizer)
  else:
    with remote_args.local_checkpoint(args.source) as local:
      out = export_checkpoint(
          local, args.format, args.out, model_cfg=model_cfg, optimizer=optimizer)
  weights_only = args.format == 'safetensors' and not optimizer
  # The source as given: a URL through Path() would lose a slash (file:///x -> file:/x).
  print(f'exported {args.source} as {args.format} to {out}' +
        (' (weights only; --optimizer also writes Adam m and v)' if weights_only else ''))
  return 0
