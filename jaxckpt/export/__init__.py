"""jaxckpt.export: the model outside jaxckpt, as plain files other tools read.

    from jaxckpt.export import flatbin, hf, offline, safetensors_io

- `safetensors_io`: flat `model.safetensors` (dotted names, f32) and `optimizer.safetensors`
  (`<param>/m`, `<param>/v`).
- `hf`: a Hugging Face GPT-2 directory (`config.json` + `model.safetensors`) that
  `transformers.GPT2LMHeadModel.from_pretrained` loads.
- `flatbin`: the raw ANDREA `step_NNNNNN.bin` (header, weights, Adam m, Adam v; 8 + 12n bytes).
- `offline`: any of the above from a committed checkpoint directory or a `.bin`, without
  building the model (`jaxckpt export`).
- `target`: what an existing `--out` of `jaxckpt export` may be (an earlier export of the same
  format, nothing else), and its write errors as one line.

Every writer is a pure function of host numpy arrays and publishes atomically: it writes under a
temporary sibling name, fsyncs, renames into place and fsyncs the parent, so a crash never leaves
a half-written export under its final name. The helpers here are the two shapes of that dance.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

# One set of durable-write primitives for checkpoints and exports alike (re-exported here).
from jaxckpt.checkpoint.atomic import (TMP_MARK, atomic_file, fsync_dir, publish_dir,
                                       temporary_sibling)

__all__ = ['TMP_MARK', 'atomic_dir', 'atomic_file', 'temporary_sibling']


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
  """Yields a fresh temporary directory next to `path`; on success it becomes `path`, durably.

  The caller fills the yielded directory (fsyncing its files, e.g. with `atomic_file`). An
  existing `path` is swapped out in one step where the OS can (Linux `renameat2`
  RENAME_EXCHANGE), so readers see the old export or the new one, never neither; elsewhere the
  old one is renamed aside first. On error the temporary directory is removed.
  """
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = temporary_sibling(path)
  tmp.mkdir()
  try:
    yield tmp
    fsync_dir(tmp)
    publish_dir(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  fsync_dir(path.parent)
