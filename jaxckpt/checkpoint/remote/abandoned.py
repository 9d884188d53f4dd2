"""The checkpoints a run abandoned, as the remote knows them: `URL/run/abandoned.json`.

`checkpoint.abandoned` records them in the workdir. A fresh machine (the disk lost while the
replay had not reached them) has only the store, where they are still the newest. So process 0
also writes them there (`send`), fenced by the lease, at a start that continues from step R and
before its first step: every remote checkpoint committed above R, and what an earlier record or
the workdir's names that the remote still holds with the same seal (a step the replay's cadence
skipped). Each entry is a step and its manifest's seal: once the replay uploads that step again,
its seal differs and it counts again, so a stale entry does no harm.

Readers take the newest checkpoint of the history the run is on first (`newest_first`); an
abandoned one only when nothing else is intact. Nothing in the object is trusted: one that is
not a record a writer gives is ignored with a warning, and nothing is ever deleted for it.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

from .. import abandoned, manifest
from . import objects
from .bounds import read_prefix
from .store import Store

KEY = f'run/{abandoned.FILE}'


def recorded(store: Store) -> dict[int, str]:
  """{step: seal} the remote's record names; {} when it has none. A store that fails raises
  (`StoreError`): a start must not take the abandoned future because a read failed."""
  raw = read_prefix(store, KEY, abandoned.MAX_BYTES + 1, exact=False)
  return {} if raw is None else abandoned.parse(raw, store.join(KEY))[1]


def _seal(store: Store, step: int, keys: list[str]) -> str | None:
  raw = objects.inspect(store, step, keys)[0]
  return None if raw is None else manifest.seal_of(raw)


def held(store: Store, committed: Mapping[int, list[str]],
         tables: Iterable[Mapping[int, str]] = ()) -> set[int]:
  """The steps of `committed` (`objects.committed`) that are abandoned: the remote's record, or
  one of `tables` (the workdir's), names them with the seal their manifest has now."""
  named: dict[int, set[str]] = {}
  for table in (recorded(store), *tables):
    for step, seal in table.items():
      named.setdefault(step, set()).add(seal)
  return {s for s in named.keys() & committed.keys() if _seal(store, s, committed[s]) in named[s]}


def newest_first(
    store: Store, committed: Mapping[int, list[str]], tables: Iterable[Mapping[int, str]] = ()
) -> tuple[list[int], set[int]]:
  """(the steps of `committed`, newest first with the abandoned ones after all the others; the
  abandoned ones): the order a start or a reader of `URL` tries them in."""
  gone = held(store, committed, tables)
  rest = [s for s in sorted(committed, reverse=True) if s not in gone]
  return rest + sorted(gone, reverse=True), gone


def send(store: Store,
         step: int,
         local: Mapping[int, str],
         *,
         own_seal: str | None = None,
         may_write=lambda what: None,
         timeout: float | None = None) -> dict[int, str]:
  """Writes the record for a run that continues from `step` with the workdir's record `local`
  (see the module): every remote checkpoint committed above `step`, and the steps the earlier
  record or `local` names that the remote still holds with that seal. `step` itself too when
  the checkpoint the run continues from (its seal: `own_seal`) is not the remote's copy: the
  replay saved it again here and has not uploaded it yet, so the remote's is still the old
  history's. Written only when it differs from the one there; `may_write(url)` is the lease's
  check. Returns the record."""
  committed = objects.committed(store)
  earlier = recorded(store)
  table: dict[int, str] = {}
  for s in sorted(committed):
    if s > step or s in earlier or s in local:
      seal = _seal(store, s, committed[s])
      named = seal in (earlier.get(s), local.get(s))
      if s == step:
        named = named and own_seal is not None and own_seal != seal
      if seal is not None and (s > step or named):
        table[s] = seal
  if table != earlier:
    may_write(store.join(KEY))
    data = json.dumps(abandoned.encode(step, table), indent=1).encode()
    store.write(KEY, data, timeout=timeout)
  return table


__all__ = ['KEY', 'held', 'newest_first', 'recorded', 'send']
