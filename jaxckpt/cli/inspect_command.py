"""`jaxckpt inspect CKPT [--json]`: what a checkpoint is, from its manifest alone.

    jaxckpt inspect runs/tiny/checkpoints/step_00000300          identity, knobs, every tensor
    jaxckpt inspect runs/tiny/checkpoints/step_00000300 --json   the same for scripts
    jaxckpt inspect runs/tiny                                    its newest committed checkpoint

It reads manifest.json and nothing else: no array is loaded and jax is not imported (so it answers
in well under a second for any size of model). A manifest that does not match its own checksum is
printed with a warning at its top and bottom; `jaxckpt verify` is what judges a checkpoint. One
that names a file outside its checkpoint (`../`) fails the seal even when re-sealed: it is printed
with that warning, then E-CKPT-005, exit 1. A field shown here alone that is not what jaxckpt
writes (a metric that is not a number, a knob without its source) is left out, with a warning
naming it; a field a restore relies on of the wrong type is the manifest's E-CKPT-004.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Mapping

from jaxckpt.checkpoint import abandoned, discovery, layout, manifest
from jaxckpt.cli import remote_args
from jaxckpt.cli.parser import ArgumentParser
from jaxckpt.errors import CheckpointError, UsageError
from jaxckpt.model import names

_ITEMSIZE = {
    'bool': 1, 'int8': 1, 'uint8': 1, 'int16': 2, 'uint16': 2, 'float16': 2, 'bfloat16': 2,
    'int32': 4, 'uint32': 4, 'float32': 4, 'int64': 8, 'uint64': 8, 'float64': 8, 'complex64': 8,
    'complex128': 16
}


def _number(value: Any) -> bool:
  return isinstance(value, (int, float))


def _anything(value: Any) -> bool:
  return True


def _moment(value: Any) -> bool:
  try:
    time.gmtime(value)
  except (TypeError, ValueError, OverflowError, OSError):
    return False
  return True


def _map_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
  return lambda value: isinstance(value, Mapping) and all(ok(v) for v in value.values())


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
  return lambda value: isinstance(value, list) and all(ok(v) for v in value)


def _pin(value: Any) -> bool:
  return isinstance(value, Mapping) and {'path', 'sha256'} <= set(value) and \
      _number(value.get('size'))


def _knob(value: Any) -> bool:
  return isinstance(value, Mapping) and 'value' in value and isinstance(value.get('source'), str)


def _parameter(row: Any) -> bool:
  return isinstance(row, Mapping) and isinstance(row.get('path'), str) and \
      isinstance(row.get('dtype'), str) and isinstance(row.get('shape'), list) and \
      all(type(n) is int and n >= 0 for n in row['shape'])  # pylint: disable=unidiomatic-typecheck


# The manifest's fields that only this command reads, each with what it must be to be shown: the
# manifest's own checks (`manifest.parse`) cover what a restore relies on. A field that is not
# what it says is named in `malformed` and left out of the text, never a crash of the command.
_SHOWN: dict[str, Callable[[Any], bool]] = {
    'committed_at': _moment,
    'counters': _map_of(_anything),
    'metrics': _map_of(_number),
    'init_from': _pin,
    'versions': _map_of(_anything),
    'knobs': _map_of(_knob),
    'config': _map_of(_anything),
    'sources': _map_of(lambda v: isinstance(v, str)),
    'optimizer': _map_of(_list_of(lambda v: isinstance(v, str))),
    'parameters': _list_of(_parameter),
}


def describe(step_dir: Path, m: Mapping[str, Any], raw: bytes | None = None) -> dict[str, Any]:
  """The manifest, plus: its path, each tensor's `trainable`, each parameter's flat offset, and
  with `raw` (the manifest's bytes) whether it matches its own checksum (`manifest_seal`: ok,
  absent (written before seals) or mismatch, with the problem in `warnings`). A field shown only
  here that is not what it should be is named in `malformed` (only when one is)."""
  out = {'path': str(step_dir), **m}
  if raw is not None:
    # A name outside the checkpoint fails the seal whatever its checksum says: a hostile writer
    # can re-seal what it edited.
    problem = manifest.check_seal(raw, m) or _outside(m)
    out['manifest_seal'] = 'mismatch' if problem else 'ok' if manifest.SEAL in m else 'absent'
    out['warnings'] = [problem] if problem else []
  malformed = [f for f, ok in _SHOWN.items() if m.get(f) is not None and not ok(m[f])]
  if malformed:
    out['malformed'] = malformed
  params = None if 'parameters' in malformed else m.get('parameters')
  trainable = {}
  if params is not None:
    rows, offset = [], 0
    for row in params:
      count = math.prod(row['shape'])
      rows.append({**row, 'offset': offset, 'size': count})
      trainable[row['path']] = row.get('trainable')
      offset += count
    out['parameters'] = rows
  tensors = []
  for t in m.get('tensors') or []:
    name = t['name']
    if name.startswith('params/'):
      flag = trainable.get(names.dotted_of_params_leaf(name)) if params is not None else None
    else:
      flag = False  # optimizer state and counters: not parameters, never trained
    tensors.append({**t, 'trainable': flag})
  out['tensors'] = tensors
  return out


def _outside(m: Mapping[str, Any]) -> str | None:
  """A problem line when the manifest's files table names a file outside its checkpoint."""
  for rel in m.get('files') or {}:
    parts = PurePosixPath(rel).parts
    if not parts or parts[0] == '/' or '..' in parts:
      return f'{layout.MANIFEST}: names a file outside the checkpoint: {rel!r}'
  return None


# ------------------------------------------------------------------------------- inspect
def _table(rows: list[list[str]], indent: str = '  ') -> list[str]:
  if not rows:
    return []
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return [indent + '  '.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _bytes(t: Mapping[str, Any]) -> int | None:
  size = _ITEMSIZE.get(t.get('dtype'))
  return None if size is None else size * math.prod(t['shape'])


def _shape(shape) -> str:
  return '(' + ', '.join(str(d) for d in shape) + (',)' if len(shape) == 1 else ')')


def _warning(problem: str) -> str:
  return (f'WARNING: {problem}: the manifest was changed after it was written, so what it says '
          'may be wrong (`jaxckpt verify` fails this checkpoint)')


def render(d: Mapping[str, Any]) -> str:
  """The human-readable form of `describe(...)`."""
  # A damaged manifest's warning opens and closes the output: it must not scroll out of sight.
  bad = set(d.get('malformed') or ())
  warnings = [_warning(w) for w in d.get('warnings') or []] + [
      f'WARNING: {layout.MANIFEST}: its {f} field is not what jaxckpt writes: not shown'
      for f in d.get('malformed') or ()
  ]
  d = {k: v for k, v in d.items() if k not in bad}  # what is left is shown as it is
  lines = warnings + [
      f'checkpoint  {d["path"]}', f'step        {d.get("step")}' +
      ("  (finished: the run's last step)" if d.get('finished') else '')
  ]
  if d.get('committed_at') is not None:
    lines.append('committed   ' +
                 time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(d['committed_at'])))
  if 'seed' in d:
    lines.append(f'seed        {d["seed"]}')
  where = [
      f'mesh {d["mesh"]}' if d.get('mesh') is not None else '',
      f'devices {d["devices"]}' if d.get('devices') is not None else '',
      f'processes {d["processes"]}' if d.get('processes') is not None else '',
      f'platform {d["platform"]}' if d.get('platform') is not None else ''
  ]
  if any(where):
    lines.append('placement   ' + ', '.join(w for w in where if w))
  if d.get('counters'):
    lines.append('counters    ' + ', '.join(f'{k} {v}' for k, v in d['counters'].items()))
  if d.get('metrics'):  # what --keep_best ranks by
    lines.append('metrics     ' + ', '.join(f'{k} {v:.6g}' for k, v in d['metrics'].items()))
  if d.get('init_from'):
    pin = d['init_from']
    lines.append(f'init_from   {pin["path"]} ({pin["size"]:,} bytes, sha256 {pin["sha256"]})')
  if d.get('versions'):
    lines.append('versions    ' + ', '.join(f'{k} {v}' for k, v in d['versions'].items()))

  knobs = d.get('knobs')
  if knobs is None and 'knobs' not in bad and d.get('config') is not None:  # before knob tables
    from jaxckpt.records.identity import flatten_config
    knobs = {k: {'value': v, 'source': '?'} for k, v in flatten_config(d['config']).items()}
  if knobs:
    lines += ['', f'knobs ({len(knobs)})']
    lines += _table([[k, json.dumps(v['value']), v['source']] for k, v in knobs.items()])
  if d.get('sources'):
    lines += ['', f'sources ({len(d["sources"])}, sha256)']
    lines += _table([[h[:12], p] for p, h in d['sources'].items()])
  if d.get('optimizer'):
    groups: dict[tuple[str, ...], list[str]] = {}
    for param, states in d['optimizer'].items():
      groups.setdefault(tuple(states), []).append(param)
    lines += ['', 'optimizer state']
    lines += _table([[
        ', '.join(states) or '(none)',
        params[0] if len(params) == 1 else f'{len(params)} parameters'
    ] for states, params in groups.items()])

  if d.get('parameters') is not None:
    total = sum(r['size'] for r in d['parameters'])
    lines += [
        '', f'parameters ({len(d["parameters"])}, {total:,} elements; offset = element '
        'offset in the flat .bin export)'
    ]
    lines += _table([['offset', 'name', 'dtype', 'shape', 'spec', 'trainable']] + [[
        f'{r["offset"]:,}', r['path'], r['dtype'],
        _shape(r['shape']),
        str(r.get('spec')), {True: 'yes', False: 'frozen'}.get(r.get('trainable'), '?')
    ] for r in d['parameters']])
  tensors = d.get('tensors') or []
  nbytes = sum(_bytes(t) or 0 for t in tensors)
  lines += ['', f'tensors ({len(tensors)}, {nbytes:,} bytes)']
  lines += _table([['name', 'dtype', 'shape', 'spec', 'trainable']] + [
      [
          t['name'],
          t['dtype'],
          _shape(t['shape']),
          str(t.get('spec')),
          '-' if not t['name'].startswith('params/') else  # optimizer state, counters
          {True: 'yes', False: 'frozen'}.get(t['trainable'], '?')
      ] for t in tensors
  ])
  files = d.get('files') or {}
  lines += [
      '', f'files ({len(files)}, {sum(f["size"] for f in files.values()):,} bytes; '
      '`jaxckpt verify` checks them)'
  ]
  if warnings:
    lines += ['', *warnings]
  return '\n'.join(lines)


def _describe_remote(url: str) -> dict[str, Any]:
  """`describe` of a remote checkpoint, from its manifest and object listing alone."""
  from jaxckpt.checkpoint.remote import objects
  store = remote_args.open_run(url)
  step = remote_args.split(url)[1]
  step = remote_args.newest(store) if step is None else step
  raw, m, _, problems = objects.inspect(store, step)
  if m is None:
    raise UsageError('E-CKPT-010', f'{url}: {problems[0]}', 'pass a committed remote checkpoint')
  d = describe(store.join(objects.step_prefix(step)), m, raw)  # type: ignore[arg-type]
  d['warnings'] = d.get('warnings', []) + problems
  return d


def _local(arg: str) -> Path:
  """The checkpoint directory `arg` names: itself, or for a run (or its checkpoints) directory
  its newest committed checkpoint, said on stderr (stdout stays the description alone)."""
  path = Path(arg)
  if path.is_dir() and not (path / layout.MANIFEST).is_file() and \
      layout.parse_step(path.name) is None:
    for root in (path / 'checkpoints', path):
      committed = layout.committed_steps(root)
      if committed:  # not one the run abandoned when it went back to an older one
        step_dir = committed[max(
            set(committed) - abandoned.steps(root, committed), default=max(committed))]
        print(
            f'jaxckpt: {path} holds checkpoints: inspecting the newest committed one, '
            f'{step_dir}',
            file=sys.stderr,
            flush=True)
        return step_dir
  return discovery.checkpoint_dir(path)  # or the error that says what `path` is instead


def main(argv: list[str]) -> int:
  """`jaxckpt inspect CKPT [--json]`."""
  parser = ArgumentParser(
      prog='jaxckpt inspect',
      description='Print what a checkpoint is, '
      'from its manifest.json alone (no array is loaded).')
  parser.add_argument(
      'checkpoint',
      help='a checkpoints/step_<n> directory, a run directory (its newest committed '
      'checkpoint), or the URL of a remote run (its newest intact checkpoint) or checkpoint')
  parser.add_argument('--json', action='store_true', help='one JSON object, for scripts')
  args = parser.parse_args(argv)
  if remote_args.is_url(args.checkpoint):
    d = _describe_remote(args.checkpoint)
  else:
    step_dir = _local(args.checkpoint)
    raw, m = discovery.read_manifest_bytes(step_dir)
    d = describe(step_dir, m, raw)
  # One write: output that fits the pipe is in it before a reader such as `head` can leave.
  sys.stdout.write((json.dumps(d, indent=1) if args.json else render(d)) + '\n')
  # Exit 0 even with a seal warning: inspect shows what a manifest says; verify judges it. A
  # manifest pointing outside its checkpoint is no checkpoint: loading it would follow the path.
  outside = _outside(d)
  if outside:
    raise CheckpointError('E-CKPT-005', f'{d["path"]}: {outside}',
                          'the manifest is corrupt or hostile; do not load this checkpoint')
  return 0
