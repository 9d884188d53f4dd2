"""`jaxckpt verify` on a run that is still training: retention deletes, writers commit, mid-read.

The deterministic tests make a real writer (a `CheckpointManager`) commit, delete or replace a
checkpoint at one chosen moment of a reader's work, by wrapping the one function the reader calls
at that moment. The end-to-end test runs `jaxckpt verify` against the tiny trainer with `--keep=1`.
"""

import shutil

import jax.numpy as jnp
import pytest
from conftest import call_cli, committed_steps, jaxckpt_cli, wait_for

from jaxckpt.checkpoint import CheckpointManager, CheckpointOptions, discovery, layout, manifest


def state(value: float):
  return {'w': jnp.full((64, 32), value, jnp.float32), 'b': jnp.arange(32, dtype=jnp.float32)}


@pytest.fixture
def live(tmp_path):
  """A run's checkpoints directory with steps 1 and 2, and its writer (keep=2, still open)."""
  root = tmp_path / 'run' / 'checkpoints'
  mgr = CheckpointManager(root, CheckpointOptions(keep=2, mode='sync'))
  for step in (1, 2):
    mgr.save(step, state(step))
  yield root, mgr
  mgr.close()


def once(monkeypatch, module, name, when, act, *, after=False):
  """Wrap `module.name` so that `act()` runs once, the first time `when(*args)` holds: before
  the real call, or `after` it (then the caller gets what was true before `act`)."""
  real, fired = getattr(module, name), []

  def wrapped(*args, **kwargs):
    due = not fired and when(*args)
    if due:
      fired.append(True)
      if not after:
        act()
    out = real(*args, **kwargs)
    if due and after:
      act()
    return out

  monkeypatch.setattr(module, name, wrapped)
  return fired


def under(step_dir):
  return lambda path, *_: step_dir in path.parents


# ---------------------------------------------------------- removed while being read
@pytest.mark.parametrize('moment', ['after the listing', 'while reading its files'])
def test_a_checkpoint_retention_deletes_under_verify_is_skipped_not_failed(
    live, monkeypatch, capsys, moment):
  root, mgr = live
  step_1, step_2, step_3 = (root / layout.step_dirname(s) for s in (1, 2, 3))
  commit_3 = lambda: mgr.save(3, state(3))  # keep=2: retention then deletes step 1
  if moment == 'after the listing':
    fired = once(monkeypatch, discovery, '_step_dirs', lambda *_: True, commit_3, after=True)
  else:
    fired = once(monkeypatch, manifest, 'crc32_file', under(step_1), commit_3)
  code, out, err = call_cli(['verify', str(root.parent)], capsys)
  assert fired and not step_1.exists()
  assert 'Traceback' not in err and 'FAIL' not in out, out + err
  assert code == 0, out + err
  lines = out.splitlines()
  assert f'SKIP {step_1}: removed while it was being verified' in out
  # Looked again: the checkpoint whose commit removed it is verified too.
  assert f'OK {step_2}' in lines and f'OK {step_3}' in lines


def test_a_checkpoint_replaced_under_verify_is_verified_again(live, monkeypatch, capsys):
  """A resumed run replays a step and swaps its new checkpoint in while verify reads the old."""
  root, mgr = live
  step_2 = root / layout.step_dirname(2)

  def rewrite_2():  # the run's one writer
    mgr.save(2, state(-2.0))  # other values: the old manifest's checksums no longer hold

  fired = once(monkeypatch, manifest, 'crc32_file', under(step_2), rewrite_2)
  code, out, err = call_cli(['verify', str(root.parent)], capsys)
  assert fired and 'Traceback' not in err
  assert code == 0 and f'OK {step_2}' in out.splitlines(), out + err


def test_damage_under_a_live_reader_still_fails(live, monkeypatch, capsys):
  """Looking again is for a checkpoint that went away; one still there and damaged fails."""
  root, _ = live
  step_1 = root / layout.step_dirname(1)
  data = step_1 / layout.RUN_STATE
  fired = once(monkeypatch, manifest, 'crc32_file', under(step_1),
               lambda: data.write_bytes(data.read_bytes()[:-2]))
  code, out, _ = call_cli(['verify', str(root.parent)], capsys)
  assert fired and code == 1
  assert f'FAIL {step_1}: {layout.RUN_STATE}: ' in out  # size or checksum: when it was cut


def test_a_named_checkpoint_removed_under_verify_is_not_a_failure(live, monkeypatch, capsys):
  root, mgr = live
  step_1 = root / layout.step_dirname(1)
  fired = once(monkeypatch, manifest, 'crc32_file', under(step_1), lambda: mgr.save(3, state(3)))
  code, out, err = call_cli(['verify', str(step_1)], capsys)
  assert fired and not out and code == 2, out + err
  assert err.startswith(f'jaxckpt: E-CKPT-010: {step_1} was removed while it was being verified')
  assert err.count('\n') == 1


def test_inspect_of_a_checkpoint_removed_before_its_manifest_is_read(live, monkeypatch, capsys):
  root, mgr = live
  step_1 = root / layout.step_dirname(1)
  once(
      monkeypatch,
      discovery,
      'checkpoint_dir',
      lambda *_: True,
      lambda: mgr.save(3, state(3)),
      after=True)
  code, out, err = call_cli(['inspect', str(step_1)], capsys)
  assert code == 2 and not out and err.count('\n') == 1
  assert err.startswith(f'jaxckpt: E-CKPT-010: {step_1} was removed while it was being read')


# ------------------------------------------------------------------- being written
def test_a_checkpoint_being_written_is_skip_and_exit_0(tmp_path, capsys):
  """The writer renames step_<n>.tmp-* to step_<n>, then writes manifest.json: in between."""
  root = tmp_path / 'run' / 'checkpoints'
  with CheckpointManager(root, CheckpointOptions(mode='sync')) as mgr:
    mgr.save(1, state(1))
  writing = root / layout.step_dirname(1)
  (writing / layout.MANIFEST).unlink()  # the run's first checkpoint, its manifest not yet there
  code, out, err = call_cli(['verify', str(root.parent)], capsys)
  assert code == 0 and not err, out + err
  [line] = out.splitlines()
  assert line.startswith(f'SKIP {writing}: not committed (no manifest.json): being written')
  with CheckpointManager(root, CheckpointOptions(mode='sync', keep=0)) as mgr:
    mgr.save(2, state(2))  # (the writer's start removes the manifest-less step 1 as debris)
  shutil.copytree(root / layout.step_dirname(2), writing)
  (writing / layout.MANIFEST).unlink()
  code, out, _ = call_cli(['verify', str(root.parent)], capsys)
  assert code == 0 and f'OK {root / layout.step_dirname(2)}' in out and f'SKIP {writing}' in out


def test_a_checkpoint_committed_during_the_scan_is_verified(live, monkeypatch, capsys):
  root, mgr = live
  step_3 = root / layout.step_dirname(3)

  def half_commit_3():
    mgr.save(3, state(3))
    (step_3 / layout.MANIFEST).rename(root.parent / 'manifest-3')  # not yet written, as listed

  def finish_3():
    (root.parent / 'manifest-3').rename(step_3 / layout.MANIFEST)

  once(monkeypatch, discovery, '_step_dirs', lambda *_: True, half_commit_3)
  once(monkeypatch, manifest, 'crc32_file', under(root / layout.step_dirname(2)), finish_3)
  code, out, _ = call_cli(['verify', str(root.parent)], capsys)
  assert code == 0 and f'OK {step_3}' in out.splitlines() and 'SKIP' not in out, out


# ----------------------------------------------------------------------- end to end
def test_verify_a_live_run_with_keep_1(trainer, compile_cache, tmp_path):
  """`jaxckpt verify WORKDIR` while the trainer commits every 2 steps and keeps one checkpoint."""
  workdir = tmp_path / 'run'
  proc = trainer.start(workdir, '--config.train.steps=100000', '--checkpoint_every=2', '--keep=1')
  try:
    wait_for(lambda: committed_steps(workdir), proc, timeout=240)
    results, seen = [], set()
    for _ in range(30):  # before the fix, about one in six failed
      r = jaxckpt_cli('verify', str(workdir), cache=compile_cache, timeout=60)
      results.append(r)
      seen.update(line.split()[1] for line in r.stdout.splitlines() if line.startswith('OK '))
      assert r.returncode == 0 and 'Traceback' not in r.stderr and 'FAIL' not in r.stdout, \
          f'run {len(results)}: rc {r.returncode}\n{r.stdout}{r.stderr}'
    assert proc.poll() is None, 'the trainer stopped: the verifies did not race a live writer'
  finally:
    proc.kill()
    proc.wait()
  assert len(seen) > 1, seen  # the run moved on between the verifies: a live run was read
