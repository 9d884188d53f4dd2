"""Where `jaxckpt export` writes (`--out`): what an existing one may be, and what writing meets.

    check_out('hf', Path('out/tiny_hf'))     # before anything is read: refuses what is not ours
    with writing(Path('out/tiny_hf')):       # makes missing parents; OSError -> one line
      hf.write_hf_dir(...)

An export replaces an earlier export of its own format and nothing else. An existing `--out` is
taken as one when it holds only what that format writes:

- bin: a file whose size is 8 + 12n bytes for the n in its header (a `.bin` of any model);
- hf: an empty directory, or one holding `config.json` and, beside it, at most
  `model.safetensors`;
- safetensors: an empty directory, or one holding only `model.safetensors`,
  `optimizer.safetensors`, the temporary names (`<name>.tmp-<nonce>`) a crash left of those two,
  and an `hf/` directory that is itself an hf export: the layout of a run's `exports/step_<n>/`.

Anything else (a run's workdir, a checkpoint, `exports/` itself, a file of the user's) is refused
with E-EXPORT-007 before a byte is read or written. A directory export is built whole under a
temporary sibling name and swapped in (`jaxckpt.export.atomic_dir`); a safetensors export keeps
the `hf/` export of the directory it replaces (hard links, or copies where the filesystem has
none), and drops everything else of it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from jaxckpt.checkpoint.atomic import TMP_MARK, fsync_dir
from jaxckpt.errors import CheckpointError, UsageError
from jaxckpt.export import flatbin

HF_DIR = 'hf'
_HF_FILES = ('config.json', 'model.safetensors')
_SAFETENSORS_FILES = ('model.safetensors', 'optimizer.safetensors')
_DEBRIS = re.compile(r'^(?:model|optimizer)\.safetensors' + re.escape(TMP_MARK) + r'[0-9a-f]{12}$')
_AN = {'hf': 'an hf', 'safetensors': 'a safetensors', 'bin': 'a bin'}
# What a path, not the disk, is the cause of: the user's to fix (exit 2).
_PATH_ERRNOS = frozenset((errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
                          errno.ENAMETOOLONG, errno.ELOOP, errno.ENOENT, errno.EEXIST))


def check_out(fmt: str, out: Path) -> None:
  """Refuse (E-EXPORT-007, exit 2) an `out` an export of `fmt` may not replace; touches nothing.

  `fmt` is one of safetensors, hf, bin (checked by the caller)."""
  try:
    problem = _problem(fmt, out)
  except OSError as e:
    raise write_error(out, e) from None
  if problem:
    what, fix = problem
    raise UsageError('E-EXPORT-007', what, fix)


def _problem(fmt: str, out: Path) -> tuple[str, str] | None:
  for parent in out.parents:  # a file where a directory of the path must go
    if parent.exists() and not parent.is_dir():
      return f'{parent} is a file, so {out} cannot be made', 'name a path under a directory'
  if not out.exists() and not out.is_symlink():
    return None
  if fmt == 'bin':
    if out.is_dir():
      return (f'{out} is a directory; a bin export is one file',
              f'name the file to write, e.g. {out / "step_NNNNNN.bin"}')
    if not is_bin(out):
      return (f'{out} exists and is not a .bin export (8 + 12n bytes for the n in its header); '
              'an export replaces only an earlier export',
              'name a new file, or an earlier .bin export to replace')
    return None
  if not out.is_dir():
    return (f'{out} is a file; {_AN[fmt]} export is a directory',
            'name a new directory, or an earlier export of this format to replace')
  why = not_an_export(fmt, out)
  if why:
    return (f'{why}; an export replaces only an earlier {fmt} export, never other files',
            f'name a new or empty directory, or an earlier {fmt} export to replace')
  return None


def is_bin(path: Path) -> bool:
  """Whether `path` is a file laid out as a `.bin` export: 8 + 12n bytes, n in its header."""
  if not path.is_file():
    return False
  size = path.stat().st_size
  if size < flatbin.HEADER.size:
    return False
  with open(path, 'rb') as f:
    _, n = flatbin.HEADER.unpack(f.read(flatbin.HEADER.size))
  return n >= 0 and size == flatbin.expected_size(n)


def not_an_export(fmt: str, out: Path) -> str | None:
  """Why the directory `out` is not an earlier export of `fmt` (hf or safetensors); None when it
  is one (or is empty)."""
  entries = sorted(os.listdir(out))
  if fmt == 'hf':
    foreign = [e for e in entries if e not in _HF_FILES or not (out / e).is_file()]
    if not foreign and entries and _HF_FILES[0] not in entries:
      return f'{out} holds {_HF_FILES[1]} but no {_HF_FILES[0]}: not an hf export'
  else:
    foreign = [
        e for e in entries
        if not ((e in _SAFETENSORS_FILES or _DEBRIS.match(e)) and (out / e).is_file())
        and not (e == HF_DIR and (out / e).is_dir() and not (out / e).is_symlink()
                 and not_an_export('hf', out / e) is None)
    ]
  if not foreign:
    return None
  shown = ', '.join(e if e.isprintable() else repr(e) for e in foreign[:3])
  more = f' and {len(foreign) - 3} more' if len(foreign) > 3 else ''
  return f'{out} holds {shown}{more}, which {_AN[fmt]} export does not write'


def keep_hf(old: Path, new: Path) -> None:
  """The hf export `old` again at `new` (inside a directory about to be published): hard links
  where the filesystem has them, fsynced copies where it has not."""

  def link(src: str, dst: str) -> None:
    try:
      os.link(src, dst)
    except OSError:
      shutil.copyfile(src, dst)
      fd = os.open(dst, os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)

  shutil.copytree(old, new, copy_function=link)
  fsync_dir(new)


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
  """Makes `out`'s missing parent directories, then runs the write: an OSError (no permission, a
  read-only filesystem, a full disk) becomes one line naming `out` (`write_error`), and the
  directories made here are removed again. The writers leave nothing under a temporary or final
  name when they fail."""
  made: list[Path] = []
  try:
    for parent in reversed(out.parents):
      if not parent.is_dir():
        parent.mkdir()
        made.append(parent)
    yield
  except OSError as e:
    for parent in reversed(made):
      with contextlib.suppress(OSError):
        parent.rmdir()
    raise write_error(out, e) from None


def write_error(out: Path, e: OSError) -> CheckpointError:
  """E-EXPORT-007 (exit 2) when the path is the cause (permissions, a read-only filesystem), else
  E-EXPORT-008 (exit 1: a full or failing disk)."""
  why = e.strerror or str(e)
  if e.errno in _PATH_ERRNOS:
    fix = ('the filesystem is read-only: name an --out on a writable one' if e.errno == errno.EROFS
           else 'name an --out in a directory you can write, or fix its permissions')
    return UsageError('E-EXPORT-007', f'{out} cannot be written: {why}', fix)
  return CheckpointError(
      'E-EXPORT-008', f'writing {out} failed: {why} (nothing of it was left)',
      'free space or fix the disk and export again, or name an --out on '
      'another disk')
