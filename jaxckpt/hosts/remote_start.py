"""Where a run with `--remote` starts from: the workdir brought to the newest intact checkpoint
of either tier, before the workdir's records are opened (a download replaces them).

- A newer intact remote checkpoint is downloaded (CRC-checked) with the run's records of that
  step; a remote one that fails its checksums while it downloads is passed over for the next.
- A remote that holds committed checkpoints, none of them intact, is never taken for an empty
  one: with nothing local to continue from, the start is refused (E-RESUME-004), as a workdir
  whose checkpoints are all damaged is. `--resume=none` against a remote that holds committed
  checkpoints is refused (E-RESUME-001), as against a workdir that does.
- A remote checkpoint the run abandoned when it went back to an older one (named by the
  workdir's `abandoned.json` or the remote's `run/abandoned.json`, which `send_abandoned` writes
  before the first step) is taken only when nothing else, local or remote, is intact.
- A local checkpoint that fails its checksums while it is restored is replaced by the remote's
  intact copy of the same step (`replace_damaged`), not passed over for an older local one.
- The run's events travel with each checkpoint as of its save; at the end of each start, after
  its end record, process 0 also writes to `URL/run/events.jsonl` the events past those of its
  newest remote commit (`send_events`): a line `{"format": "jaxckpt.events-tail", "start": S,
  "crc32": ...}` (S bytes before them, with their CRC-32), then the bytes from S on; the whole
  record when it knows of no commit. A download takes that object instead of the checkpoint's
  events when it continues them byte for byte with well-formed records (`later_events`): how the
  start that wrote it ended reaches the next machine even when the start's last checkpoint did
  not get up in time. A long run sends what its last start appended, not its whole history.
  An object that does not continue them so (another history's, cut short, a line that is no
  record or is nested too deeply to parse) is passed over: the checkpoint's own events are taken.
- The records are written into the workdir before the downloaded checkpoint is published: a
  start that fails between the two downloads it again, never finds it without its records.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable

from absl import logging

from jaxckpt.checkpoint import CheckpointError, abandoned, atomic, beside, discovery, layout
from jaxckpt.checkpoint.checksum import crc32
from jaxckpt.checkpoint.remote import LeaseError, StoreError, objects
from jaxckpt.checkpoint.remote import abandoned as remote_abandoned
from jaxckpt.checkpoint.remote.store import StoreTimeout
from jaxckpt.checkpoint.remote.bounds import MAX_MANIFEST_BYTES, read_prefix
from jaxckpt.errors import ResumeError
from jaxckpt.records.workdir import BANDIT, EVENTS, LOSSES, SAMPLES, STATUS

APPEND_ONLY = (LOSSES, EVENTS)  # captured as their length at the call: the prefix never changes
REWRITTEN = (SAMPLES, BANDIT, STATUS)  # captured as bytes
RUN_EVENTS = f'run/{EVENTS}'  # the run's events as the last start that ended cleanly left them
TAIL = 'jaxckpt.events-tail'  # its first line's format when it holds the events past S bytes
MAX_EVENTS_BYTES = MAX_MANIFEST_BYTES  # what is read of it, at most (a long run's: megabytes)


def sync_down(run,
              ckpt_dir: Path,
              *,
              resume: str,
              fetch: bool,
              local_too: bool = True,
              meanwhile: Callable[[], Any] | None = None) -> None:
  """Brings the workdir of `run` (a `RemoteRun`) to the newest intact checkpoint of either tier
  and sets `run.start_step` (the newest intact remote step). Without `fetch` (a start that names
  its resume point, or a process that waits for process 0's download) it only learns that.
  Without `local_too` the remote's newest is downloaded whatever this workdir holds (each
  host's own disk, where the processes hold different checkpoints). A download runs beside
  `meanwhile()` (the first step's compile; see `fetch_step`). Without `fetch`, a `meanwhile` given
  is for a process that waits for another's download into this workdir: it runs here when this
  workdir lacks the remote's newest. A process that looks once that download is already in (a
  late start) runs none: it compiles beside its restore instead."""
  url = run.store.url
  local, _ = discovery.latest_intact(ckpt_dir, checksums=False) if local_too else (None, [])
  local_step = layout.parse_step(local.name) if local is not None else None
  committed = objects.committed(run.store)
  if resume == 'none' and committed:
    raise ResumeError(
        'E-RESUME-001', f'--resume=none but --remote={url} already holds committed checkpoints '
        f"(steps {min(committed)}..{max(committed)}); starting fresh would silently fork the run's "
        'history', 'use --resume=latest to continue, or a new --remote prefix and --workdir to '
        'start over')
  passed: list[tuple[int, str]] = []
  # What this run abandoned (the workdir's record, or the remote's when the disk was lost) comes
  # after the rest: only when nothing local is there and nothing else remote is intact.
  order, left = remote_abandoned.newest_first(run.store, committed, [abandoned.recorded(ckpt_dir)])
  # A local checkpoint the run abandoned (`latest_intact`'s fallback) is no local one of its
  # history: an intact remote checkpoint of that history comes first.
  local_gone = local_step is not None and local_step in abandoned.steps(ckpt_dir)
  for step in order:
    if step in left and ((local_step is not None and not local_gone) or run.start_step is not None):
      logging.info('passing over remote step %d: %s', step, discovery.ABANDONED)
      continue
    _, _, _, problems = objects.inspect(run.store, step, committed[step])
    if problems:
      logging.warning('passing over remote step %d: %s', step, problems[0])
      passed.append((step, problems[0]))
      continue
    if step in left:
      logging.warning('taking remote step %d, which the run abandoned: nothing else is intact',
                      step)
    if run.start_step is None:
      run.start_step = step
    if local_step is not None and local_step >= step and (step in left or not local_gone):
      return
    if not fetch:
      if meanwhile is not None:  # what it says, it says itself
        meanwhile()
      return
    try:
      fetch_step(run, step, ckpt_dir, local_step, meanwhile=meanwhile)
      return
    except StoreError:
      raise  # the store failed: starting without the remote's newest would fork the run
    except CheckpointError as e:
      logging.warning('passing over remote step %d: %s', step, e.line())
      passed.append((step, e.what))
      meanwhile = None  # it ran beside this download
      if run.start_step == step:
        run.start_step = None
  if fetch and passed and local_step is None:  # never a fresh start over committed checkpoints
    step, why = passed[0]
    raise ResumeError(
        'E-RESUME-004', f'none of the {len(committed)} committed checkpoint(s) in --remote={url} '
        f'is intact (newest: step {step}: {why})', f'see `jaxckpt verify {url}`; restore the '
        'objects, or start over with a new --remote prefix')


def fetch_step(run,
               step: int,
               ckpt_dir: Path,
               local_step: int | None,
               *,
               records: bool = True,
               meanwhile: Callable[[], Any] | None = None) -> Path:
  """Downloads remote step `step` into `ckpt_dir` (replacing a local copy of it) and, with
  `records`, the run's records of that step into the workdir, written before the checkpoint is
  published (`objects.download`'s `before_publish`); sets `run.fetched`.

  With `meanwhile`, the download runs on a thread of its own (`jaxckpt-fetch`: the store's
  requests, the disk) while `meanwhile()` runs on this one: a fresh machine compiles its first
  step while the checkpoint comes down, and waits for the longer of the two. A download that
  finishes no part for `STALL_SECS` plus the time its parts in flight take at 1 MB/s is
  E-STORE-016 (`_beside`).
  """
  t0 = time.monotonic()
  logging.info('fetching step %d from %s (the newest intact checkpoint%s)%s', step, run.store.url,
               f'; local has {local_step}' if local_step is not None else '',
               ' while the train step compiles' if meanwhile is not None else '')
  progress, took = _Progress(step), [([], 0)]

  def records_first(got: dict[str, bytes]) -> None:
    # Before the checkpoint is published: a start that finds it published never downloads it
    # again, so its records would never come if they failed to go in after it.
    if records:
      took[0] = take_records(run, step, got)

  download = lambda: objects.download(
      run.store,
      step,
      ckpt_dir,
      progress=progress,
      on_plan=progress.plan,
      before_publish=records_first)
  if meanwhile is None:
    path, _ = download()
  else:
    path, _ = _beside(download, meanwhile, progress, f'step {step} from {run.store.url}')
  taken, added = took[0]
  run.fetched = fetched(run, step, sum(p.stat().st_size for p in path.rglob('*') if p.is_file()),
                        time.monotonic() - t0, taken, added)
  logging.info('fetched step %d: %.1f MB in %.1f s', step, run.fetched['bytes'] / 1e6,
               run.fetched['seconds'])
  return path


def fetched(run, step: int, nbytes: int, seconds: float, records: list[str],
            later: int) -> dict[str, Any]:
  """What the `fetched` event says of remote step `step`: the bytes this process read of it,
  in `seconds`, and the records taken with it (`later`: the events added past the step)."""
  return {
      'step': step, 'url': run.store.join(objects.step_prefix(step)), 'bytes': nbytes,
      'seconds': round(seconds, 3), 'records': records, 'later_events': later
  }


def take_records(run, step: int, got: dict[str, bytes]) -> tuple[list[str], int]:
  """Process 0: the run's records that came with remote step `step` (`got`) written into the
  workdir, its events continued by `URL/run/events.jsonl` where that continues them; returns
  (the records' names, the events added past the step). The others write nothing."""
  if not run.leader:
    return [], 0
  added = 0
  if got.get(EVENTS) is not None and (later := later_events(run.store, got[EVENTS])) is not None:
    added = later[len(got[EVENTS]):].count(b'\n')  # this run's events past the step, to the
    logging.info("the run's events past step %d: %d record(s) from %s", step, added,
                 run.store.join(RUN_EVENTS))  # end of the start that sent them
    got = {**got, EVENTS: later}
  for name, data in got.items():
    if name in APPEND_ONLY + REWRITTEN:
      atomic.write_file_durably(run.workdir / name, data)
  return sorted(got), added


def replace_damaged(run, path: Path, ckpt_dir: Path) -> Path | None:
  """Local checkpoint `path` failed its checksums while it was restored: the remote's intact
  copy of the same step, downloaded over it (the workdir's records, which are of this run's
  own history, stay); None when the remote holds none. The caller restores it again."""
  step = layout.parse_step(path.name)
  if step is None or path.parent.resolve() != Path(ckpt_dir).resolve():
    return None
  try:
    keys = objects.committed(run.store).get(step)
    if keys is None or objects.inspect(run.store, step, keys)[3]:
      return None
    logging.warning('%s fails its checksums; %s holds step %d intact: downloading it', path,
                    run.store.url, step)
    replaced = fetch_step(run, step, ckpt_dir, step, records=False)
  except CheckpointError as e:  # the store failed, or its copy is damaged too: the older one
    logging.warning('the remote copy of step %d cannot replace %s: %s', step, path, e.line())
    return None
  return replaced


def send_events(run, timeout: float) -> str | None:
  """Process 0, at the end of a start (after its end record): the run's events past those its
  newest remote commit holds (`tail`), written to `URL/run/events.jsonl`, fenced by the lease.
  Waits at most `timeout` seconds for the store; returns None once they are there, else why not
  (the caller says it)."""
  where = run.store.join(RUN_EVENTS)
  try:
    data = (run.workdir / EVENTS).read_bytes()
    start = run.uploader.committed_size(EVENTS) if run.uploader is not None else 0
    if run.lease is not None:
      run.lease.writable(where)
    run.store.write(RUN_EVENTS, tail(data, start), timeout=timeout)
  except TimeoutError:
    return f'{where} did not answer within {timeout:.0f} s'
  except LeaseError as e:
    return e.what
  except Exception as e:  # noqa: BLE001 - a store error of any kind: the end is not shared
    return f'{where}: {type(e).__name__}: {" ".join(str(e).split())[:200]}'
  return None


def send_abandoned(run, step: int, ckpt_dir: Path, timeout: float = 60) -> dict[int, str]:
  """Process 0, at a start that continues from `step`, before its first step: the checkpoints
  it abandons, in `URL/run/abandoned.json` (`remote.abandoned.send`), fenced by the lease. A
  store that does not take it within `timeout` seconds is a warning: a machine that starts from
  the remote alone before the replay replaces them would take the newest of them. Returns the
  record ({step: seal}; the workdir's when the store failed)."""
  local = abandoned.recorded(ckpt_dir)
  try:
    if not local and (run.start_step is None or run.start_step <= step):
      # Nothing intact above `step` that no record names (`sync_down` found the remote's newest
      # otherwise): no listing, and no write unless the record names `step` or above (a start
      # from what the run had abandoned, nothing else being intact: its history now).
      named = remote_abandoned.recorded(run.store)
      if not any(s >= step for s in named):
        return named
    gone = remote_abandoned.send(
        run.store,
        step,
        local,
        own_seal=abandoned.seal(ckpt_dir / layout.step_dirname(step)),
        may_write=run.lease.writable if run.lease is not None else lambda what: None,
        timeout=timeout)
  except (StoreError, LeaseError, TimeoutError) as e:
    what = e.what if isinstance(e, CheckpointError) else f'no answer within {timeout:.0f} s'
    logging.warning(
        'the record of abandoned checkpoints %s could not be read or written (%s): a machine '
        'that starts from the remote alone, before the replay replaces them, would take the '
        'newest of them, and remote retention counts them', run.store.join(remote_abandoned.KEY),
        what)
    return local
  with contextlib.suppress(
      OSError):  # entries neither here nor there: later starts skip the listing
    abandoned.forget(ckpt_dir, set(local) - set(gone))
  if gone:
    logging.info('recorded %d abandoned remote checkpoint(s) in %s (steps %s)', len(gone),
                 run.store.join(remote_abandoned.KEY), ', '.join(map(str, sorted(gone))))
  return gone


def tail(events: bytes, start: int) -> bytes:
  """`URL/run/events.jsonl` for the run's `events` when a commit holds their first `start`
  bytes: a line saying so (with their CRC-32), then the bytes from `start` on; `events` whole
  when `start` is 0 or not a line's end in them."""
  if not 0 < start <= len(events) or events[start - 1:start] != b'\n':
    return events
  head = {'format': TAIL, 'start': start, 'crc32': f'{crc32(events[:start]):08x}'}
  return json.dumps(head, separators=(',', ':')).encode() + b'\n' + events[start:]


def _joined(data: bytes, events: bytes) -> bytes | None:
  """The record an events object stands for, given a checkpoint's `events`: a tail joined to
  the first `start` bytes of `events` when those are what its first line says (None when they
  are not: another history's, or a commit newer than the checkpoint's); a whole one as it is."""
  first, _, rest = data.partition(b'\n')
  try:
    head = json.loads(first)
  except (ValueError, RecursionError):  # a record, or no JSON: checked as a whole object
    return data
  if not isinstance(head, dict) or head.get('format') != TAIL or 'event' in head:
    return data
  start, crc = head.get('start'), head.get('crc32')
  if type(start) is not int or not 0 < start <= len(events) or \
      crc != f'{crc32(events[:start]):08x}':
    return None
  return events[:start] + rest


def later_events(store, events: bytes) -> bytes | None:
  """`URL/run/events.jsonl` when it continues `events` (a checkpoint's) byte for byte with whole
  records, each a JSON object naming its event: the same run's events past that checkpoint.
  None when it does not (another history's, an older start's, malformed, over MAX_EVENTS_BYTES):
  then the checkpoint's own events are the ones to take."""
  try:
    data = read_prefix(store, RUN_EVENTS, MAX_EVENTS_BYTES + 1, exact=False)
  except StoreError as e:
    logging.warning('not reading %s: %s', store.join(RUN_EVENTS), e.what)
    return None
  if data is None or len(data) > MAX_EVENTS_BYTES:
    return None
  joined = _joined(data, events)
  if joined is None:
    logging.warning(
        "passing over %s: it holds the events past another commit's than this "
        "checkpoint's (%d bytes of events)", store.join(RUN_EVENTS), len(events))
    return None
  data = joined
  if len(data) <= len(events) or not data.startswith(events) or not events.endswith(b'\n'):
    return None
  tail = data[len(events):]
  try:
    rows = [json.loads(line) for line in tail.splitlines()]
  except (ValueError, RecursionError):  # RecursionError: a line nested too deeply to parse
    rows = []
  if not tail.endswith(b'\n') or not rows or not all(
      isinstance(r, dict) and isinstance(r.get('event'), str) for r in rows):
    logging.warning("passing over %s: its records past the checkpoint's are malformed",
                    store.join(RUN_EVENTS))
    return None
  return data


# A download beside a compile that finishes no part for this long is stuck: each request gives up
# on its own well before (no connection in 20 s, under 1 byte/s for 30 s; 3 retries). Plus the
# time `PARALLEL` parts in flight take at 1 MB/s: on a slow link the first part lands late.
STALL_SECS = 300


def _beside(download: Callable[[], Any], meanwhile: Callable[[], Any], progress: '_Progress',
            what: str) -> Any:
  """`download()` on a thread of its own while `meanwhile()` runs here (`checkpoint.beside`)."""
  name = 'jaxckpt-fetch'

  def stuck() -> StoreTimeout | None:
    limit = STALL_SECS + objects.PARALLEL * progress.part_bytes / 1e6
    if time.monotonic() - progress.moved <= limit:
      return None
    return StoreTimeout(
        'E-STORE-016', f'the download of {what} (thread {name}) finished no part for '
        f'{limit:.0f} s ({progress.done / 1e6:.1f} of {progress.total / 1e6:.1f} MB)',
        'check the store and the network, then run the same command again')

  return beside.beside(download, meanwhile, stuck, name=name)


class _Progress:
  """Logs a long download's progress every 10 seconds; when a part last finished (`moved`)."""

  def __init__(self, step: int):
    self.step, self.last = step, time.monotonic()
    self.moved, self.done, self.total, self.part_bytes = self.last, 0, 0, objects.PART_BYTES

  def plan(self, total: int, part_bytes: int) -> None:
    """What the download is about to move, in parts of `part_bytes` (its manifest's)."""
    self.moved, self.total, self.part_bytes = time.monotonic(), total, part_bytes

  def __call__(self, done: int, total: int) -> None:
    self.moved, self.done, self.total = time.monotonic(), done, total
    if time.monotonic() - self.last >= 10:
      self.last = time.monotonic()
      logging.info('fetching step %d: %.0f%% of %.1f MB', self.step, 100 * done / max(total, 1),
                   total / 1e6)


__all__ = [
    'APPEND_ONLY', 'REWRITTEN', 'RUN_EVENTS', 'fetch_step', 'send_abandoned', 'fetched',
    'later_events', 'replace_damaged', 'send_events', 'sync_down', 'take_records'
]
