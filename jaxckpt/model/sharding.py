"""The device mesh and the rules that place logical axes on it.

The mesh has two axes: `data` (the batch is split over it; parameters are replicated) and
`model` (wide parameter dimensions are split over it, Megatron style). A config asks for
`mesh.data` x `mesh.model` devices; -1 in one of them means "all the remaining devices".
"""

from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt.errors import ConfigError

# Logical axis -> mesh axis. Dimensions named here shard over `model`; `embed` stays whole so
# each matmul needs at most one all-reduce.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ('batch', 'data'),
    ('vocab', 'model'),
    ('qkv', 'model'),
    ('heads', 'model'),
    ('mlp', 'model'),
    ('embed', None),
    ('pos', None),
    ('norm', None),
)


def mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, int]:
  """`(data, model)` for `mesh.data` x `mesh.model` on `n_devices`: each axis a positive count,
  or -1 (one axis at most) for what the other leaves; E-CONFIG-002 naming the axis otherwise."""
  data, model = int(mesh_cfg.data), int(mesh_cfg.model)
  for axis, size in (('data', data), ('model', model)):
    if size < -1 or size == 0:
      raise ConfigError(
          'E-CONFIG-002', f'mesh.{axis}={size} is not a device count',
          f'set --config.mesh.{axis} to a positive number of devices, or -1 for all the devices '
          'the other axis leaves (on one axis at most)')
  if data == -1 and model == -1:
    raise ConfigError('E-CONFIG-002', 'mesh.data and mesh.model are both -1',
                      'set at most one of them to -1')
  if -1 in (data, model):
    axis, size = ('model', model) if data == -1 else ('data', data)
    if n_devices % size:
      raise ConfigError(
          'E-CONFIG-002', f'mesh.{axis}={size} does not divide the {n_devices} device(s) '
          f'that mesh.{"data" if axis == "model" else "model"}=-1 shares out',
          f'set --config.mesh.{axis} to {_divisors(n_devices)}, or both axes explicitly')
    return (n_devices // size, size) if data == -1 else (size, n_devices // size)
  if data * model > n_devices:
    raise ConfigError('E-CONFIG-002', f'mesh {data}x{model} does not fit {n_devices} device(s)',
                      f'choose mesh.data * mesh.model <= {n_devices}')
  return data, model


def _divisors(n: int) -> str:
  divisors = [d for d in range(1, n + 1) if n % d == 0]
  listed = f' ({", ".join(map(str, divisors))})' if len(divisors) <= 12 else ''
  return f'a divisor of {n}{listed}'


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  data, model = mesh_shape(mesh_cfg, len(devices))
  return Mesh(np.asarray(devices[:data * model]).reshape(data, model), ('data', 'model'))


def shardings_for(abstract_boxed_tree, mesh: Mesh):
  """NamedShardings for a tree whose leaves carry logical axis names (flax `Partitioned`)."""
  logical = nn.get_partition_spec(abstract_boxed_tree)
  return nn.logical_to_mesh_sharding(logical, mesh, LOGICAL_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P('data', None))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_divisible(model_cfg, batch_size: int, mesh: Mesh) -> None:
  """Fail early, naming the field, when a sharded dimension does not split evenly."""
  n_model, n_data = mesh.shape['model'], mesh.shape['data']
  checks = [('model.n_embd * 3 (qkv)', 3 * model_cfg.n_embd, n_model),
            ('model.n_embd', model_cfg.n_embd, n_model),
            ('model.vocab_size', model_cfg.vocab_size, n_model),
            ('train.batch_size', batch_size, n_data)]
  for field, value, parts in checks:
    if value % parts:
      raise ConfigError('E-CONFIG-003', f'{field}={value} does not split over {parts} devices',
                        f'make it a multiple of {parts} or change mesh.*')
