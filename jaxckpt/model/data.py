"""Tokens, splits and batches.

The tokenizer is bytes (vocab 256). A corpus is the embedded default text, the user's own text
files, or a pre-tokenized little-endian uint16 `.bin` (nanoGPT's format). The last
`data.heldout_fraction` of each source's tokens is its held-out split.

Data comes from one or more named sources (`data.sources`: name -> paths); with several, the
bandit (`jaxckpt.model.bandit`) picks the source of each step. A training batch is a pure function of
(seed, step, source): resuming at step k needs no iterator state beyond k and the bandit's state,
and every process of a multi-host run can build the same global batch.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
from pathlib import Path
from typing import Sequence

import numpy as np

from jaxckpt.errors import ConfigError

EMBEDDED = 'embedded'


def embedded_corpus() -> bytes:
  return importlib.resources.files('jaxckpt').joinpath('assets/corpus.txt').read_bytes()


def load_tokens(paths: Sequence[str]) -> np.ndarray:
  """All tokens of the sources in order; `embedded` names the corpus shipped with jaxckpt."""
  parts = []
  for source in paths:
    if source == EMBEDDED:
      parts.append(np.frombuffer(embedded_corpus(), np.uint8).astype(np.uint16))
      continue
    path = Path(source)
    if not path.is_file():
      raise ConfigError('E-DATA-001', f'data source {source} is not a file',
                        f'set data.paths to text files, uint16 .bin files or {EMBEDDED!r}')
    if path.suffix == '.bin':
      parts.append(np.fromfile(path, dtype='<u2'))
    else:
      parts.append(np.frombuffer(path.read_bytes(), np.uint8).astype(np.uint16))
  return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


@dataclasses.dataclass
class Source:
  name: str
  train: np.ndarray  # uint16 tokens
  heldout: np.ndarray  # uint16 tokens


@dataclasses.dataclass
class Dataset:
  sources: list[Source]  # the bandit's arms, in config order
  block_size: int
  batch_size: int
  seed: int

  @property
  def names(self) -> list[str]:
    return [s.name for s in self.sources]

  def batch(self, step: int, source: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of training step `step`, each (batch_size, block_size) int32."""
    train = self.sources[source].train
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(train) - self.block_size - 1, size=self.batch_size)
    return _windows(train, starts, self.block_size)

  def heldout_batches(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` fixed held-out batches per source (the same every time, so evaluations compare)."""
    out = []
    for source in self.sources:
      span = len(source.heldout) - self.block_size - 1
      starts = np.linspace(0, span, n * self.batch_size, dtype=np.int64).reshape(n, -1)
      out += [_windows(source.heldout, s, self.block_size) for s in starts]
    return out

  def epoch(self, step: int) -> float:
    """Epochs of the (combined) training tokens seen by `step`."""
    return step * self.batch_size * self.block_size / sum(len(s.train) for s in self.sources)


def _windows(tokens: np.ndarray, starts: np.ndarray, block_size: int):
  idx = starts[:, None] + np.arange(block_size + 1)[None, :]  # (B, T+1)
  chunk = tokens[idx].astype(np.int32)
  return chunk[:, :-1], chunk[:, 1:]


def _split(name: str, tokens: np.ndarray, cfg) -> Source:
  vocab = cfg.model.vocab_size
  if len(tokens) and int(tokens.max()) >= vocab:
    raise ConfigError(
        'E-DATA-002', f'data source {name} has token id {int(tokens.max())} but '
        f'model.vocab_size={vocab}', 'raise model.vocab_size or fix the data')
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
  sources = [
      _split(name, load_tokens(list(paths)), cfg) for name, paths in cfg.data.sources.items()
  ]
  return Dataset(sources, cfg.model.block_size, cfg.train.batch_size, cfg.seed)
