"""ANDREA-12M: 12.8M parameters (a 154 MB flat checkpoint with Adam m and v).

    python -m jaxckpt.main --config=configs/andrea_12m.py --workdir=runs/andrea_12m
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.block_size = 256
  config.model.n_layer = 6
  config.model.n_head = 8
  config.model.n_embd = 416  # 6 layers x 416 wide: 12,812,800 parameters
  config.train.steps = 5000
  config.train.batch_size = 32
  config.train.lr = 6e-4
  config.train.warmup_steps = 200
  config.train.log_every = 10
  config.checkpoint.every = 100  # aligned with sample_every, as in the ANDREA runs
  return config
