"""jaxckpt: a sharded JAX/Flax GPT trainer built around a preemption-safe checkpoint manager."""

__version__ = '0.1.0'
