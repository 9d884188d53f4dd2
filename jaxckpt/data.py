"""Tokens, splits and batches.

The tokenizer is bytes (vocab 256). A corpus is the embedded default text, the user's own text
files, or a pre-tokenized little-endian uint16 `.bin` (nanoGPT's format). The last
`data.heldout_fraction` of the tokens is the held-out split.

A training batch is a pure function of (seed, step): resuming at step k needs no iterator state
beyond k itself, and every process of a multi-host run can build the same global batch.
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
class Dataset:
  train: np.ndarray    # uint16 tokens
  heldout: np.ndarray  # uint16 tokens
  block_size: int
  batch_size: int
  seed: int

  def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of training step `step`, each (batch_size, block_size) int32."""
    rng = np.random.default_rng([self.seed, step])
    return _windows(self.train, rng.integers(0, len(self.train) - self.block_size - 1,
                                             size=self.batch_size), self.block_size)

  def heldout_batches(self, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` fixed held-out batches (the same ones every time, for comparable evaluations)."""
    span = len(self.heldout) - self.block_size - 1
    starts = np.linspace(0, span, n * self.batch_size, dtype=np.int64).reshape(n, -1)
    return [_windows(self.heldout, s, self.block_size) for s in starts]

  def epoch(self, step: int) -> float:
    return step * self.batch_size * self.block_size / len(self.train)


def _windows(tokens: np.ndarray, starts: np.ndarray, block_size: int):
  idx = starts[:, None] + np.arange(block_size + 1)[None, :]  # (B, T+1)
  chunk = tokens[idx].astype(np.int32)
  return chunk[:, :-1], chunk[:, 1:]


def from_config(cfg) -> Dataset:
  tokens = load_tokens(list(cfg.data.paths))
  vocab = cfg.model.vocab_size
  if len(tokens) and int(tokens.max()) >= vocab:
    raise ConfigError('E-DATA-002', f'the data has token id {int(tokens.max())} but '
                      f'model.vocab_size={vocab}', 'raise model.vocab_size or fix the data')
  n_heldout = int(len(tokens) * cfg.data.heldout_fraction)
  train, heldout = tokens[:len(tokens) - n_heldout], tokens[len(tokens) - n_heldout:]
  need = cfg.model.block_size + 2
  if len(train) < need or len(heldout) < need:
    raise ConfigError('E-DATA-003', f'the data has {len(tokens)} tokens, too few for '
                      f'block_size {cfg.model.block_size} with heldout_fraction '
                      f'{cfg.data.heldout_fraction}', 'add data or shrink model.block_size')
  return Dataset(train, heldout, cfg.model.block_size, cfg.train.batch_size, cfg.seed)
