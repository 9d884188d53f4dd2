"""What each process holds of the checkpoints in its directory, for a restore from the peer tier
(`peers`): its committed checkpoints and their parts (`held`), the files of one that are intact
(`intact`), and process 0's reading of what the processes posted (`view`, `names`), checked,
since a post is another process's word: whose commit of a step is whole (`conflict`), and a job
whose processes hold checkpoints none of which is whole (`stranded`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from . import abandoned, layout, manifest, multihost, shardtable
from .errors import CheckpointError
from .formats import SAFETENSORS, data_file

_log = logging.getLogger(__name__)

META = (layout.RUN_STATE, shardtable.SHARDS, layout.MANIFEST)  # a checkpoint's own files besides
# its state (shards.json where the manifest lists it), sent in this order: the manifest last


def parts(m: Mapping[str, Any]) -> list[str]:
  """The state files of manifest `m`: one per process that wrote it, or its single one."""
  single = data_file(m) if m.get('storage') == SAFETENSORS else None
  return multihost.state_files(m) or ([single] if single else [])


def own_files(m: Mapping[str, Any]) -> list[str]:
  """The files of manifest `m` that are no process's part: sent whole to a process without."""
  return [name for name in META[:-1] if name in m['files']]


def held(ckpt_dir: Path) -> dict[str, dict[str, Any]]:
  """{step: {'seal', 'files': {state file: size}}} of the committed checkpoints here whose
  manifest is sound (sizes only: the CRCs are checked for the one chosen), but for those the run
  abandoned when it went back to an older one (`abandoned`)."""
  out = {}
  committed = layout.committed_steps(ckpt_dir)
  left = abandoned.steps(ckpt_dir, committed)
  for step, path in committed.items():
    if step in left:
      continue
    try:
      raw = (path / layout.MANIFEST).read_bytes()
      m = manifest.parse(path, raw)
      if manifest.check_seal(raw, m):  # a run state missing here is sent from another host
        continue
      files = {}
      for rel in parts(m):
        member = layout.safe_member(path, rel)  # names from a manifest are checked
        if member.is_file() and member.stat().st_size == m['files'][rel]['size']:
          files[rel] = m['files'][rel]['size']
    except (OSError, CheckpointError, KeyError, TypeError):
      continue
    out[str(step)] = {'seal': manifest.seal_of(raw), 'files': files}
  return out


def tidy(ckpt_dir: Path) -> list[Path]:
  """Removes the files an earlier peer restore, cut short, left half-received in committed step
  directories (a step directory it never committed is the manager's debris), and the subsets
  of parts it sent for that restore alone (this one sends what it needs); returns them."""
  left = [
      p for d in layout.committed_steps(ckpt_dir).values()
      for suffix in (layout.PEER_TMP, layout.FETCH_TMP, layout.SUBSET)
      for p in d.rglob(f'*{suffix}')
  ]
  for path in left:
    path.unlink(missing_ok=True)
  return left


def view(k: int, raw: str) -> dict[str, Any]:
  """Process `k`'s post of what it holds ({step: {'seal', 'files': {name: size}}}), checked:
  an entry that is not that shape is left out, with a warning (its checkpoints then count as
  not held there)."""
  try:
    view = json.loads(raw)
  except (TypeError, ValueError, RecursionError):
    view = None
  out = {}
  for key, v in view.items() if isinstance(view, dict) else ():
    files = v.get('files') if isinstance(v, dict) else None
    if (isinstance(files, dict) and key.isascii() and key.isdigit() and len(key) <= 19
        and isinstance(v.get('seal'), str)
        and all(isinstance(n, str) and type(b) is int and b >= 0 for n, b in files.items())):
      out[str(int(key))] = {'seal': v['seal'], 'files': files}
  if not isinstance(view, dict) or len(out) != len(view):
    _log.warning('process %d posted what it holds as %r: only %s counted', k,
                 str(raw)[:120], sorted(out, key=int))
  return out


def names(raw: str) -> list[str]:
  """A process's post of the files it holds intact (a list of names); [] when it is not one."""
  try:
    names = json.loads(raw)
  except (TypeError, ValueError, RecursionError):
    return []
  return names if isinstance(names, list) and all(isinstance(n, str) for n in names) else []


def stranded(views: list[dict]) -> dict[str, str] | None:
  """Process 0, when nothing is whole between the processes and no remote checkpoint fills
  in: {'stranded': what} when some process holds a committed checkpoint all the same (a fresh
  start would train over it); None when none does (a fresh start)."""
  holders: dict[int, list[int]] = {}
  for k, view in enumerate(views):
    for key in view:
      holders.setdefault(int(key), []).append(k)
  if not holders:
    return None
  newest = max(holders)
  return {
      'stranded': f'the {len(views)} processes hold committed checkpoints (the newest, step '
                  f'{newest}, on process(es) {holders[newest]}) but none whole and intact '
                  'between them, and no remote checkpoint fills in the parts no process holds'
  }


def conflict(views: list[dict], key: str, seal: str, parts: list[str]) -> dict[str, Any]:
  """{'conflict': [[process, seal], ...]} when other commits of step `key` are whole between
  the processes too (another run's workdir): which one to take is not for the job to guess.
  A host's part of another commit that is not whole (a replay cut short) is replaced."""
  other: dict[str, set[str]] = {}
  for view in views:
    if view.get(key, {}).get('seal') not in (None, seal):
      other.setdefault(view[key]['seal'], set()).update(view[key]['files'])
  whole = [[k, v[key]['seal']]
           for k, v in enumerate(views)
           if v.get(key, {}).get('seal') in other and set(parts) <= other[v[key]['seal']]]
  return {'conflict': whole} if whole else {}


def intact(ckpt_dir: Path, step: int, seal: str) -> list[str]:
  """The state files of checkpoint (`step`, `seal`) here that match its manifest, CRC included,
  and its run state when that does too (a process without it is sent it)."""
  path = ckpt_dir / layout.step_dirname(step)
  try:
    raw = (path / layout.MANIFEST).read_bytes()
    if manifest.seal_of(raw) != seal:
      return []
    m = manifest.parse(path, raw)
  except (OSError, CheckpointError):
    return []
  files = parts(m) + own_files(m)
  bad = manifest.file_problems(path, {**m, 'files': {r: m['files'][r] for r in files}})
  return [r for r in files if not any(p.startswith(f'{r}:') for p in bad)]


__all__ = [
    'META', 'conflict', 'held', 'intact', 'names', 'own_files', 'parts', 'stranded', 'tidy', 'view'
]
