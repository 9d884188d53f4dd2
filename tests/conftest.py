"""Shared fixtures. In-process tests see 8 forced CPU devices; subprocess tests choose their own.

Every `python -m jaxckpt.main` the tests start shares one persistent compilation cache, so each
distinct program compiles once per test session instead of once per subprocess.
"""

import os

# Before jax is imported anywhere: the in-process tests shard over 8 CPU devices.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
# Before transformers is imported: from_pretrained on a local directory, never the network.
os.environ['HF_HUB_OFFLINE'] = '1'
os.environ['TRANSFORMERS_OFFLINE'] = '1'

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / 'configs' / 'tiny.py')
TWO_SOURCES = str(REPO / 'tests' / 'configs' / 'two_sources.py')

# The files whose tests share a session-scoped run (STRAIGHT_*, TWO_PROCESS_FLAGS below) are run by
# one pytest-xdist worker, so that run is made once; every other file is a group of its own.
_GROUPS = {
    'test_resume': 'straight-runs',
    'test_elastic': 'straight-runs',
    'test_multihost_trainer': 'two-processes',
    'test_remote_multihost': 'two-processes',
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (`--dist loadgroup`)
def pytest_collection_modifyitems(config, items):
  """Each test in its file's xdist group: a file's tests run in one worker, in order, and its
  module-scoped fixtures run once."""
  for item in items:
    if item.get_closest_marker('xdist_group') is None:
      item.add_marker(pytest.mark.xdist_group(_GROUPS.get(item.path.stem, item.path.stem)))


@pytest.fixture(autouse=True)
def _one_process_job():
  """A test that ran the remote tier in this process (a `Parts` of a job of several, a trainer's
  `--remote_rate`) leaves the process's request pacing as a one-process job's again."""
  yield
  from jaxckpt.checkpoint.remote import pacing
  pacing.share(processes=1, per_s='auto')


@pytest.fixture(scope='session')
def compile_cache(tmp_path_factory) -> Path:
  """The JAX compilation cache of the whole run, shared by the xdist workers (the processes of a
  multi-process test share it the same way)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # the run's directory, above the worker's own
  path = root / 'jax-cache'
  path.mkdir(exist_ok=True)
  return path


def subprocess_env(cache: Path, devices: int = 1, **extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if not k.startswith(('JAX', 'XLA'))}
  env.update(
      JAX_COMPILATION_CACHE_DIR=str(cache),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='-1',
      JAX_PLATFORMS='cpu',
      PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get('PYTHONPATH')) if p))
  if devices > 1:
    env['XLA_FLAGS'] = f'--xla_force_host_platform_device_count={devices}'
  env.update(extra)
  return env


class TrainerCommand:
  """Runs `python -m jaxckpt.main` on the tiny config as a real subprocess."""

  def __init__(self, cache: Path):
    self.cache = cache

  def command(self, workdir, *flags: str) -> list[str]:
    config = [] if any(f.startswith('--config=') for f in flags) else [f'--config={TINY}']
    return [sys.executable, '-m', 'jaxckpt.main', *config, f'--workdir={workdir}', *flags]

  def train(self,
            workdir,
            *flags: str,
            devices: int = 1,
            env: dict | None = None,
            timeout: float = 300,
            cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        self.command(workdir, *flags),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(self.cache, devices, **(env or {})))

  def start(self,
            workdir,
            *flags: str,
            devices: int = 1,
            env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        self.command(workdir, *flags),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(self.cache, devices, **(env or {})))


@pytest.fixture(scope='session')
def trainer(compile_cache) -> TrainerCommand:
  return TrainerCommand(compile_cache)


def jaxckpt_cli(*args: str,
                cache: Path | None = None,
                cwd=REPO,
                timeout: float | None = 120) -> subprocess.CompletedProcess:
  """Runs `python -m jaxckpt.cli ARGS...` as a real subprocess: with the shared compilation
  cache and its own devices when `cache` is given, else in this process's environment."""
  return subprocess.run([sys.executable, '-m', 'jaxckpt.cli', *args],
                        cwd=cwd,
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                        env=None if cache is None else subprocess_env(cache))


@contextlib.contextmanager
def mounted_tmpfs(path: Path, size: str):
  """A fresh tmpfs of `size` (`8k`, `1m`) mounted at `path` (made here), unmounted afterwards;
  the test is skipped where mounting needs root."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  path.mkdir(exist_ok=True)
  subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)], check=True)
  try:
    yield path
  finally:
    subprocess.run(['umount', '-l', str(path)], check=False)


def committed_steps(workdir) -> list[int]:
  root = Path(workdir) / 'checkpoints'
  if not root.is_dir():
    return []
  return sorted(
      int(p.name[5:])
      for p in root.iterdir()
      if p.name.startswith('step_') and p.name[5:].isdigit() and (p / 'manifest.json').is_file())


def wait_for(predicate,
             proc: subprocess.Popen | None = None,
             timeout: float = 300.0,
             every: float = 0.05) -> None:
  """Poll until `predicate()` holds; fail if the process (if any) ends first or time runs out.

  Every 50 ms: a tighter poll competes with the trainer for the machine's 2 cores.
  """
  deadline = time.monotonic() + timeout
  while not predicate():
    if proc is not None and proc.poll() is not None:
      raise AssertionError(f'trainer exited ({proc.returncode}) first:\n{proc.stdout.read()}')
    if time.monotonic() > deadline:
      if proc is not None:
        proc.kill()
      raise AssertionError('timed out waiting')
    time.sleep(every)


def read_arrays(step_dir) -> dict[str, np.ndarray]:
  """Every array of a checkpoint, read without jaxckpt: `safetensors.numpy` for the state file,
  numpy for the first format (arrays.bin + index.json), else orbax."""
  state = Path(step_dir) / 'state'
  files = sorted(state.glob('*.safetensors'))
  if files:
    from safetensors.numpy import load_file
    return {k: v for f in files for k, v in load_file(f).items()}
  if (state / 'index.json').exists():
    index = json.loads((state / 'index.json').read_text())['arrays']
    return {
        name:
            np.fromfile(
                state / 'arrays.bin',
                dtype=np.dtype(a['dtype']),
                count=int(np.prod(a['shape'])),
                offset=a['offset']).reshape(a['shape']) for name, a in index.items()
    }
  import orbax.checkpoint as ocp
  restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(state)
  return {k: np.asarray(v) for k, v in restored.items()}


def checkpoint_arrays(workdir, step: int) -> dict[str, np.ndarray]:
  """Every array of the run's checkpoint of `step`."""
  return read_arrays(Path(workdir) / 'checkpoints' / f'step_{step:08d}')


def assert_same_bytes(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert sorted(a) == sorted(b)
  different = [k for k in a if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]
  assert not different, f'{len(different)} arrays differ, e.g. {different[:3]}'


def read_events(workdir) -> list[dict]:
  from jaxckpt.records.runlog import read_jsonl
  from jaxckpt.records.workdir import EVENTS
  return read_jsonl(Path(workdir) / EVENTS)


def events_of(workdir, name: str) -> list[dict]:
  """The run's events named `name`, in order."""
  return [e for e in read_events(workdir) if e['event'] == name]


def losses(workdir) -> dict[int, float]:
  """{step: loss} of the run's loss history (the newest segment's value of a replayed step)."""
  from jaxckpt.records.runlog import read_loss_history
  return {step: row['loss'] for step, row in read_loss_history(workdir).items()}


def state_file(step_dir) -> Path:
  """The single state file of a checkpoint: `state/*.safetensors` (or the first format's)."""
  state = Path(step_dir) / 'state'
  return next(iter(sorted(state.glob('*.safetensors'))), state / 'arrays.bin')


def flip_a_data_byte(step_dir) -> None:
  """Damage a checkpoint's tensor data the way a bad disk would: same size, one bit different."""
  path = state_file(step_dir)
  with open(path, 'r+b') as f:
    # 5000 bytes into the data: past a safetensors file's header (its first 8 bytes + length).
    at = 5000 + (8 + int.from_bytes(f.read(8), 'little') if path.suffix == '.safetensors' else 0)
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0x10]))


def call_cli(argv, capsys):
  """(exit code, stdout, stderr) of a `jaxckpt` subcommand, run in-process as the command runs it."""
  from jaxckpt import cli
  try:
    code = cli.main(argv)
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err


def tiny_config(**fields):
  """configs/tiny.py with `fields` ('train.lr': 5e-4) changed, as a flag would."""
  from jaxckpt.records import provenance
  config = provenance.load_config_file(TINY)
  for name, value in fields.items():
    *parents, leaf = name.split('.')
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config


def hf_logits(hf_dir, tokens: np.ndarray) -> np.ndarray:
  """The logits of the Hugging Face GPT-2 directory `hf_dir` for `tokens`, read by transformers:
  every weight found, nothing left over, float32."""
  import torch
  from transformers import GPT2LMHeadModel
  model, info = GPT2LMHeadModel.from_pretrained(hf_dir, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'], info
  assert model.dtype == torch.float32
  model.eval()
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.numpy()


# ------------------------------------------------------- a small sharded state, in-process
@pytest.fixture(scope='module')
def mesh():
  """All 8 forced CPU devices as a (data 4, model 2) mesh."""
  import jax
  from jax.sharding import Mesh
  return Mesh(np.asarray(jax.devices()).reshape(4, 2), ('data', 'model'))


def make_state(mesh, seed: int = 0) -> dict:
  """A small train state on `mesh`: sharded params, and an optimizer state with a scalar count,
  Adam-like moments sharded as the params and a bfloat16 leaf on one device."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  w = jax.device_put(
      jax.random.normal(jax.random.key(seed), (8, 16)), NamedSharding(mesh, P('data', 'model')))
  b = jax.device_put(jnp.arange(16, dtype=jnp.float32), NamedSharding(mesh, P('model')))
  opt = (jnp.int32(7), {'mu': {'w': w * 2, 'b': b * 2},
                        'nu': {'w': w * 3, 'b': b * 3}}, jnp.ones(3, jnp.bfloat16))
  return {'params': {'w': w, 'b': b}, 'opt_state': opt}


def abstract(tree):
  """A restore target for `tree`: each leaf's shape, dtype and sharding."""
  import jax
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


# Object storage servers on loopback, for the remote tier: moto's S3 server and a GCS emulator.
def free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class S3Server:
  """moto's S3 server in this process; `bucket()` makes a fresh bucket and returns its URL."""

  def __init__(self):
    from moto.server import ThreadedMotoServer
    self.port = free_port()
    self.endpoint = f'http://127.0.0.1:{self.port}'
    self.env = {
        'AWS_ENDPOINT_URL': self.endpoint, 'AWS_ACCESS_KEY_ID': 'testing',
        'AWS_SECRET_ACCESS_KEY': 'testing', 'AWS_REGION': 'us-east-1'
    }
    os.environ.update(self.env)
    self._server = ThreadedMotoServer(ip_address='127.0.0.1', port=self.port, verbose=False)
    self._server.start()
    self._count = 0

  def client(self):
    import boto3
    return boto3.client('s3', endpoint_url=self.endpoint, region_name='us-east-1')

  def bucket(self, prefix: str = 'run') -> str:
    self._count += 1
    name = f'bucket-{self._count}'
    self.client().create_bucket(Bucket=name)
    return f's3://{name}/{prefix}'

  def stop(self) -> None:
    """Down like a dead server: its socket closed, so connections are refused."""
    self._server.stop()
    self._server._server.server_close()  # stop() leaves the listening socket open

  def start(self) -> None:
    from moto.server import ThreadedMotoServer
    self._server = ThreadedMotoServer(ip_address='127.0.0.1', port=self.port, verbose=False)
    self._server.start()


@pytest.fixture(scope='session')
def s3_server():
  server = S3Server()
  yield server
  server.stop()


class GcsServer:
  """gcp-storage-emulator in this process, in memory; `bucket()` as for `S3Server`."""

  def __init__(self):
    from gcp_storage_emulator.server import create_server
    self.port = free_port()
    self.env = {'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{self.port}'}
    os.environ.update(self.env)
    self._server = create_server('127.0.0.1', self.port, in_memory=True)
    self._server.start()
    self._count = 0

  def bucket(self, prefix: str = 'run') -> str:
    import urllib.request
    self._count += 1
    name = f'bucket-{self._count}'
    request = urllib.request.Request(
        f'http://127.0.0.1:{self.port}/storage/v1/b',
        data=json.dumps({'name': name}).encode(),
        headers={'Content-Type': 'application/json'},
        method='POST')
    urllib.request.urlopen(request).read()
    return f'gs://{name}/{prefix}'


@pytest.fixture(scope='session')
def gcs_server():
  server = GcsServer()
  yield server
  server._server.stop()


# ------------------------------------------- several jax.distributed processes on this machine
def start_processes(argv_of,
                    count: int,
                    *,
                    cache: Path,
                    devices: int = 1,
                    env: dict | None = None) -> list[subprocess.Popen]:
  """`count` real processes of one jax.distributed job: `argv_of(process_id, coordinator)` is
  each one's command line (its coordinator '127.0.0.1:PORT' is a free port here). Output is
  captured (stdout and stderr together)."""
  coordinator = f'127.0.0.1:{free_port()}'
  base = subprocess_env(cache, devices, **(env or {}))
  return [
      subprocess.Popen(
          argv_of(k, coordinator),
          cwd=REPO,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          text=True,
          env=base) for k in range(count)
  ]


def finish_processes(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
  """[(exit code, output)] of each process once all have ended; past `timeout` every one still
  running is killed and the test fails (a hang is a failure, never a wait)."""
  deadline = time.monotonic() + timeout
  out = []
  for p in procs:
    try:
      text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise AssertionError(f'process {procs.index(p)} still running after {timeout} s: '
                           f'{p.communicate()[0][-3000:]}')
    out.append((p.returncode, text))
  return out


def start_trainers(cache: Path,
                   workdir,
                   count: int,
                   *flags: str,
                   env: dict | None = None) -> list[subprocess.Popen]:
  """`count` processes of one `python -m jaxckpt.main` job on the tiny config; `workdir` may
  name each process's own ('DIR/host{k}'); `env` is added to their environment."""
  return start_processes(
      lambda k, coordinator: [
          sys.executable, '-m', 'jaxckpt.main', f'--config={TINY}',
          f'--workdir={str(workdir).format(k=k)}', *flags, f'--coordinator_address={coordinator}',
          f'--num_processes={count}', f'--process_id={k}'
      ],
      count,
      cache=cache,
      env=env)


def train_all(cache: Path, workdir, count: int, *flags: str, timeout: float = 240):
  """`start_trainers`, each process's (exit code, output) once all have exited 0."""
  results = finish_processes(start_trainers(cache, workdir, count, *flags), timeout=timeout)
  for k, (code, out) in enumerate(results):
    assert code == 0, f'process {k} exited {code}:\n{out[-3000:]}'
  return results


def remote_steps(store) -> list[int]:
  """The steps committed in a remote store ([] while it cannot be listed)."""
  from jaxckpt.checkpoint.remote import StoreError, objects  # pylint: disable=import-outside-toplevel
  try:
    return sorted(objects.committed(store))
  except StoreError:
    return []


# ------------------------------- straight runs several files compare against, made once a session
# The tiny config trained STRAIGHT_STEPS steps in one go: tests/test_resume.py and
# tests/test_elastic.py compare their stopped and continued runs with it.
STRAIGHT_STEPS = 80
STRAIGHT_FLAGS = (f'--config.train.steps={STRAIGHT_STEPS}', '--checkpoint_every=10',
                  '--config.train.log_every=10', '--keep=0')
STRAIGHT_MESHES = {1: (), 8: ('--config.mesh.data=4', '--config.mesh.model=2')}


class StraightRuns:
  """`runs[devices]`: the workdir of a run of STRAIGHT_FLAGS on `devices` devices (mesh
  STRAIGHT_MESHES[devices]), trained the first time a test asks for it. Shared by every test of
  the session: read it only (a test that changes one works on a shutil.copytree of it)."""

  def __init__(self, trainer: TrainerCommand, tmp_path_factory):
    self._trainer, self._tmp, self._runs = trainer, tmp_path_factory, {}

  def __getitem__(self, devices: int) -> Path:
    if devices not in self._runs:
      workdir = self._tmp.mktemp(f'straight{devices}')
      r = self._trainer.train(workdir, *STRAIGHT_FLAGS, *STRAIGHT_MESHES[devices], devices=devices)
      assert r.returncode == 0, r.stderr
      self._runs[devices] = workdir
    return self._runs[devices]


@pytest.fixture(scope='session')
def straight_runs(trainer, tmp_path_factory) -> StraightRuns:
  return StraightRuns(trainer, tmp_path_factory)


# 2 processes of one job on one workdir, the tiny config trained 60 steps in one go:
# tests/test_multihost_trainer.py and tests/test_remote_multihost.py compare with it.
TWO_PROCESS_FLAGS = ('--config.train.steps=60', '--checkpoint_every=5',
                     '--config.train.log_every=5')


@pytest.fixture(scope='session')
def straight_two_processes(tmp_path_factory, compile_cache) -> tuple[Path, list[tuple[int, str]]]:
  """(workdir, [(exit code, output)] of each process) of TWO_PROCESS_FLAGS on 2 processes. Shared
  by every test of the session: read it only (copy it with shutil.copytree to change it)."""
  workdir = tmp_path_factory.mktemp('straight-2-processes')
  return workdir, train_all(compile_cache, workdir, 2, *TWO_PROCESS_FLAGS)
