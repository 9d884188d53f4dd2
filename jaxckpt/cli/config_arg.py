"""A command's `--config=configs/<name>.py[:arg]`, loaded as `python -m jaxckpt.main --config`
loads one (`jaxckpt export`, `jaxckpt evaluate`): a file that is missing, a directory, or does not
load (a syntax error, no `get_config`) is E-USAGE-001, one line."""

from __future__ import annotations

import sys
from pathlib import Path

from jaxckpt.errors import UsageError
from jaxckpt.records.provenance import load_config_file


def load(path: str):
  """The config of the file `path` names (after an optional `:arg`)."""
  file = Path(path.rsplit(':', 1)[0] if ':' in Path(path).name else path)
  if not file.is_file():
    raise UsageError('E-USAGE-001',
                     f'--config={path}: ' + ('is a directory' if file.is_dir() else 'no such file'),
                     'pass a configs/<name>.py file')
  # Config files import their siblings as `configs.default`: make their package's parent
  # importable even when `jaxckpt` runs as a console script from elsewhere.
  root = str(file.resolve().parent.parent)
  if root not in sys.path:
    sys.path.append(root)
  try:
    return load_config_file(path)
  except Exception as e:  # whatever the file's own code raises: its message, on one line
    why = ' '.join(f'{type(e).__name__}: {e}'.split())
    raise UsageError('E-USAGE-001', f'--config={path} could not be loaded: {why}',
                     'pass a configs/<name>.py file') from None
