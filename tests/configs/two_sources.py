"""The tiny config with two data sources, `main` and `extra` (its files set by a flag)."""

import ml_collections

from configs import tiny


def get_config():
  config = tiny.get_config()
  config.data.sources = ml_collections.ConfigDict({'main': ('embedded',), 'extra': ('embedded',)})
  config.bandit.floor = 0.1
  config.bandit.ceiling = 0.9
  return config
