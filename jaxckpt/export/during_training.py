"""Exports during training: written from the host copy a checkpoint staged, after it commits.

    exporter = Exporter(workdir / 'exports', config, runlog)  # removes debris of a crash
    mgr = CheckpointManager(ckpt_dir, options, on_commit=exporter.on_commit)

When a checkpoint commits, the manager still holds the state in host memory (`CommitInfo.staged`),
so an export costs no second device->host copy. It runs in the `on_commit` callback, on the
manager's background thread: the loop does not wait for it unless the next save comes first (that
save waits for it, which also keeps the staged buffers unchanged while the export reads them). An
export that fails raises `E-EXPORT-006` there, and the manager re-raises it in the training
thread at the next save, `wait_until_finished` or `close`, like a failed checkpoint write.

Layout under `WORKDIR/exports/` (`offline.export_path`):

    step_<8 digits>/model.safetensors       flat, dotted names (format `safetensors`)
    step_<8 digits>/optimizer.safetensors   `<name>/m`, `<name>/v` (with `export.optimizer`)
    step_<8 digits>/hf/                     config.json + model.safetensors (format `hf`)
    step_NNNNNN.bin                         raw ANDREA: header, weights, Adam m, v (format `bin`)

The step directory is filled under a temporary name and renamed into place whole, and the `.bin`
is written under a temporary name and renamed, so nothing half-written ever has a final name.
Retention keeps the newest `export.keep` exported steps and deletes older ones only after the new
export is complete. Temporary names (`*.tmp-*`) found at start are a crash's debris and are removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from absl import logging

from jaxckpt.checkpoint import CommitInfo, atomic, layout
from jaxckpt.errors import CheckpointError, ConfigError
from jaxckpt.checkpoint.atomic import ASIDE_MARK
from jaxckpt.export import TMP_MARK, atomic_dir, flatbin, hf, safetensors_io, temporary_sibling
from jaxckpt.export.offline import FORMATS, MODEL_FILE, OPTIMIZER_FILE, export_path
from jaxckpt.model import gpt as model_lib
from jaxckpt.model import names
from jaxckpt.records.workdir import CHECKPOINTS

_BIN_RE = re.compile(r'^step_(\d{6,})\.bin$')


@dataclasses.dataclass(frozen=True)
class ExportOptions:
  """When and what to export during training (see `configs/default.py`, `config.export`)."""
  every: int = 1000  # steps; 0 turns exports off
  formats: tuple[str, ...] = ('safetensors', 'hf')  # any of safetensors, hf, bin
  keep: int = 2  # newest exported steps kept (0: all)
  optimizer: bool = False  # optimizer.safetensors beside model.safetensors


def parse_formats(formats: str | tuple[str, ...]) -> tuple[str, ...]:
  """'safetensors,hf' -> ('safetensors', 'hf'), in FORMATS order, refusing unknown names."""
  names = formats.split(',') if isinstance(formats, str) else list(formats)
  names = [n.strip() for n in names if n.strip()]
  unknown = sorted(set(names) - set(FORMATS))
  if unknown:
    raise ConfigError(
        'E-CONFIG-009', f'export.formats={",".join(names)!r}: unknown format(s) '
        f'{", ".join(unknown)}', f'use a comma list of {", ".join(FORMATS)} '
        '(--export_formats=safetensors,hf)')
  return tuple(f for f in FORMATS if f in names)


def options_from_config(config) -> ExportOptions:
  """`config.export` as `ExportOptions`, validated with errors that name the field."""
  e = config.export
  for field in ('every', 'keep'):
    if e[field] < 0:
      raise ConfigError('E-CONFIG-009', f'export.{field}={e[field]} is negative',
                        f'use 0 to turn it off (--export_{field}=0)')
  formats = parse_formats(e.formats)
  if e.every and not formats:
    raise ConfigError(
        'E-CONFIG-009', 'export.every is set but export.formats is empty',
        'name formats with --export_formats=safetensors,hf,bin, or set '
        '--export_every=0')
  return ExportOptions(every=e.every, formats=formats, keep=e.keep, optimizer=bool(e.optimizer))


def export_due(step: int, previous_step: int | None, every: int, last_step: int) -> bool:
  """Whether the checkpoint of `step`, just committed, is exported.

  Exported: the last step of the run, and the first checkpoint at or after each multiple of
  `every` (with `checkpoint.every` dividing `every`: exactly the multiples; with time-based or
  misaligned checkpoints: the first one past each multiple). `previous_step` is the step of the
  previous checkpoint this process committed; for the first one (None) only a multiple counts.
  """
  if every <= 0:
    return False
  if step == last_step:
    return True
  if previous_step is None or previous_step >= step:
    return step % every == 0
  return step // every > previous_step // every


def split_staged(staged: Mapping[str, np.ndarray],
                 model_cfg) -> tuple[dict[str, np.ndarray], dict | None, dict | None]:
  """(params, m, v) as {dotted name: array} in canonical order from checkpoint leaf names.

  m and v are None when the state holds no Adam moments.
  """
  found: dict[str, dict[str, np.ndarray]] = {'params': {}, 'm': {}, 'v': {}}
  for leaf, x in staged.items():
    which = names.param_of_leaf(leaf)
    if which is not None:
      found[which[0]][which[1]] = x
  order = model_lib.parameter_names(model_cfg)
  hf.check_params(found['params'], model_cfg)
  params = {n: found['params'][n] for n in order}
  if not (found['m'] and found['v']):
    return params, None, None
  return params, *({n: found[k][n] for n in order} for k in ('m', 'v'))


def write_exports(directory: Path,
                  step: int,
                  formats: tuple[str, ...],
                  params,
                  m,
                  v,
                  model_cfg,
                  *,
                  optimizer: bool = False,
                  checkpoint: str | os.PathLike | None = None) -> list[Path]:
  """Write `step`'s exports under `directory`, each published atomically; returns their paths.

  `checkpoint` (the committed checkpoint of `step`; by default `checkpoints/step_<n>` beside
  `directory`) is named in the error's `jaxckpt export` command that writes the export later.

  Raises:
    CheckpointError (E-EXPORT-006): a format could not be written; nothing of it was published.
  """
  cfg = model_lib.as_model_config(model_cfg)
  meta = {'step': step, 'jaxckpt.model': json.dumps(cfg.to_dict(), sort_keys=True)}
  # What is being written when it fails (`doing`), and the formats a failure loses (`failing`):
  # safetensors and hf share one temporary directory, discarded whole when either fails.
  written, failing, doing, target = [], list(formats[:1]), formats[:1], directory
  try:
    directory.mkdir(parents=True, exist_ok=True)
    in_step_dir = [f for f in formats if f != 'bin']
    if in_step_dir:  # safetensors and hf share exports/step_<n>/: one directory, one rename
      step_dir = export_path(directory, step, 'safetensors')
      with atomic_dir(step_dir) as tmp:
        failing = in_step_dir
        for fmt in in_step_dir:
          doing, target = [fmt], export_path(directory, step, fmt)
          if fmt == 'safetensors':
            safetensors_io.write_model(tmp / MODEL_FILE, params, metadata=meta)
            if optimizer and m is not None:
              safetensors_io.write_optimizer(tmp / OPTIMIZER_FILE, m, v, metadata=meta)
          else:
            hf.write_hf_dir(tmp / target.relative_to(step_dir), params, cfg, metadata=meta)
        doing, target = in_step_dir, step_dir  # the rename of the whole directory
      written.append(step_dir)
    if 'bin' in formats:
      failing, doing, target = ['bin'], ['bin'], export_path(directory, step, 'bin')
      if m is None:
        raise ValueError('the state holds no Adam moments (mu/nu) for the .bin format')
      flatbin.write_bin(target, step, params, m, v)
      written.append(target)
  except Exception as e:
    checkpoint = Path(checkpoint) if checkpoint is not None else (directory.parent / CHECKPOINTS /
                                                                  layout.step_dirname(step))
    later = ' && '.join(
        f'jaxckpt export {checkpoint} --format={f} --out={export_path(directory, step, f)}' +
        (' --optimizer' if f == 'safetensors' and optimizer else '') for f in failing)
    lost = f' (with {",".join(f for f in failing if f not in doing)}: one directory)' if set(
        failing) - set(doing) else ''
    raise CheckpointError(
        'E-EXPORT-006', f'exporting step {step} as {",".join(doing)}{lost} to {target} failed: '
        f'{type(e).__name__}: {e}', f'checkpoint step {step} is committed and intact and no '
        'partial export has a final name; the next checkpoint is exported in its place; fix '
        'the cause (disk space, permissions) and run the same command to continue, or turn '
        f'exports off with --export_every=0 (`{later}` writes this one later)') from e
  return written


def exported_steps(directory: Path) -> dict[int, list[Path]]:
  """{step: [its export paths]} of the complete exports under `directory`, ascending."""
  found: dict[int, list[Path]] = {}
  for name in _listdir(directory):
    path = directory / name
    step = layout.parse_step(name) if path.is_dir() else None
    if step is None:
      match = _BIN_RE.match(name)
      step = int(match.group(1)) if match and path.is_file() else None
    if step is not None:
      found.setdefault(step, []).append(path)
  return dict(sorted(found.items()))


def apply_retention(directory: Path, keep: int, newest: int) -> list[int]:
  """Delete all but the `keep` newest exported steps (and `newest`, just written); 0 keeps all.

  Called only after the export of `newest` is complete. Each victim is renamed to a temporary
  name first, so a deletion cut short is debris, never a half-export under a final name.
  """
  if keep <= 0:
    return []
  found = exported_steps(directory)
  kept = set(list(found)[-keep:]) | {newest}
  doomed = [s for s in found if s not in kept]
  for step in doomed:
    for path in found[step]:
      gone = temporary_sibling(path)
      os.rename(path, gone)
      _remove(gone)
  if doomed:
    atomic.fsync_dir(directory)
  return doomed


def remove_debris(directory: Path) -> list[Path]:
  """Remove `*.tmp-*` left by an export or deletion a crash cut short, and `*.aside-*` (an
  earlier export a replace set aside: exports are written again); returns what went."""
  if not directory.is_dir():
    return []
  parents = [directory] + [
      directory / n
      for n in _listdir(directory)
      if layout.parse_step(n) is not None and (directory / n).is_dir()
  ]
  removed = [
      parent / n for parent in parents for n in _listdir(parent) if TMP_MARK in n or ASIDE_MARK in n
  ]
  for path in removed:
    _remove(path)
  if removed:
    atomic.fsync_dir(directory)
  return removed


def _listdir(directory: Path) -> list[str]:
  try:
    return sorted(os.listdir(directory))
  except FileNotFoundError:
    return []


def _remove(path: Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path, ignore_errors=True)
  else:
    path.unlink(missing_ok=True)


def _size(path: Path) -> int:
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file())


class Exporter:
  """Exports committed checkpoints of one run by `config.export`; use `on_commit` as the hook.

  Args:
    directory: the run's `exports/` directory; its debris is removed now.
    config: the run's config (`export`, `model`, `train.steps`).
    runlog: where `export`, `export_skipped`, `export_failed`, `exports_off` and `cleaned`
      events go (optional).
    processes: of the run. Across processes no host holds a whole checkpoint in memory (each
      stages its own shards), so none exports: that is said once, here, with what to do.
  """

  def __init__(self,
               directory: str | os.PathLike,
               config,
               runlog: Any = None,
               *,
               processes: int = 1):
    self.directory = Path(directory)
    self.options = options_from_config(config)
    self.model_cfg = config.model
    self.last_step = config.train.steps
    self.processes = processes
    self._runlog = runlog
    self._previous: int | None = None
    self.failed: int | None = None  # the first step whose export failed, until one succeeds
    self.removed_debris = remove_debris(self.directory)
    if self.removed_debris:
      self._event('cleaned', what='exports', paths=[str(p) for p in self.removed_debris])
      logging.info('removed %d incomplete export(s)', len(self.removed_debris))
    if processes > 1 and self.options.every:
      reason = (f'across {processes} processes each one holds only its own shards of a '
                'checkpoint')
      self._event('exports_off', processes=processes, every=self.options.every, reason=reason)
      logging.info(
          'exports during training are off (export.every=%d): %s; export a checkpoint after '
          'the fact with `jaxckpt export %s/checkpoints/step_<n> --format=%s --out=DIR`',
          self.options.every, reason, self.directory.parent, self.options.formats[0])

  def _event(self, name: str, **fields: Any) -> None:
    if self._runlog is not None:
      self._runlog.event(name, **fields)

  def on_commit(self, info: CommitInfo, *, stopping: bool = False) -> dict[str, Any] | None:
    """Export `info.step` if it is due; returns the `export` event's fields, or None.

    `stopping`: a stop signal is pending; the grace period is spent on the checkpoint, and the
    export is skipped (recorded; `jaxckpt export` can write it from the checkpoint).
    """
    previous, self._previous = self._previous, info.step
    if self.processes > 1:
      return None  # said at the start
    # A failed export is retried at the next commit, due or not: its state is the newest.
    if not export_due(info.step, previous, self.options.every,
                      self.last_step) and self.failed is None:
      return None
    if stopping:
      self._event('export_skipped', step=info.step, reason='stopping')
      logging.info('export of step %d skipped: the run is stopping', info.step)
      return None
    return self.export(info.step, info.staged, checkpoint=getattr(info, 'path', None))

  def export(self,
             step: int,
             staged: Mapping[str, np.ndarray],
             *,
             checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """Write `step`'s exports from `staged` (checkpoint leaf names), then apply retention.

    A failure is remembered (`failed`): the next commit is exported in its place."""
    t0 = time.perf_counter()
    try:
      params, m, v = split_staged(staged, self.model_cfg)
      paths = write_exports(
          self.directory,
          step,
          self.options.formats,
          params,
          m,
          v,
          self.model_cfg,
          optimizer=self.options.optimizer,
          checkpoint=checkpoint)
    except Exception as e:
      if self.failed is None or self.failed > step:
        self.failed = step
      self._event('export_failed', step=step, error=str(e))
      raise
    retry_of, self.failed = self.failed, None
    deleted = apply_retention(self.directory, self.options.keep, step)
    fields = {
        'step': step, 'formats': list(self.options.formats),
        'seconds': round(time.perf_counter() - t0, 6), 'bytes': sum(_size(p) for p in paths),
        'paths': [str(p) for p in paths], 'deleted': deleted,
        **({'retry_of': retry_of} if retry_of is not None else {})
    }
    self._event('export', **fields)
    logging.info('exported step %d (%s, %s bytes) in %.2fs', step, ','.join(fields['formats']),
                 f'{fields["bytes"]:,}', fields['seconds'])
    return fields
