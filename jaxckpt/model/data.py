"""Tokens, splits and batches.

The tokenizer is bytes (vocab 256). A corpus is the embedded default text, the user's own text
files, or pre-tokenized little-endian uint16 `.bin` files (nanoGPT's format). The last
`data.heldout_fraction` of each source's tokens is its held-out split.

Data comes from one or more named sources (`data.sources`: name -> its files, in order: a tuple
of paths, one path, a comma-separated string of paths, or a glob such as 'shards/train_*.bin',
expanded in sorted order). A source's files are one token sequence, read where they lie: files
are memory-mapped (read-only; `.bin` shards as uint16, text as bytes, widened to uint16 where a
batch is cut), so a process holds only the pages its batches touch, however large the files.
With several sources, the bandit (`jaxckpt.model.bandit`) picks the source of each step. A
training batch is a pure function of (seed, step, source) and of the source's tokens, not of how
they are split into files: resuming at step k needs no iterator state beyond k and the bandit's
state, and every process of a multi-host run can build the same global batch.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.resources
import mmap
from pathlib import Path
from typing import Sequence

import numpy as np

from jaxckpt.errors import ConfigError

EMBEDDED = 'embedded'
# Sources up to this many tokens are checked against model.vocab_size whole at the start; larger
# ones are not read whole (that is the point of mapping them): each batch is checked instead.
SCAN_TOKENS = 1 << 28
_SCAN_CHUNK = 1 << 24  # tokens read per look while scanning (32 MiB), by read(), not the map
_FIX = f'set data.sources.NAME to text files, uint16 .bin files, a glob of them, or {EMBEDDED!r}'


def embedded_corpus() -> bytes:
  return importlib.resources.files('jaxckpt').joinpath('assets/corpus.txt').read_bytes()


def source_paths(value) -> list[str]:
  """The files of one `data.sources` entry, in order: a tuple/list of paths, one path, a
  comma-separated string, and globs (sorted) within any of them."""
  entries = [value] if isinstance(value, str) else list(value)
  out = []
  for entry in entries:
    # `"--config.data.sources.main='a.bin,b.bin'"` gives the one string 'a.bin,b.bin' (unquoted,
    # ml_collections reads `/d/0.bin,/d/1.bin` as Python and refuses it).
    for path in [entry] if Path(entry).exists() else [p.strip() for p in entry.split(',')]:
      if not path:
        continue
      if path != EMBEDDED and any(c in path for c in '*?[') and not Path(path).exists():
        found = sorted(glob.glob(path))
        if not found:
          raise ConfigError('E-DATA-001', f'data source {path} matches no file', _FIX)
        out += found
      else:
        out.append(path)
  return out


class Tokens:
  """A read-only uint16 token sequence made of parts (mapped `.bin` shards as uint16, mapped text
  and the embedded corpus as uint8), indexed as one array: `len`, slices (views, nothing copied)
  and gathers by index arrays, which are uint16 whatever the parts are."""

  def __init__(self, parts: Sequence[np.ndarray], files: Sequence[tuple[str, int] | None] = ()):
    keep = [k for k, p in enumerate(parts) if len(p)]
    files = list(files) or [None] * len(parts)
    self.parts = [parts[k] for k in keep]
    self.files = [files[k] for k in keep]  # (path, first token in it) of a mapped part
    self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

  def __len__(self) -> int:
    return int(self.ends[-1]) if len(self.ends) else 0

  def __array__(self, dtype=None, copy=None):
    whole = np.concatenate(self.parts, dtype=np.uint16) if self.parts else np.zeros(0, np.uint16)
    return whole if dtype is None else whole.astype(dtype)

  def __getitem__(self, key):
    if isinstance(key, slice):
      start, stop, stride = key.indices(len(self))
      if stride != 1:
        raise IndexError('Tokens slices take no stride')
      out, files, begin = [], [], 0
      for part, file, end in zip(self.parts, self.files, self.ends.tolist()):
        lo, hi = max(start, begin), min(stop, end)
        if lo < hi:
          out.append(part[lo - begin:hi - begin])
          files.append(file and (file[0], file[1] + lo - begin))
        begin = end
      return Tokens(out, files)
    return self.take(np.asarray(key))

  def take(self, idx: np.ndarray) -> np.ndarray:
    """The tokens at `idx` (any shape of indices into the whole sequence), as uint16."""
    if len(self.parts) == 1:
      return np.asarray(self.parts[0][idx], np.uint16)
    which = np.searchsorted(self.ends, idx, side='right')
    begins = np.concatenate([[0], self.ends[:-1]])
    out = np.empty(idx.shape, np.uint16)
    for k in np.unique(which):
      at = which == k
      out[at] = self.parts[k][idx[at] - begins[k]]
    return out

  def max(self) -> int:
    """The largest token id, read in chunks (by read(), so a mapped file is not paged in)."""
    top = 0
    for part, file in zip(self.parts, self.files):
      if file is not None:
        with open(file[0], 'rb') as f:
          f.seek(2 * file[1])
          for at in range(0, len(part), _SCAN_CHUNK):
            chunk = np.fromfile(f, '<u2', count=min(_SCAN_CHUNK, len(part) - at))
            top = max(top, int(chunk.max()))
      else:
        top = max(top, int(part.max()))
    return top


def _is_bin(source: str) -> bool:
  # `x.BIN` holds uint16 tokens as `x.bin` does: read as text, every other token would be 0.
  return Path(source).suffix.lower() == '.bin'


def _map(path: Path, dtype) -> np.ndarray:
  """`path` memory-mapped read-only as an array of `dtype`."""
  with open(path, 'rb') as f:
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  if hasattr(mapped, 'madvise'):
    # Batches read short windows at random places: the kernel's read-ahead (megabytes a fault)
    # would page in, and count as resident, far more than they touch.
    mapped.madvise(mmap.MADV_RANDOM)
  return np.frombuffer(mapped, dtype)


def _open_file(source: str) -> np.ndarray:
  path = Path(source)
  if not path.is_file():
    raise ConfigError('E-DATA-001', f'data source {source} is not a file', _FIX)
  size = path.stat().st_size
  if size == 0:
    raise ConfigError('E-DATA-006', f'data source {source} is empty',
                      'remove it from data.sources, or write its tokens')
  if not _is_bin(source):
    # A byte a token, kept as bytes: a uint16 copy would make a text source cost 3x its size.
    return _map(path, np.uint8)
  if size % 2:
    raise ConfigError(
        'E-DATA-005', f'data source {source} has {size} bytes, an odd number: not uint16 tokens',
        'write .bin files as little-endian uint16 (np.array(ids, "<u2").tofile(path))')
  return _map(path, '<u2')


def open_tokens(paths) -> Tokens:
  """The tokens of one source's files in order (`source_paths` forms); `embedded` names the
  corpus shipped with jaxckpt. Files are mapped, not read."""
  parts, files = [], []
  for source in source_paths(paths):
    if source == EMBEDDED:
      parts.append(np.frombuffer(embedded_corpus(), np.uint8))
    else:
      parts.append(_open_file(source))
    files.append((source, 0) if _is_bin(source) else None)
  return Tokens(parts, files)


def load_tokens(paths: Sequence[str]) -> np.ndarray:
  """All tokens of `paths` in one in-memory array (small data; training maps `.bin` files)."""
  return np.asarray(open_tokens(paths))


@dataclasses.dataclass
class Source:
  name: str
  train: Tokens
  heldout: Tokens


@dataclasses.dataclass
class Dataset:
  sources: list[Source]  # the bandit's arms, in config order
  block_size: int
  batch_size: int
  seed: int
  vocab_size: int = 0  # token ids at or above it are refused as batches are cut (0: unchecked)

  @property
  def names(self) -> list[str]:
    return [s.name for s in self.sources]

  def batch(self, step: int, source: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of training step `step`, each (batch_size, block_size) int32."""
    train = self.sources[source].train
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(train) - self.block_size - 1, size=self.batch_size)
    return self._windows(source, train, starts)

  def heldout_batches(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` fixed held-out batches per source (the same every time, so evaluations compare)."""
    out = []
    for k, source in enumerate(self.sources):
      span = len(source.heldout) - self.block_size - 1
      starts = np.linspace(0, span, n * self.batch_size, dtype=np.int64).reshape(n, -1)
      out += [self._windows(k, source.heldout, s) for s in starts]
    return out

  def epoch(self, step: int) -> float:
    """Epochs of the (combined) training tokens seen by `step`."""
    return step * self.batch_size * self.block_size / sum(len(s.train) for s in self.sources)

  def _windows(self, source: int, tokens: Tokens, starts: np.ndarray):
    idx = starts[:, None] + np.arange(self.block_size + 1)[None, :]  # (B, T+1)
    chunk = tokens.take(idx).astype(np.int32)
    if self.vocab_size and int(chunk.max()) >= self.vocab_size:
      # A large source is not scanned whole at the start; an out-of-range id would be clamped
      # silently by the embedding's gather, so it is refused where it is read.
      raise _too_large(self.sources[source].name, int(chunk.max()), self.vocab_size, mid_run=True)
    return chunk[:, :-1], chunk[:, 1:]


def _too_large(name: str, token: int, vocab: int, mid_run: bool = False) -> ConfigError:
  # Found while training, the model's checkpoints have this vocabulary: a resume under a larger
  # one is refused (E-PARAM-002), so the data is what to fix.
  fix = ('fix the data (every id below model.vocab_size), then run the same command: it resumes '
         'from the last checkpoint; a larger vocabulary is a new run') if mid_run else \
      'raise model.vocab_size or fix the data'
  return ConfigError('E-DATA-002', f'data source {name} has token id {token} but '
                     f'model.vocab_size={vocab}', fix)


def _split(name: str, tokens: Tokens, cfg) -> Source:
  vocab = cfg.model.vocab_size
  if 0 < len(tokens) <= SCAN_TOKENS and tokens.max() >= vocab:
    raise _too_large(name, tokens.max(), vocab)
  n_heldout = int(len(tokens) * cfg.data.heldout_fraction)
  source = Source(name, tokens[:len(tokens) - n_heldout], tokens[len(tokens) - n_heldout:])
  need = cfg.model.block_size + 2
  if len(source.train) < need or len(source.heldout) < need:
    raise ConfigError(
        'E-DATA-003', f'data source {name} has {len(tokens)} tokens, too few for '
        f'block_size {cfg.model.block_size} with heldout_fraction '
        f'{cfg.data.heldout_fraction}', 'add data or shrink model.block_size')
  return source


def from_config(cfg) -> Dataset:
  if not cfg.data.sources:
    raise ConfigError('E-DATA-004', 'data.sources is empty', 'name at least one source')
  sources = [_split(name, open_tokens(paths), cfg) for name, paths in cfg.data.sources.items()]
  return Dataset(sources, cfg.model.block_size, cfg.train.batch_size, cfg.seed,
                 cfg.model.vocab_size)
