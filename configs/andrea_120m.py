"""ANDREA-120M: 121.3M parameters (a 1.46 GB flat checkpoint with Adam m and v). Meant for a GPU.

    python -m jaxckpt.main --config=configs/andrea_120m.py --workdir=runs/andrea_120m
"""

from configs import default


def get_config():
  config = default.get_config()
  config.model.block_size = 1024
  config.model.n_layer = 12
  config.model.n_head = 12
  config.model.n_embd = 912  # 12 layers x 912 wide: 121,316,064 parameters
  config.model.dtype = 'bfloat16'
  config.train.steps = 50_000
  config.train.batch_size = 32
  config.train.lr = 3e-4
  config.train.warmup_steps = 1000
  config.train.log_every = 10
  config.checkpoint.every = 500
  return config
