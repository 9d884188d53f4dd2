"""The package's shape: one-way imports, a checkpoint library that stands alone, short modules."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / 'jaxckpt'
LIBRARY = 'jaxckpt.checkpoint'
MAX_LINES = 450


def module_name(path: Path) -> str:
  parts = list(path.relative_to(REPO).with_suffix('').parts)
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
  """The jaxckpt modules `path` imports, wherever in the file (lazy imports count too)."""
  name = module_name(path)
  package = name if path.name == '__init__.py' else name.rpartition('.')[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        base = '.'.join(
            package.split('.')[:len(package.split('.')) - node.level + 1] +
            ([base] if base else []))
      targets = [base] + [f'{base}.{alias.name}' for alias in node.names]
    else:
      continue
    found |= {t for t in targets if t in modules}
  return found - {name}


def import_graph() -> dict[str, set[str]]:
  paths = {module_name(p): p for p in PACKAGE.rglob('*.py')}
  return {name: imports_of(path, set(paths)) for name, path in paths.items()}


def test_no_import_cycles():
  graph = import_graph()
  # A package importing its own submodules (`jaxckpt.cli` -> `jaxckpt.cli.parser`) is not a
  # cycle of concerns; everything else must flow one way.
  edges = {m: {t for t in ts if not t.startswith(m + '.')} for m, ts in graph.items()}
  state, cycles = {}, []

  def visit(node, stack):
    state[node] = 'open'
    for nxt in sorted(edges[node]):
      if state.get(nxt) == 'open':
        cycles.append(stack[stack.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = 'done'

  for node in sorted(edges):
    if node not in state:
      visit(node, [node])
  assert not cycles, f'import cycles: {cycles[:3]}'


def test_the_checkpoint_library_imports_nothing_of_the_trainer():
  outside = {(m, t) for m, ts in import_graph().items() if m.startswith(LIBRARY) for t in ts
             if not t.startswith(LIBRARY)}
  assert not outside, sorted(outside)


def test_modules_are_short_enough_to_read():
  long = {
      str(p.relative_to(REPO)): n
      for p in PACKAGE.rglob('*.py')
      if (n := len(p.read_text().splitlines())) > MAX_LINES
  }
  assert not long, long


# The trainer's rooms, from the top down. A module imports only from its own layer or the layers
# below it; `hosts` and `export` sit side by side and import nothing of each other.
LAYERS = (
    ('jaxckpt.main', 'jaxckpt.cli', 'jaxckpt.evaluate'),
    ('jaxckpt.train',),
    ('jaxckpt.hosts', 'jaxckpt.export'),
    ('jaxckpt.records',),
    ('jaxckpt.model',),
    ('jaxckpt.errors', 'jaxckpt.checkpoint'),
)


def room_of(module: str) -> tuple[int, str]:
  for rank, rooms in enumerate(LAYERS):
    for room in rooms:
      if module == room or module.startswith(room + '.'):
        return rank, room
  return -1, module  # the package itself (`jaxckpt/__init__.py`)


def test_imports_flow_one_way_through_the_rooms():
  """cli -> train -> hosts | export -> records -> model -> checkpoint, and never back up."""
  upward = []
  for module, targets in import_graph().items():
    rank, room = room_of(module)
    for target in targets:
      to_rank, to_room = room_of(target)
      if to_rank == -1 or rank == -1:
        continue
      if to_rank < rank or {room, to_room} == {'jaxckpt.hosts', 'jaxckpt.export'}:
        upward.append(f'{module} -> {target}')
  assert not upward, sorted(upward)


STANDALONE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from ckptlib import CheckpointManager, CheckpointOptions

state = {'w': jnp.arange(12.0).reshape(3, 4), 'step': jnp.int32(7), 'opt': (jnp.ones(5),)}
with CheckpointManager(sys.argv[1], CheckpointOptions(keep=2)) as mgr:
  for step in (1, 2, 3):
    mgr.save(step, state, run_state={'data_position': step})
mgr = CheckpointManager(sys.argv[1], writer=False)
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
restored, run_state = mgr.restore(mgr.latest_step(), target)
assert mgr.all_steps() == [2, 3] and run_state == {'step': 3, 'data_position': 3}
assert all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
           for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
assert not [m for m in sys.modules if m == 'jaxckpt' or m.startswith('jaxckpt.')]
print('standalone ok')
"""


def test_the_checkpoint_library_works_copied_out_of_the_package(tmp_path):
  """Copied into another project under another name, it saves and restores a pytree alone."""
  shutil.copytree(
      PACKAGE / 'checkpoint', tmp_path / 'ckptlib', ignore=shutil.ignore_patterns('__pycache__'))
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'XLA_FLAGS')}
  env.update(PYTHONPATH=str(tmp_path), JAX_PLATFORMS='cpu')
  r = subprocess.run(
      [sys.executable, '-c', STANDALONE, str(tmp_path / 'ckpt')],
      cwd=tmp_path,
      env=env,
      capture_output=True,
      text=True,
      timeout=120)
  assert r.returncode == 0 and 'standalone ok' in r.stdout, r.stderr[-3000:]
