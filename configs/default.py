"""Defaults shared by every config; each config file starts from these and changes a few fields.

    python -m jaxckpt.main --config=configs/tiny.py --workdir=runs/tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # initialises the parameters and picks every batch

  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = 256  # byte-level tokens
  config.model.block_size = 64  # context length (positions)
  config.model.n_layer = 2  # transformer blocks
  config.model.n_head = 2  # attention heads per block
  config.model.n_embd = 64  # residual width
  config.model.tie_embeddings = False  # share wte with the output head (GPT-2 ties them)
  config.model.dtype = 'float32'  # compute dtype: float32 or bfloat16 (params stay float32)

  config.data = ml_collections.ConfigDict()
  config.data.paths = ('embedded',)  # text files, uint16 .bin files, or 'embedded'
  config.data.heldout_fraction = 0.05  # tail of the tokens kept for evaluation

  config.train = ml_collections.ConfigDict()
  config.train.steps = 300  # optimizer steps in the whole run
  config.train.batch_size = 16  # sequences per step (global, split over the data axis)
  config.train.lr = 1e-3  # peak learning rate
  config.train.warmup_steps = 30  # linear warmup from 0 to lr
  config.train.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio at the last step
  config.train.weight_decay = 0.1  # adamw decay on matrices (not biases or norms)
  config.train.b1 = 0.9  # adam beta1
  config.train.b2 = 0.999  # adam beta2
  config.train.grad_clip = 1.0  # global-norm clipping
  config.train.log_every = 50  # steps between progress lines
  config.train.eval_every = 0  # steps between held-out evaluations (0: off)
  config.train.eval_batches = 4  # held-out batches per evaluation

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # devices on the data axis (-1: all that remain)
  config.mesh.model = 1  # devices on the model axis (tensor parallelism)

  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every = 100  # steps between checkpoints (0: off); the last step always saves
  config.checkpoint.secs = 0.0  # seconds between checkpoints (0: off)
  config.checkpoint.mode = 'auto'  # async | sync | auto (async when a host copy fits in memory)
  config.checkpoint.keep = 3  # newest checkpoints kept (0: all)
  config.checkpoint.keep_every = 0  # steps divisible by this are kept forever (0: off)
  return config
