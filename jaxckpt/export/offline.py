"""Exports after the fact, from a committed checkpoint or a `.bin` (`jaxckpt export`).

    export_checkpoint('runs/tiny/checkpoints/step_00000300', 'hf',
                      export_path('runs/tiny/exports', 300, 'hf'))
    export_bin('runs/tiny/exports/step_000300.bin', 'safetensors', 'out/step_300', config.model)

    jaxckpt export runs/tiny/checkpoints/step_00000300 --format=hf --out=out/tiny_hf
    jaxckpt export runs/tiny/exports/step_000300.bin --format=safetensors \\
        --config=configs/tiny.py --out=out/step_300

Nothing here builds the model or touches an accelerator: the arrays are read as host numpy
arrays, the model config and step come from the checkpoint's `manifest.json`, and the manifest's
seal and the checkpoint's checksums are verified before anything is written. An existing `out` is
replaced only when it is an earlier export of the same format (`jaxckpt.export.target`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from jaxckpt.checkpoint import layout, manifest
from jaxckpt.checkpoint.formats import data_file, read_host_arrays
from jaxckpt.errors import CheckpointError, ConfigError, UsageError
from jaxckpt.export import atomic_dir, flatbin, frozen, hf, safetensors_io, target
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names

FORMATS = ('safetensors', 'hf', 'bin')
MODEL_FILE = 'model.safetensors'
OPTIMIZER_FILE = 'optimizer.safetensors'


def export_path(exports_dir: str | os.PathLike, step: int, fmt: str) -> Path:
  """The conventional place of an export under a run's `exports/` directory.

  safetensors: `exports/step_<8 digits>/` (holding model.safetensors, optimizer.safetensors);
  hf: `exports/step_<8 digits>/hf/`; bin: `exports/step_NNNNNN.bin`.
  """
  _check_format(fmt, FORMATS)
  exports_dir = Path(exports_dir)
  if fmt == 'bin':
    return exports_dir / flatbin.bin_name(step)
  step_dir = exports_dir / layout.step_dirname(step)
  return step_dir / 'hf' if fmt == 'hf' else step_dir


# The model's sizes: whole numbers, positive, within int32 (n_layer within reason: a list of its
# parameter names is built), and the head flag a bool (the string 'false' would be true).
_SIZES = ('vocab_size', 'block_size', 'n_layer', 'n_head', 'n_embd')
_MAX = {'n_layer': 1 << 16}
MODEL_DTYPES = ('float32', 'bfloat16')


def model_config_problem(model_cfg: Any, *, complete: bool = True) -> str | None:
  """What is wrong with a model config (from a --config file or a manifest), naming the field
  as `model.<field>=<value>`; None when nothing is. `complete`: every field the exporters need
  is there (else only the fields given are checked, for a config that fills in another's)."""
  if not isinstance(model_cfg, Mapping) and not hasattr(model_cfg, 'to_dict'):
    return f'model is {type(model_cfg).__name__}, not a config of fields'
  m = model_cfg.to_dict() if hasattr(model_cfg, 'to_dict') else dict(model_cfg)
  for field in _SIZES + ('tie_embeddings',):
    if field not in m:
      if complete:
        return f'model.{field} is missing'
      continue
    value, bound = m[field], _MAX.get(field, 2**31 - 1)
    if field == 'tie_embeddings':
      if not isinstance(value, bool):
        return f'model.tie_embeddings={value!r:.40} is not True or False'
    elif isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= bound:
      return f'model.{field}={value!r:.40} is not a whole number in [1, {bound}]'
  if 'dtype' in m and m['dtype'] not in MODEL_DTYPES:
    return f'model.dtype={m["dtype"]!r:.40} is not {" or ".join(MODEL_DTYPES)}'
  if 'n_head' in m and 'n_embd' in m and m['n_embd'] % m['n_head']:
    return f'model.n_embd={m["n_embd"]} is not a multiple of model.n_head={m["n_head"]}'
  return None


def check_config_model(model_cfg: Any, where: str) -> None:
  """Refuse (ConfigError E-CONFIG-001, exit 2) a model config given by a user (`where`: the
  --config file) that the exporters cannot use."""
  problem = model_config_problem(model_cfg)
  if problem:
    fix = (f'fix config.model in {where.removeprefix("--config=")}'
           if where.startswith('--config=') else 'pass a config.model that can be built')
    raise ConfigError('E-CONFIG-001', f'{where}: {problem}', fix)


def read_checkpoint(step_dir: str | os.PathLike, model_cfg=None) -> dict[str, Any]:
  """{step, model_cfg, params, m, v} of a committed checkpoint, as host numpy arrays.

  `params`, `m` and `v` are {dotted name: array} in canonical order; `m` and `v` are None when
  the optimizer state holds no Adam moments. `model_cfg` defaults to the manifest's.

  Raises:
    UsageError (E-EXPORT-003): not a committed checkpoint, or no model config known.
    CheckpointError (E-EXPORT-004): a file does not match the manifest's size or checksum.
    UsageError (E-EXPORT-002): the arrays do not fit the model config.
  """
  step_dir = Path(step_dir)
  meta = _read_manifest(step_dir)
  if model_cfg is not None:
    check_config_model(model_cfg, 'model_cfg')
  saved = _model_config(step_dir, meta, required=model_cfg is None)
  if model_cfg is not None and saved is not None:
    given = model_lib.as_model_config(model_cfg).to_dict()
    differ = [
        f'{k}={given[k]!r} (the checkpoint: {v!r})' for k, v in saved.items()
        if k in given and given[k] != v
    ]
    if differ:
      raise UsageError(
          'E-EXPORT-002', f'the model config given differs from the one {step_dir} was '
          f'trained with: {", ".join(differ)}', "leave out --config: the checkpoint's own "
          'model config is used')
  cfg = model_lib.as_model_config(model_cfg if model_cfg is not None else saved)
  found: dict[str, dict[str, np.ndarray]] = {'params': {}, 'm': {}, 'v': {}}
  for leaf, array in _read_arrays(step_dir, meta).items():
    which = names.param_of_leaf(leaf)
    if which is None:
      continue
    kind, name = which
    if name in found[kind]:
      raise UsageError(
          'E-EXPORT-005', f'{step_dir}: more than one optimizer state holds '
          f'{kind} of {name} ({leaf})', 'this exporter understands one optax Adam '
          'state; export the weights only (--format=hf)')
    found[kind][name] = array
  # Frozen parameters from an init_from file are not in the checkpoint: read them from the
  # pinned file, and give them the zero moments Adam starts from (they have none).
  found['params'].update(frozen.read_excluded(step_dir, meta))
  adam = bool(found['m'] and found['v'])
  for name in found['params'] if adam else ():
    for kind in ('m', 'v'):
      found[kind].setdefault(name, np.zeros_like(found['params'][name], dtype=np.float32))
  for kind in ('params', 'm', 'v') if adam else ('params',):
    hf.check_params(found[kind], cfg)
  order = model_lib.parameter_names(cfg)
  ordered = {k: {n: found[k][n] for n in order} if k == 'params' or adam else None for k in found}
  return {'step': meta['step'], 'model_cfg': cfg, **ordered}


def _read_manifest(step_dir: Path) -> dict[str, Any]:
  if layout.parse_step(step_dir.name) is None or not (step_dir / layout.MANIFEST).is_file():
    raise UsageError(
        'E-EXPORT-003', f'{step_dir} is not a committed checkpoint (a step_<n> '
        'directory with a manifest.json)', 'pass a checkpoints/step_<n> directory')
  try:
    meta = manifest.read(step_dir)
  except CheckpointError as e:  # not JSON, not a jaxckpt manifest
    if e.code != 'E-CKPT-004':
      raise
    raise _damaged(step_dir, e.what) from None
  # The manifest against its own seal, as `jaxckpt verify` checks it, then every file against
  # the manifest; the raw store's data is checked against its checksum while `_read_arrays`
  # reads it.
  _, problems = manifest.audit(step_dir, meta, checksums=True, skip_checksum=[data_file(meta)])
  if problems:
    raise _damaged(step_dir, problems[0])
  # The step a .bin header and every export's metadata carry: its directory's, nothing else.
  step = meta.get('step')
  if isinstance(step, bool) or not isinstance(step, int) or step != layout.parse_step(
      step_dir.name):
    raise _damaged(
        step_dir, f'its manifest says step {step!r:.40}, its directory step '
        f'{layout.parse_step(step_dir.name)}')
  return meta


def _damaged(step_dir: Path, problem: str) -> CheckpointError:
  return CheckpointError('E-EXPORT-004', f'{step_dir} is damaged: {problem}',
                         'export an earlier checkpoint (`jaxckpt verify` lists the damage)')


def _model_config(step_dir: Path, meta: Mapping[str, Any], *,
                  required: bool) -> dict[str, Any] | None:
  """The manifest's model config, checked (a foreign or hand-edited one is damage, E-EXPORT-004);
  None when it records none and `required` is false."""
  config = meta.get('config')
  if config is not None and not isinstance(config, dict):
    raise _damaged(step_dir, f'its manifest config is {type(config).__name__}, not an object')
  cfg = (config or {}).get('model')
  if not cfg:
    if not required:
      return None
    raise UsageError('E-EXPORT-003', f'{step_dir}/manifest.json records no model config',
                     'pass --config=configs/<name>.py, the config it was trained with')
  problem = model_config_problem(cfg, complete=required)
  if problem:
    raise _damaged(step_dir, f'its manifest config says {problem}')
  return dict(cfg)


def _read_arrays(step_dir: Path, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
  # As numpy, whatever mesh (and storage) wrote them: no devices are needed, none are touched.
  try:
    return read_host_arrays(step_dir)
  except CheckpointError as e:
    if e.code != 'E-CKPT-003':
      raise
    raise _damaged(step_dir, e.what) from e


def export_checkpoint(step_dir: str | os.PathLike,
                      fmt: str,
                      out: str | os.PathLike,
                      *,
                      model_cfg=None,
                      optimizer: bool = False) -> Path:
  """Export a committed checkpoint as `fmt` at `out`; returns `out`.

  Args:
    step_dir: a committed `checkpoints/step_<n>` directory.
    fmt: 'safetensors' (`out` is a directory: model.safetensors, and optimizer.safetensors when
      `optimizer`), 'hf' (`out` is the GPT-2 directory) or 'bin' (`out` is the .bin file).
    out: where the export goes (`export_path` gives the conventional place). An existing one is
      replaced whole when it is an earlier export of `fmt`, and refused otherwise (`check_out`).
    model_cfg: `config.model`; defaults to the one recorded in the manifest.
    optimizer: write optimizer.safetensors next to model.safetensors (safetensors only; off by
      default, as for exports during training). Without it, the optimizer.safetensors of an
      earlier export in `out` goes with the rest of it: it would not belong to the new weights.

  Raises:
    UsageError (E-EXPORT-007): `out` is not an earlier export of `fmt`, or cannot be written.
    CheckpointError (E-EXPORT-004): the checkpoint is damaged (its manifest's seal, a file).
    CheckpointError (E-EXPORT-008): writing failed (a full disk); nothing of it was left.
  """
  _check_format(fmt, FORMATS)
  check_out(fmt, Path(out))
  ckpt = read_checkpoint(step_dir, model_cfg)
  source = {'source': str(Path(step_dir).resolve())}
  return _write(
      fmt,
      Path(out),
      ckpt['step'],
      ckpt['model_cfg'],
      ckpt['params'],
      ckpt['m'],
      ckpt['v'],
      optimizer=optimizer,
      metadata=source)


def export_bin(bin_path: str | os.PathLike,
               fmt: str,
               out: str | os.PathLike,
               model_cfg,
               *,
               optimizer: bool = False) -> Path:
  """Export a `.bin` (weights, m, v) as 'safetensors' or 'hf' at `out`; returns `out`.

  Raises:
    UsageError (E-EXPORT-001): `fmt` is not safetensors or hf.
    ResumeError (E-BIN-001): the file's size is not 8 + 12n for `model_cfg`.
  """
  check_bin_format(bin_path, fmt)
  check_out(fmt, Path(out))
  check_config_model(model_cfg, 'model_cfg')
  cfg = model_lib.as_model_config(model_cfg)
  step, params, m, v = flatbin.read_bin(bin_path, model_lib.param_shapes(cfg))
  source = {'source': str(Path(bin_path).resolve())}
  return _write(fmt, Path(out), step, cfg, params, m, v, optimizer=optimizer, metadata=source)


def check_bin_format(bin_path: str | os.PathLike, fmt: str) -> None:
  """A `.bin` converts to safetensors or hf: refuse any other `fmt` (E-EXPORT-001)."""
  if fmt == 'bin':
    raise UsageError('E-EXPORT-001', f'{bin_path} is a .bin already: a .bin converts to '
                     'safetensors or hf only', 'pass --format=safetensors or --format=hf')
  _check_format(fmt, ('safetensors', 'hf'))


def _write(fmt: str, out: Path, step: int, cfg, params, m, v, *, optimizer: bool,
           metadata: Mapping[str, str]) -> Path:
  meta = {'step': step, 'jaxckpt.model': json.dumps(cfg.to_dict(), sort_keys=True), **metadata}
  if m is None and (fmt == 'bin' or (fmt == 'safetensors' and optimizer)):
    what = 'the .bin format' if fmt == 'bin' else OPTIMIZER_FILE
    raise UsageError('E-EXPORT-005', f'the checkpoint holds no Adam moments (mu/nu) for {what}',
                     'export the weights only: --format=safetensors (without --optimizer) or hf')
  check_out(fmt, out)  # again: what was there may have changed while the arrays were read
  with target.writing(out):
    if fmt == 'hf':
      hf.write_hf_dir(out, params, cfg, metadata=meta)
    elif fmt == 'bin':
      flatbin.write_bin(out, step, params, m, v)
    else:  # the directory whole, as hf's: no file of the export it replaces is mixed in
      with atomic_dir(out) as tmp:
        safetensors_io.write_model(tmp / MODEL_FILE, params, metadata=meta)
        if optimizer:
          safetensors_io.write_optimizer(tmp / OPTIMIZER_FILE, m, v, metadata=meta)
        if (out / target.HF_DIR).is_dir():  # a run's exports/step_<n>/: its hf export stays
          target.keep_hf(out / target.HF_DIR, tmp / target.HF_DIR)
  return out


def check_out(fmt: str, out: Path) -> None:
  """Before anything is read: refuse (E-EXPORT-007) an existing `out` that is not an earlier
  export of `fmt` (`jaxckpt.export.target` has the rule), or a path under a file."""
  _check_format(fmt, FORMATS)
  target.check_out(fmt, out)


def _check_format(fmt: str, allowed: tuple[str, ...]) -> None:
  if fmt not in allowed:
    raise UsageError('E-EXPORT-001', f'unknown export format {fmt!r}',
                     f'use one of {", ".join(allowed)}')
