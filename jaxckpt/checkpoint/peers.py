"""A checkpoint brought back from the parts the job's processes hold (the peer tier).

Where each host's checkpoints are on its own disk and each process also keeps replicas of other
processes' parts (`replicas`), a restart need not wait for the remote tier when the processes
still hold the bytes between them:

1. Every process says which checkpoints it holds (their seals) and which parts of each, by size;
   process 0 alone reads what they say (`multihost.Group.collect`).
2. Process 0 takes the newest checkpoint it holds itself (its records go with it) whose every part
   is held by some process, or by the remote (`Remote`) when the remote has that very commit.
   When nothing newer is whole between them and it holds no copy of the remote's newest (every
   disk wiped, or its own), it first commits that checkpoint's own files alone (`Remote.meta`),
   so that one needs no process to hold a byte of it. Every process then checks the CRC-32 of
   the parts it holds of it; a damaged one is passed over for another holder, or the remote, or
   the next checkpoint.
3. Process 0 says who sends what to whom (`peerplan`): each process needs the parts that hold
   the shards its devices will hold (whatever mesh it restores to), and lacks some of them (a
   replacement host's wiped disk: all of them). A part that some process holds is sent from
   there; one that no living process holds is read from the remote by one process that needs it
   (of those, the one that has read least so far), then sent on: each byte of the remote once in
   the job, about 1/N of it per process when every process needs every part (replicated arrays).
4. The parts move over the job's interconnect with JAX collectives (NCCL, ICI, gloo on CPU),
   never a transport of this package's own, in windows, disk reads and writes overlapping the
   collective. A part that one process lacks goes point to point, in rounds of sends that run
   at once, each a collective permute (`sends`). What several processes lack alike goes to all
   of them at once, one `broadcast_one_to_all` per window (`spreads`): a part they need whole
   (a data-parallel job: every process needs every part), or, where each needs less than half
   of it, those tensors alone (a subset: a fully sharded job's replicated leaves), listed once
   in the plan. Each part received is CRC-checked against the manifest, fsynced and renamed
   into the step directory; the small files go by `spreads.broadcast`, and a process that held
   nothing of the checkpoint gets its manifest last (the commit marker).

Each process then restores from its own step directory as from any other, reading only the byte
ranges its devices need. The `Group` waits are bounded by its timeout, and every process waits
at one before the collectives (the one before the sends also for the slowest read of the
remote, at `FETCH_FLOOR`, which that reader gives up half the timeout sooner, sending zeros to
the end as for a hung disk; the wait for process 0's word while it reads the remote checkpoint's
own files, for those bytes at the same rate), so a process that never comes is named; a
process lost in the middle of a collective, which has no timeout, is seen by the job's own
heartbeats.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from . import (atomic, checksum, diskwork, holdings, layout, manifest, multihost, peerplan, sends,
               spreads)
from .diskwork import HUNG, MISMATCH, WRITER, Disk, Stuck
from .holdings import META, held, tidy
from .errors import CheckpointError

# Bytes/s: the slowest read of the remote that the other processes wait for, beyond the group's
# timeout (a read that stops moving is the store's own error long before).
FETCH_FLOOR = 10e6
# Bytes/s: the slowest CRC check of the parts a process holds that the others wait for.
CHECK_FLOOR = 20e6
MAX_ALLOW = 3600.0  # s: the longest the others wait past the timeout for process 0's read
AGAIN = 'a process stopped or was lost: start every process again (each part is checked again)'
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Remote:
  """What the remote tier offers a peer restore: its newest intact checkpoint (`step`, with its
  manifest's `seal`) and `fetch(step, rels, step_dir, expect)`, which downloads those files of
  checkpoint `step` into `step_dir` (CRC-checked, each as `expect` says it is: {rel: {size,
  crc32}}) and returns the bytes read.

  `meta(step, ckpt_dir)`, when given, commits checkpoint `step` into `ckpt_dir` with its own
  files alone (manifest, run state, shard table; none of its parts): process 0 calls it when
  nothing newer is whole between the processes and it holds no copy of the remote's newest,
  which then needs no process to hold a byte of it, each part read from the remote by one
  process that needs it. The caller's `meta` also takes what comes with it (a run's records)."""
  step: int | None
  seal: str | None
  fetch: Callable[[int, list[str], Path, Mapping[str, Any]], int]
  meta: Callable[[int, Path], Any] | None = None
  meta_bytes: int = 0  # what `meta` reads: the others wait for it at `FETCH_FLOOR`


@dataclasses.dataclass
class Restored:
  """Where a peer restore left the checkpoint on this process, and where its bytes came from."""
  path: Path
  step: int
  sources: dict[str, int]  # bytes this process reads of it: {'own', 'peers', 'remote'}


def restore_dir(ckpt_dir: Path,
                target: Any,
                group: multihost.Group,
                remote: Remote | None,
                replicas: int = 0) -> Restored | None:
  """Brings this process's step directory of the newest checkpoint the job's processes (and
  the remote) hold between them to what its devices need for `target`; None on every process
  when there is none (the caller then takes the remote's newest whole). When processes hold
  committed checkpoints, none whole between them, and the remote holds none, every process
  raises E-RESUME-004 together: never a fresh start over them. Every process calls it."""
  what = 'a restore from the peers'
  tidy(ckpt_dir)
  posts = group.collect('peers/held', what, json.dumps(held(ckpt_dir)), fix=AGAIN)
  views = [holdings.view(k, p) for k, p in enumerate(posts)] if group.leader else []
  tried: set[tuple[int, str]] = set()

  def decide(name: str, fn: Callable[[], Any]) -> Any:
    """Process 0's word on `name` (`fn()`), the others' wait for it; when process 0 fails to
    decide, every process raises E-CKPT-016 at once rather than wait out the timeout."""
    if group.leader:
      try:
        word = fn()
      except Exception as e:  # noqa: BLE001 - said to every process, then raised
        word = {'failed': f'{type(e).__name__}: {" ".join(str(e).split())[:300]}'}
      group.announce(name, json.dumps(word))
    else:
      word = json.loads(group.await_word(name, what, fix=AGAIN))
    if isinstance(word, dict) and 'failed' in word:
      raise CheckpointError('E-CKPT-016', f'process 0 could not decide {what}: {word["failed"]}',
                            'fix what it names on process 0, then start every process again')
    return word

  def shared(name: str, fn: Callable[[], Any]) -> Any:
    """`decide`, its word (process 0's plan: it grows with the processes) sent to every process
    over the interconnect: the coordinator carries its size and CRC-32 alone, not the plan N - 1
    times."""
    made: dict[str, Any] = {}  # process 0's: the plan, and its bytes

    def sized() -> dict[str, Any] | None:
      plan = made['plan'] = fn()
      if plan is None:
        return None
      raw = made['raw'] = json.dumps(plan).encode()
      return {'bytes': len(raw), 'crc32': f'{checksum.crc32(raw):08x}'}

    word = decide(name, sized)
    if word is None:
      return None
    group.collect(f'{name}/in', what, '', fix=AGAIN, read=False)  # all here: the collective
    raw, _ = spreads.share(made.get('raw'), word['bytes'])
    if group.leader:
      return made['plan']
    if f'{checksum.crc32(raw):08x}' != word['crc32'] or len(raw) != word['bytes']:
      # Not E-CKPT-016, on which the trainer falls back to a download: this process alone
      # raises it; the others stop at their next wait, naming it.
      raise CheckpointError(
          'E-DIST-003', f'the plan of {what} arrived from process 0 damaged ({len(raw)} bytes, '
          f'crc32 {checksum.crc32(raw):08x}; it sent {word["bytes"]}, {word["crc32"]})',
          'start every process again: the plan is made and sent again')
    return json.loads(raw)

  def choose(name: str) -> dict[str, Any] | None:
    word = _next(ckpt_dir, views, remote, tried)
    if word is None and remote is not None and remote.meta is not None and \
        remote.step is not None and str(remote.step) not in views[0]:
      try:  # nothing newer is whole here: the remote's newest, its parts read once below
        group.allow(name, min(remote.meta_bytes / FETCH_FLOOR, MAX_ALLOW))  # sizes: the bucket's
        remote.meta(remote.step, ckpt_dir)
        views[0] = held(ckpt_dir)
        word = _next(ckpt_dir, views, remote, tried)
      except CheckpointError as e:  # said; None for everyone (the caller's fallback)
        _log.warning('step %d: its own files from the remote: %s', remote.step, e.what)
    if word is None and (remote is None or remote.step is None):
      word = holdings.stranded(views)  # never a fresh start over committed checkpoints
    if word is not None and 'step' in word:  # what the most laden process CRC-checks of it
      word['check'] = max(
          sum(v.get(str(word['step']), {}).get('files', {}).values()) for v in views)
    return word

  def plan_for(step: int, seal: str, intact: list[str]) -> dict[str, Any] | None:
    try:
      plan = peerplan.build(ckpt_dir, step, [holdings.names(v) for v in intact], target,
                            group.count, remote is not None
                            and (remote.step, remote.seal) == (step, seal), replicas)
    except CheckpointError as e:  # its shard table is damaged here: said, and passed over
      _log.warning('step %d passed over for a restore from the peers: %s', step, e.what)
      plan = None
    if plan is None:  # a damaged part no one else holds: take that one out, try again
      for k, v in enumerate(intact):
        views[k].get(str(step), {})['files'] = {r: 0 for r in holdings.names(v)}
      tried.add((step, seal))
    return plan

  # Each round returns, raises, or passes one commit over for good (`tried`): as many rounds
  # as commits, at most.
  for round_ in itertools.count():
    name = f'peers/try/{round_}'
    word = decide(name, lambda: choose(name))  # pylint: disable=cell-var-from-loop
    if word is None:
      return None
    if 'stranded' in word:  # every process raises it together
      raise CheckpointError(
          'E-RESUME-004', word['stranded'], 'bring back the disks that held the missing parts '
          '(or their files) and start every process again; to start over instead, move these '
          'checkpoints away: nothing was deleted')
    step, seal = word['step'], word['seal']
    if word.get('conflict'):
      raise CheckpointError(
          'E-DIST-008', f'the hosts hold different commits of step {step}: ' +
          ', '.join(f'process {k}: {s}' for k, s in [[0, seal]] + word['conflict']),
          "every host's copy of a checkpoint must be one commit: move the other one away "
          "(another run's workdir?), then start every process again")
    mine = holdings.intact(ckpt_dir, step, seal)
    intact = group.collect(
        f'peers/intact/{round_}',
        what,
        json.dumps(mine),
        timeout_secs=group.timeout_secs + word.get('check', 0) / CHECK_FLOOR,
        fix=AGAIN)
    plan = shared(f'peers/plan/{round_}', lambda: plan_for(step, seal, intact))
    if plan is not None:
      return _carry_out(ckpt_dir, plan, mine, group, remote)
  return None


def _next(ckpt_dir: Path, views: list[dict], remote: Remote | None,
          tried: set) -> dict[str, Any] | None:
  """Process 0: the newest checkpoint it holds whose every part some process holds (by size),
  or the remote holds as the same commit; None when there is none, or the remote's is newer."""
  for key, mine in sorted(views[0].items(), key=lambda kv: -int(kv[0])):
    step, seal = int(key), mine['seal']
    if remote is not None and remote.step is not None and remote.step > step:
      return None  # the remote's newest is newer: take it whole
    if (step, seal) in tried:
      continue
    m = manifest.read(ckpt_dir / layout.step_dirname(step))
    on_remote = remote is not None and (remote.step, remote.seal) == (step, seal)
    held_by = set()
    for view in views:
      if view.get(key, {}).get('seal') == seal:
        held_by |= set(view[key]['files'])
    parts = holdings.parts(m)
    if on_remote or set(parts) <= held_by:
      return {'step': step, 'seal': seal, **holdings.conflict(views, key, seal, parts)}
  return None


def _carry_out(ckpt_dir: Path, plan: Mapping[str, Any], mine: list[str], group: multihost.Group,
               remote: Remote | None) -> Restored:
  """Every process, in the same order: the checkpoint's own files to those that lack them, each
  move's part from its sender (which reads it from the remote first where no process holds it),
  then the commit of a step directory that was not here. A local failure (a full disk, a store
  error, a part that arrives damaged) does not take a process out of the collectives: it takes
  part in all of them, then every process raises E-CKPT-016 together, naming it. A disk that
  hangs is touched no more, by any thread (`diskwork.Disk`)."""
  with Disk() as disk:
    return _carry_on(ckpt_dir, plan, mine, group, remote, disk)


def _carry_on(ckpt_dir: Path, plan: Mapping[str, Any], mine: list[str], group: multihost.Group,
              remote: Remote | None, disk: Disk) -> Restored:
  me, step, t0 = group.index, plan['step'], time.monotonic()  # the others wait no sooner
  final = ckpt_dir / layout.step_dirname(step)
  have = me == 0 or bool(mine) or manifest.seal_of(_read(final / layout.MANIFEST)) == plan['seal']
  work = final if have else layout.temporary_dir(ckpt_dir, step)
  sources = {'own': 0, 'peers': 0, 'remote': 0}
  problems: list[str] = []

  def local(fn: Callable[[], Any], what: str | None = None, wait: float | None = None) -> Any:
    """`fn()` unless a problem came first, its failure kept; `what`: disk work, done on the
    disk's thread and bounded (`diskwork.Disk`, `wait` s where given), named so should it hang."""
    if problems or disk.stuck:
      problems.extend([disk.stuck] if disk.stuck and not problems else [])
      return None
    try:
      return fn() if what is None else disk.run(WRITER, what, fn, wait=wait)
    except Stuck as e:
      problems.append(str(e))
    except CheckpointError as e:  # as `Disk.kept` says one
      problems.append(e.line())
    except Exception as e:  # noqa: BLE001 - said to every process below, then raised
      problems.append(f'{type(e).__name__}: {" ".join(str(e).split())[:300]}')
    return None

  def gate(name: str, what: str, timeout_secs: float | None = None) -> None:
    """Every process here before the collectives that follow: a bounded wait, naming who is
    not, where a collective has no timeout of its own."""
    group.collect(
        f'peers/{name}/{step}', what, '', timeout_secs=timeout_secs, fix=AGAIN, read=False)

  local(lambda: (work / layout.STATE_DIR).mkdir(parents=True, exist_ok=True), f'making {work}')
  raw = b''
  meta_to = peerplan.members(plan['meta_to'])
  if meta_to:
    gate('meta', f"step {step}'s own files, sent to the processes without them")
  for name in plan['meta'] if meta_to else ():  # the manifest last
    got, problem = spreads.broadcast(final / name if me == plan['from'].get(name, 0) else None,
                                     plan['meta'][name], me in meta_to, disk)
    problems += [problem] if problem else []
    if name == layout.MANIFEST:
      raw = got or b''
    elif got is not None:  # checked against the manifest before it goes into a step directory
      local(
          lambda got=got, name=name: _write_own(work / name, got, plan['own'][name], step),
          f'writing {work / name}')
  t0 = time.monotonic() if meta_to else t0  # every process leaves the last collective together
  moves = peerplan.moves_of(plan)
  reads = [rel for rel, k in moves.reads.items() if k == me]
  load: dict[int, int] = {}  # the bytes each process reads from the remote, which the rest wait for
  for rel, k in moves.reads.items():
    load[k] = load.get(k, 0) + plan['files'][rel]['size']
  if reads:  # given up half the timeout before the others stop waiting for it (they come to
    # that wait no sooner than `t0`), then zeros sent to the end
    more = f' and {len(reads) - 1} more' if len(reads) > 1 else ''
    sources['remote'] = local(
        lambda: remote.fetch(step, reads, work, plan['files']),
        f'reading {reads[0]}{more} of step {step} from the remote into {work}',
        max(0.0, group.timeout_secs / 2 + load[me] / FETCH_FLOOR - (time.monotonic() - t0))) or 0
  gate(
      'sends', f'the sends of step {step}' + (f' after process(es) {sorted(load)} read '
                                              f'{sum(load.values()) / 1e6:.1f} MB of it from the '
                                              'remote' if load else ''),
      group.timeout_secs + max(load.values(), default=0) / FETCH_FLOOR)
  got, problem = sends.carry(moves.pairs, plan['files'], me,
                             lambda rel: layout.safe_member(work, rel), moves.subsets, disk)
  sources['peers'] = got
  problems += [problem] if problem else []
  for rel, source, group_of, tensors in moves.spreads:  # every process, whatever failed here
    path = local(lambda rel=rel: layout.safe_member(work, rel), f'finding {rel}') if me == source or \
        me in group_of else None
    got, problem = spreads.spread(path if me == source else None, tensors,
                                  path if me in group_of else None, plan['files'][rel], disk)
    sources['peers'] += got
    problems += [problem] if problem else []
  sources['own'] = plan['held'][me]
  if not have:
    local(lambda: _commit(work, final, raw, plan['seal'], step), f'committing {final}')
  else:
    local(lambda: atomic.fsync_dir(final / layout.STATE_DIR), f'syncing {final / layout.STATE_DIR}')
  cause = _cause(problems)  # a hang after an earlier problem is said too: it rules the fallback
  cause += f'; then {disk.stuck}' if disk.stuck and disk.stuck not in cause else ''
  # The last file received may be a large one whose fsync is waited for longer (`diskwork`):
  # a process whose disk hangs there comes that much later, and says so.
  largest = max((f['size'] for f in plan['files'].values()), default=0)
  said = group.collect(
      f'peers/done/{step}',
      f'a restore of step {step} from the peers',
      cause,
      fix=AGAIN,
      timeout_secs=group.timeout_secs + diskwork.DISK_WAIT_SECS +
      largest / diskwork.DISK_BYTES_PER_SEC)
  # Process 0 reads what each said, and says what failed in one word to all.
  if group.leader:
    failed = [(k, p) for k, p in enumerate(said) if p]
    hung = [(k, p) for k, p in failed if HUNG in p]
    verdict = {
        'failed': [k for k, _ in failed], 'cause': _cause([p for _, p in failed]),
        'hung': [k for k, _ in hung], 'hang': hung[0][1] if hung else ''
    }
    group.announce(f'peers/done/{step}', json.dumps(verdict))
  else:
    verdict = json.loads(
        group.await_word(f'peers/done/{step}', f'a restore of step {step} from the peers', AGAIN))
  failed, hung = verdict['failed'], verdict['hung']
  if failed:
    if not have and not disk.stuck:  # a hung disk: the next restart removes it
      import shutil  # pylint: disable=import-outside-toplevel
      shutil.rmtree(work, ignore_errors=True)
    if hung:  # no falling back to a download: that host would hang in it
      raise CheckpointError(
          'E-CKPT-023', f'the restore of step {step} from the peers stopped: a disk hung on '
          f'process(es) {hung}: {verdict["hang"]}', 'check the disk of that host (a '
          'hung mount; its own process exits without the stuck thread), or its network where '
          'it hung reading the remote, then start every process again')
    raise CheckpointError(
        'E-CKPT-016', f'the restore of step {step} from the peers failed on process(es) '
        f'{failed}: {verdict["cause"]}', 'fix that host (its disk, its access to '
        'the remote) and restart the job: each part is checked again')
  return Restored(final, step, sources)


def _cause(problems: list[str]) -> str:
  """The problem that says why: a sender's own (its disk, the remote) before a receiver's failed
  check of what it was sent (`MISMATCH`), which follows from it; '' for none."""
  return next((p for p in problems if MISMATCH not in p), problems[0] if problems else '')


def _write_own(path: Path, got: bytes, want: Mapping[str, Any], step: int) -> None:
  """A checkpoint's own file as it was sent, written (atomically) only when its size and
  CRC-32 are the manifest's: a step directory already committed here is never given a bad one."""
  crc = f'{checksum.crc32(got):08x}'
  if (len(got), crc) != (want['size'], want['crc32']):
    raise CheckpointError(
        'E-CKPT-003', f'{path.name} of step {step}: {MISMATCH} its manifest (size '
        f'{len(got)}, crc32 {crc}; its manifest says {want["size"]}, {want["crc32"]})',
        'restart the job')
  atomic.write_file_durably(path, got)


def _commit(work: Path, final: Path, raw: bytes, seal: str, step: int) -> None:
  """A step directory built here (`work`) committed as `final`, its manifest (`raw`) last; where
  `final` is another commit of the step, swapped with it in one exchange, manifest included."""
  if manifest.seal_of(raw) != seal:
    raise CheckpointError('E-CKPT-003',
                          f'the manifest of step {step} sent by process 0: {MISMATCH} its '
                          'seal', 'restart the job')
  m = manifest.parse(work, raw)  # what came with it (the run state, the shard table) matches it
  bad = manifest.file_problems(work,
                               {**m, 'files': {r: m['files'][r] for r in holdings.own_files(m)}})
  if bad:
    raise CheckpointError('E-CKPT-003', f'step {step}: {MISMATCH} its manifest: {bad[0]}',
                          'restart the job')
  atomic.fsync_dir(work / layout.STATE_DIR)
  if final.exists():
    atomic.write_file_durably(work / layout.MANIFEST, raw)
    atomic.publish_dir(work, final)
    atomic.fsync_dir(final.parent)
    return
  atomic.publish_dir(work, final)
  atomic.fsync_dir(final.parent)
  atomic.write_file_durably(final / layout.MANIFEST, raw)  # the commit, last


def _read(path: Path) -> bytes:
  try:
    return path.read_bytes()
  except OSError:
    return b''


__all__ = ['META', 'Remote', 'Restored', 'held', 'restore_dir']
