"""`jaxckpt export` at its edges: an `--out` that is not an earlier export, a manifest that does
not match its seal, an `--out` that cannot be written, flags that do not apply to the format, and
a remote run whose newest checkpoint is damaged.

One tiny run (checkpoints at steps 5 and 10, mirrored to a `file://` path, exported at step 10 in
all three formats) serves the module; the damaging cases work on copies of it.
"""

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import TINY, call_cli
from safetensors.numpy import load_file

from jaxckpt.checkpoint.remote import Store, objects

STEP_5, STEP_10 = 'step_00000005', 'step_00000010'


@pytest.fixture(scope='module')
def run(trainer, tmp_path_factory):
  """(workdir, remote URL, remote root) of a 10-step run with checkpoints at steps 5 and 10."""
  root = tmp_path_factory.mktemp('remote') / 'run'
  workdir = tmp_path_factory.mktemp('run')
  r = trainer.train(workdir, '--config.train.steps=10', '--checkpoint_every=5', '--keep=0',
                    '--config.train.log_every=10', '--export_formats=safetensors,hf,bin',
                    f'--remote=file://{root}')
  assert r.returncode == 0, r.stderr
  assert sorted(os.listdir(workdir / 'exports')) == sorted(['step_000010.bin', STEP_10])
  return workdir, f'file://{root}', root


def tree(root: Path) -> dict[str, bytes | None]:
  """{relative path: bytes (None for a directory)} of everything under `root`."""
  out: dict[str, bytes | None] = {}
  for d, dirs, files in os.walk(root):
    for name in dirs:
      out[os.path.relpath(os.path.join(d, name), root)] = None
    for name in files:
      path = os.path.join(d, name)
      out[os.path.relpath(path, root)] = Path(path).read_bytes()
  return out


def refused(code, stdout, err, which: str, status: int = 2) -> None:
  """One line `jaxckpt: <which>: ...` on stderr, nothing on stdout, exit `status`."""
  assert code == status and not stdout, (code, stdout, err)
  assert err.startswith(f'jaxckpt: {which}: ') and err.count('\n') == 1, err


def export(source, fmt, out, capsys, *flags):
  return call_cli(['export', str(source), f'--format={fmt}', f'--out={out}', *flags], capsys)


# ------------------------------------------------------------------------ what --out replaces
@pytest.mark.parametrize('fmt', ['hf', 'safetensors'])
@pytest.mark.parametrize('what', ['workdir', 'checkpoint', 'exports', 'other_format'])
def test_an_out_directory_that_is_not_an_export_is_refused_untouched(run, tmp_path, capsys, fmt,
                                                                     what):
  workdir, _, _ = run
  copy = tmp_path / 'run'
  shutil.copytree(workdir, copy, symlinks=True)
  out = {
      'workdir': copy,
      'checkpoint': copy / 'checkpoints' / STEP_5,
      'exports': copy / 'exports',
      # an hf export for safetensors, a safetensors one (with its hf/) for hf
      'other_format': copy / 'exports' / STEP_10 / ('hf' if fmt == 'safetensors' else ''),
  }[what]
  before = tree(tmp_path)
  refused(*export(workdir / 'checkpoints' / STEP_10, fmt, out, capsys), 'E-EXPORT-007')
  assert tree(tmp_path) == before


def test_a_bin_out_that_is_not_a_bin_is_refused_untouched(run, tmp_path, capsys):
  workdir, _, _ = run
  notes = tmp_path / 'notes.bin'
  notes.write_text('mine\n')
  refused(*export(workdir / 'checkpoints' / STEP_10, 'bin', notes, capsys), 'E-EXPORT-007')
  assert os.listdir(tmp_path) == ['notes.bin'] and notes.read_text() == 'mine\n'
  earlier = tmp_path / 'earlier.bin'  # an earlier .bin export is replaced
  shutil.copy(workdir / 'exports' / 'step_000010.bin', earlier)
  code, _, err = export(workdir / 'checkpoints' / STEP_5, 'bin', earlier, capsys)
  assert code == 0, err
  assert int.from_bytes(earlier.read_bytes()[:4], 'little') == 5


def test_safetensors_replaces_an_earlier_export_whole_and_keeps_its_hf(run, tmp_path, capsys):
  """Onto a run's `exports/step_<n>/`: the new model.safetensors, the hf/ beside it as it was, and
  nothing else: not the optimizer file of the export before, not a crashed write's leftovers."""
  workdir, _, _ = run
  out = tmp_path / STEP_10
  shutil.copytree(workdir / 'exports' / STEP_10, out)
  hf_before = tree(out / 'hf')
  fresh = tmp_path / 'fresh'
  code, _, err = export(workdir / 'checkpoints' / STEP_5, 'safetensors', fresh, capsys)
  assert code == 0, err

  code, _, err = export(workdir / 'checkpoints' / STEP_5, 'safetensors', out, capsys, '--optimizer')
  assert code == 0, err
  assert sorted(os.listdir(out)) == ['hf', 'model.safetensors', 'optimizer.safetensors']
  (out / 'model.safetensors.tmp-0123456789ab').write_bytes(b'half')  # a crashed write's
  code, _, err = export(workdir / 'checkpoints' / STEP_5, 'safetensors', out, capsys)
  assert code == 0, err
  assert sorted(os.listdir(out)) == ['hf', 'model.safetensors']
  assert (out / 'model.safetensors').read_bytes() == (fresh / 'model.safetensors').read_bytes()
  assert tree(out / 'hf') == hf_before
  assert sorted(os.listdir(tmp_path)) == sorted([STEP_10, 'fresh'])  # no temporary left

  hf_out = out / 'hf'  # an earlier hf export is replaced
  code, _, err = export(workdir / 'checkpoints' / STEP_5, 'hf', hf_out, capsys)
  assert code == 0, err
  assert sorted(os.listdir(hf_out)) == ['config.json', 'model.safetensors']
  assert tree(hf_out) != hf_before


# ------------------------------------------------------------------------------- the seal
def test_a_manifest_that_does_not_match_its_seal_is_not_exported(run, tmp_path, capsys):
  workdir, _, _ = run
  ckpt = tmp_path / STEP_10
  shutil.copytree(workdir / 'checkpoints' / STEP_10, ckpt)
  raw = (ckpt / 'manifest.json').read_bytes()
  at = raw.index(b'"step": 10') + len(b'"step": 1')
  (ckpt / 'manifest.json').write_bytes(raw[:at] + b'1' + raw[at + 1:])  # '0' -> '1': one bit

  code, _, _ = call_cli(['verify', str(ckpt)], capsys)
  assert code == 1
  out = tmp_path / 'hf'
  code, stdout, err = export(ckpt, 'hf', out, capsys)
  refused(code, stdout, err, 'E-EXPORT-004', status=1)
  assert 'manifest.json: checksum mismatch' in err
  assert sorted(os.listdir(tmp_path)) == [STEP_10]


# ------------------------------------------------------------------ an --out not writable
@contextlib.contextmanager
def tmpfs(where: Path, size: str):
  """A tmpfs of `size` mounted at `where` (root only: skips elsewhere); unmounted afterwards."""
  where.mkdir()
  if os.geteuid() != 0:
    pytest.skip('mounting a filesystem takes root')
  r = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs',
                      str(where)],
                     capture_output=True,
                     text=True)
  if r.returncode != 0:
    pytest.skip(f'cannot mount a tmpfs here: {r.stderr.strip()}')
  try:
    yield where
  finally:
    subprocess.run(['umount', str(where)], check=True)


@contextlib.contextmanager
def read_only(where: Path):
  """`where`, made before, unwritable: a read-only remount of a tmpfs as root (permission bits do
  not stop root), a directory of mode 0555 otherwise."""
  if os.geteuid() == 0:
    with tmpfs(where, '16m'):
      yield where
  else:
    where.mkdir()
    yield where


def _seal(where: Path) -> None:
  if os.geteuid() == 0:
    subprocess.run(['mount', '-o', 'remount,ro', str(where)], check=True)
  else:
    where.chmod(0o555)


def _unseal(where: Path) -> None:
  if os.geteuid() == 0:
    subprocess.run(['mount', '-o', 'remount,rw', str(where)], check=True)
  else:
    where.chmod(0o755)


@pytest.mark.parametrize('fmt', ['bin', 'safetensors', 'hf'])
def test_an_out_that_cannot_be_written_is_one_line_and_leaves_all_as_it_was(
    run, tmp_path, capsys, fmt):
  workdir, _, _ = run
  ckpt = workdir / 'checkpoints' / STEP_10
  with read_only(tmp_path / 'ro') as ro:
    earlier = ro / ('earlier.bin' if fmt == 'bin' else 'earlier')
    if fmt == 'bin':
      shutil.copy(workdir / 'exports' / 'step_000010.bin', earlier)
    else:
      shutil.copytree(
          workdir / 'exports' / STEP_10 / ('hf' if fmt == 'hf' else ''),
          earlier,
          ignore=None if fmt == 'hf' else shutil.ignore_patterns('hf'))
    before = tree(ro)
    _seal(ro)
    try:
      name = 'x.bin' if fmt == 'bin' else 'x'
      for out in (ro / 'new' / 'deeper' / name, ro / name, earlier):
        code, stdout, err = export(ckpt, fmt, out, capsys)
        refused(code, stdout, err, 'E-EXPORT-007')
        assert str(out) in err
      assert tree(ro) == before
    finally:
      _unseal(ro)


@pytest.mark.parametrize('fmt', ['bin', 'safetensors', 'hf'])
def test_a_full_disk_is_one_line_and_leaves_nothing(run, tmp_path, capsys, fmt):
  workdir, _, _ = run
  with tmpfs(tmp_path / 'full', '256k') as full:  # the export is 0.5 to 1.6 MB
    out = full / 'new' / 'deeper' / ('x.bin' if fmt == 'bin' else 'x')
    code, stdout, err = export(workdir / 'checkpoints' / STEP_10, fmt, out, capsys)
    refused(code, stdout, err, 'E-EXPORT-008', status=1)
    assert str(out) in err and 'No space left on device' in err
    assert os.listdir(full) == []


# ------------------------------------------------------------------- formats and flags
def test_a_bin_exports_to_safetensors_or_hf_only(run, tmp_path, capsys):
  workdir, _, _ = run
  code, stdout, err = call_cli([
      'export',
      str(workdir / 'exports' / 'step_000010.bin'), '--format=bin', f'--config={TINY}',
      f'--out={tmp_path / "x.bin"}'
  ], capsys)
  refused(code, stdout, err, 'E-EXPORT-001')
  assert 'unknown' not in err and 'safetensors or hf' in err
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('fmt, flag', [('hf', '--optimizer'), ('bin', '--no-optimizer')])
def test_an_optimizer_flag_the_format_cannot_honour_is_refused(run, tmp_path, capsys, fmt, flag):
  workdir, _, _ = run
  out = tmp_path / ('x.bin' if fmt == 'bin' else 'x')
  refused(*export(workdir / 'checkpoints' / STEP_10, fmt, out, capsys, flag), 'E-USAGE-001')
  assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- remote runs
def test_a_remote_run_whose_newest_checkpoint_is_damaged_exports_the_next_intact_one(
    run, tmp_path, capsys):
  workdir, _, root = run
  copy = tmp_path / 'remote'
  shutil.copytree(root, copy)
  url = f'file://{copy}'
  store = Store(url)
  key = objects.object_key(store, 10, 'state/process_0.safetensors')
  data = bytearray(store.read(key))
  data[-5] ^= 0x10  # same size, one bit: only the CRC-32 of the download sees it
  store.write(key, bytes(data))

  out = tmp_path / 'st'
  code, stdout, err = export(url, 'safetensors', out, capsys)
  assert code == 0, err
  assert err.startswith('jaxckpt: passing over remote step 10: ') and 'E-STORE-012' in err, err
  assert stdout.startswith(f'exported {url} as safetensors to {out}'), stdout
  local = tmp_path / 'local'
  code, _, err = export(workdir / 'checkpoints' / STEP_5, 'safetensors', local, capsys)
  assert code == 0, err
  got, want = load_file(out / 'model.safetensors'), load_file(local / 'model.safetensors')
  assert sorted(got) == sorted(want) and all(got[k].tobytes() == want[k].tobytes() for k in got)


def test_export_of_a_checkpoint_url_names_the_url_as_given(run, tmp_path, capsys):
  _, url, _ = run
  source = f'{url}/checkpoints/{STEP_5}'
  out = tmp_path / 'hf'
  code, stdout, err = export(source, 'hf', out, capsys)
  assert code == 0, err
  assert stdout == f'exported {source} as hf to {out}\n'
