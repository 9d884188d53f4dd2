"""Edges of the many-host helpers (`jaxckpt.hosts`): timeouts that cannot work are refused with
one line, what other processes post is never trusted to parse, a RAM-disk workdir is seen as one,
and a process leaving a failed start names the ones it did not hear from."""

import json
import logging
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY, finish_processes, mounted_tmpfs, start_processes

from jaxckpt.checkpoint import multihost, peers
from jaxckpt.checkpoint.remote import partial
from jaxckpt.errors import UsageError
from jaxckpt.hosts import distributed, joining, peer_start, stepwatch


# ------------------------------------------------------------------------------- the heartbeat
@pytest.mark.parametrize('value', [0.1, 0.5, 0.999])
def test_a_heartbeat_timeout_below_the_1_s_floor_is_refused(value):
  with pytest.raises(UsageError) as e:
    distributed.initialize(heartbeat_timeout_seconds=value)  # no job flags: one process
  line = e.value.line()
  assert e.value.code == 'E-CONFIG-004' and f'--heartbeat_timeout_secs={value:g}' in line, line
  assert 'floor of 1 s' in line and 'pass 1 s or more' in line, line
  assert distributed.current().count == 1


def test_a_heartbeat_timeout_of_1_s_or_more_is_taken_and_other_timeouts_have_no_floor():
  joining.check_timeouts(
      heartbeat_timeout_secs=1.0, init_timeout_secs=0.1, barrier_timeout_secs=0.1)
  distributed.initialize(heartbeat_timeout_seconds=1.0)


# ------------------------------------------------------------------------------- the step watch
@pytest.mark.parametrize('value, shown', [(math.inf, 'inf'), (math.nan, 'nan'),
                                          (-math.inf, '-inf')])
def test_a_step_timeout_that_is_no_finite_time_is_refused(value, shown):
  with pytest.raises(UsageError) as e:
    stepwatch.check(value)
  line = e.value.line()
  assert e.value.code == 'E-CONFIG-004' and f'--step_timeout_secs={shown} ' in line, line
  assert 'leave it out' in line, line


def test_a_step_timeout_left_out_or_finite_is_taken():
  stepwatch.check(None)  # the default: max(600, 50 x the median step)
  stepwatch.check(0.5)
  stepwatch.check(86400.0)


# ---------------------------------------------------- each process's sources of a peer restore
GOOD = {'own': 10, 'peers': 20, 'remote': 0}


def _resume(monkeypatch, posted: list[str] | None, count: int = 2):
  """`peer_start.resume_point` on process 0 of `count`, the restore itself faked, the values
  `posted` as what the processes posted: the run object it fills in."""

  class Group:

    def __init__(self, timeout_secs):
      self.count = count

    def collect(self, name, what, payload, **_):
      return posted

  got = SimpleNamespace(step=5, sources=dict(GOOD), path=Path('/nowhere/5'))
  monkeypatch.setattr(multihost, 'Group', Group)
  monkeypatch.setattr(peers, 'restore_dir', lambda *a, **k: got)
  monkeypatch.setattr(partial, 'peer_source', lambda *a, **k: None)
  run = SimpleNamespace(
      store=SimpleNamespace(url='mem://x'),
      start_step=None,
      leader=True,
      fetched=None,
      restored=None,
      replicas=1)
  assert peer_start.resume_point(run, Path('/nowhere'), None, 10.0) == got.path
  return run


@pytest.mark.parametrize(
    'posted, says', [
        (['x', json.dumps(GOOD)], "process 0 posted 'x'"),
        ([json.dumps(GOOD)], '1 value(s) posted by 2 processes'),
        ([json.dumps(GOOD)] * 3, '3 value(s) posted by 2 processes'),
        ([json.dumps(GOOD), json.dumps({**GOOD, 'peers': -1})], 'process 1 posted'),
        ([json.dumps(GOOD), json.dumps({'own': 1, 'peers': 2})], 'process 1 posted'),
        ([json.dumps(GOOD), json.dumps({**GOOD, 'own': 1.5})], 'process 1 posted'),
        ([json.dumps(GOOD), json.dumps({**GOOD, 'own': True})], 'process 1 posted'),
        ([json.dumps(GOOD), json.dumps([1, 2, 3])], 'process 1 posted'),
        ([json.dumps(GOOD), '[' * 100_000], 'process 1 posted'),
    ],
    ids=['not-json', 'short', 'long', 'negative', 'missing', 'float', 'bool', 'list', 'deep'])
def test_sources_posted_malformed_are_left_out_with_one_warning(monkeypatch, caplog, posted, says):
  with caplog.at_level(logging.WARNING):
    run = _resume(monkeypatch, posted)
  assert run.restored is None  # the `resumed` event goes without `sources`
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warned) == 1 and says in warned[0] and 'sources' in warned[0], warned


def test_sources_posted_well_are_the_events(monkeypatch):
  run = _resume(monkeypatch, [json.dumps(GOOD), json.dumps({'own': 0, 'peers': 7, 'remote': 3})])
  assert run.restored['step'] == 5 and run.restored['processes'] == [
      GOOD, {'own': 0, 'peers': 7, 'remote': 3}
  ]


# ------------------------------------------------------------------------------ a RAM workdir
def _mount_kind(path: str) -> str | None:
  with open('/proc/mounts', encoding='utf-8') as f:
    kinds = [line.split()[2] for line in f if line.split()[1] == path]
  return kinds[-1] if kinds else None


@pytest.mark.skipif(
    not os.path.exists('/proc/mounts') or _mount_kind('/dev/shm') != 'tmpfs',
    reason='/dev/shm is no tmpfs mount point here')
def test_a_workdir_that_is_the_ram_disk_itself_is_checked_against_memory():
  assert peer_start._on_ram(Path('/dev/shm'))  # pylint: disable=protected-access
  assert peer_start._on_ram(Path('/dev/shm/run'))  # pylint: disable=protected-access
  with pytest.raises(UsageError) as e:
    peer_start.check(
        1,
        remote=object(),
        shared=False,
        count=2,
        workdir=Path('/dev/shm'),
        part_bytes=10**18,
        keep=1)
  assert e.value.code == 'E-CONFIG-010' and '--workdir=/dev/shm is in memory' in e.value.line()


@pytest.fixture
def small_ram_disk(tmp_path):
  """A 1 MiB tmpfs mounted at tmp_path/ram (needs root)."""
  with mounted_tmpfs(tmp_path / 'ram', '1m') as ram:
    yield ram


def _ram_check(workdir: Path, part_bytes: int, keep: int = 1) -> None:
  peer_start.check(
      1, remote=object(), shared=False, count=2, workdir=workdir, part_bytes=part_bytes, keep=keep)


def test_a_ram_disk_is_checked_against_its_own_size_less_the_checkpoints_it_holds(small_ram_disk):
  _ram_check(small_ram_disk / 'run', 200_000)  # 2 parts x 2 checkpoints: 0.8 MB of 1 MiB
  with pytest.raises(UsageError) as e:  # 1.2 MB: more than the mount holds, memory or not
    _ram_check(small_ram_disk / 'run', 300_000)
  assert e.value.code == 'E-CONFIG-010' and 'free in its mount (tmpfs size=)' in e.value.line()
  # A restart: the checkpoint it keeps (--keep=1) is in the mount already, and counts once.
  older = small_ram_disk / 'run' / 'checkpoints' / 'step_00000001'
  older.mkdir(parents=True)
  (older / 'manifest.json').write_text('{}')
  (older / 'part').write_bytes(bytes(350_000))
  newest = older.with_name('step_00000002')
  newest.mkdir()
  (newest / 'manifest.json').write_text('{}')
  (newest / 'part').write_bytes(bytes(350_000))
  _ram_check(small_ram_disk / 'run', 160_000)  # 0.64 MB, 0.35 MB of it there, 0.33 MB free
  # The older one (kept by --keep_every, say) is not rotated out: it does not count.
  with pytest.raises(UsageError):
    _ram_check(small_ram_disk / 'run', 200_000)  # 0.8 MB, 0.35 MB of it there, 0.33 MB free


def test_keep_all_on_a_ram_disk_is_refused(small_ram_disk):
  with pytest.raises(UsageError) as e:
    _ram_check(small_ram_disk, 1, keep=0)
  assert e.value.code == 'E-CONFIG-010' and '--keep=0 keeps every checkpoint' in e.value.line()


# ----------------------------------------------------------------- leaving a failed start
class _Exited(Exception):
  pass


class _Client:
  """The key-value store as `joining.leave` uses it: what was set, and a blocking read that
  times out (at once, here) on a key nobody set."""

  def __init__(self, keys: dict[str, str]):
    self.keys = dict(keys)

  def key_value_set(self, key, value, allow_overwrite=False):
    self.keys[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.keys:
      raise RuntimeError(f'DEADLINE_EXCEEDED: {key} after {timeout_ms} ms')
    return self.keys[key]


def _leave(monkeypatch, keys: dict[str, str], count: int = 3, index: int = 0) -> int:
  client = _Client(keys)
  cluster = SimpleNamespace(client=lambda: client, index=index, count=count)

  def exit_(code):
    raise _Exited(code)

  monkeypatch.setattr(os, '_exit', exit_)
  monkeypatch.setattr(joining, '_jax_shutdown', lambda: None)
  with pytest.raises(_Exited) as e:
    joining.leave(cluster, 'gone', 2)
  return e.value.args[0]


def test_leaving_names_the_processes_that_never_said_they_were_leaving(monkeypatch, capsys):
  assert _leave(monkeypatch, {'gone/2': 'gone'}) == 2  # process 1 never says so
  err = capsys.readouterr().err
  assert 'jaxckpt: process(es) [1] of 3 did not say they were leaving within 30 s' in err, err


def test_leaving_when_all_said_so_says_nothing(monkeypatch, capsys):
  assert _leave(monkeypatch, {'gone/0': 'gone', 'gone/2': 'gone'}, index=1) == 2
  assert 'did not say' not in capsys.readouterr().err


# ------------------------------------------------------------------ the same data on every host
def test_hosts_with_different_training_data_are_refused_at_start(tmp_path, compile_cache):
  """Every process builds the same global batch from its own copy of the data: two hosts whose
  files differ would train on a batch no one meant, and write manifests that differ."""
  for k in range(2):
    (tmp_path / f'data{k}.txt').write_text('the same words on both hosts\n' * 200 + f'but {k}\n')

  def argv(k, coordinator):
    return [
        sys.executable, '-m', 'jaxckpt.main', f'--config={TINY}', f'--workdir={tmp_path / "w"}',
        '--config.train.steps=2', f'--config.data.sources.main=("{tmp_path}/data{k}.txt",)',
        f'--coordinator_address={coordinator}', '--num_processes=2', f'--process_id={k}'
    ]

  results = finish_processes(start_processes(argv, 2, cache=compile_cache), timeout=240)
  for code, out in results:
    assert code == 1, out[-2000:]
    assert 'E-DIST-008' in out and 'the training data' in out, out[-2000:]
  assert not list((tmp_path / 'w').glob('checkpoints/step_*'))
