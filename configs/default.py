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
  # Named sources -> their files, in order (text, uint16 .bin shards, memory-mapped; globs like
  # 'data/train_*.bin'; or 'embedded': the corpus shipped with jaxckpt). A flag may give
  # `"--config.data.sources.main='data/a.bin,data/b.bin'"` (quoted twice). With several sources
  # the bandit picks the source of each batch.
  config.data.sources = ml_collections.ConfigDict({'main': ('embedded',)})
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
  # Steps dispatched to the devices and not yet done, at most (0: no bound). 2 keeps the devices
  # busy and a stop signal honoured within two step times (docs/preemption.md).
  config.train.max_steps_in_flight = 2
  config.train.eval_every = 0  # steps between held-out evaluations (0: off)
  config.train.eval_batches = 4  # held-out batches per evaluation
  config.train.guard_finite = False  # refuse to commit a checkpoint holding NaN/inf
  config.train.tensorboard = True  # also write the scalars as event files in <workdir>/tensorboard
  config.train.init_from = ''  # safetensors file with dotted names (an export) to start from
  config.train.frozen = ()  # globs over dotted parameter names never updated, e.g. ('wte.*',)
  # On a GPU, reductions that add in the same order every run (--xla_gpu_deterministic_ops), which
  # a resume needs to continue bit-identical to a run never stopped; they cost an H200 25% of
  # andrea_120m's step time (docs/accelerators.md). False trades exact resumes for that speed.
  config.train.deterministic = True

  config.bandit = ml_collections.ConfigDict()
  config.bandit.floor = 0.05  # least probability of any source
  config.bandit.ceiling = 0.95  # most probability of any source
  config.bandit.floors = ml_collections.ConfigDict()  # per-source floors (name -> value)
  config.bandit.ceilings = ml_collections.ConfigDict()  # per-source ceilings (name -> value)
  config.bandit.gamma = 0.1  # EXP3 uniform exploration
  config.bandit.eta = 0.05  # EXP3 learning rate on centred rewards
  config.bandit.ema = 0.9  # smoothing of per-source loss and reward
  config.bandit.update_every = 10  # steps between reward updates (one host sync each)

  config.samples = ml_collections.ConfigDict()
  config.samples.every = -1  # steps between samples (-1: checkpoint.every, off when auto; 0: off)
  config.samples.count = 3  # samples per round
  config.samples.length = 48  # new bytes per sample
  config.samples.prompt = 'The '  # what each sample starts from
  config.samples.temperature = 0.8  # softmax temperature
  config.samples.keep = 5  # rounds kept in samples.json

  config.mesh = ml_collections.ConfigDict()
  config.mesh.data = -1  # devices on the data axis (-1: all that remain)
  config.mesh.model = 1  # devices on the model axis (tensor parallelism)

  config.checkpoint = ml_collections.ConfigDict()
  # Steps between checkpoints (0: off), or 'auto': Young-Daly from the measured cost of a
  # checkpoint and the run's interruptions (docs/cadence.md). The last step saves too.
  config.checkpoint.every = ml_collections.FieldReference(100, field_type=object)  # int or 'auto'
  config.checkpoint.secs = 0.0  # seconds between checkpoints (0: off)
  config.checkpoint.epochs = 0  # also save when every N-th epoch of the training data ends (0: off)
  # auto: the prior mean time between interruptions (90s, 15m, 6h, 30d), until the run's own
  # history outweighs it; 6h is the geometric middle of what preemptible machines see.
  config.checkpoint.mtbi = ml_collections.FieldReference('6h', field_type=object)
  config.checkpoint.min_secs = 0.0  # auto: the shortest interval (0: none but durability)
  config.checkpoint.max_secs = 0.0  # auto: the longest interval (0: none)
  config.checkpoint.mode = 'auto'  # async | sync | auto (async when a host copy fits in memory)
  config.checkpoint.keep = 3  # newest checkpoints kept (0: all)
  config.checkpoint.keep_every = 0  # steps divisible by this are kept forever (0: off)
  config.checkpoint.keep_best = 0  # also keep the N of lowest held-out loss (see train.eval_every)
  config.checkpoint.storage = 'auto'  # safetensors (1 file per process) | orbax; auto: safetensors
  config.checkpoint.staging = 'auto'  # host | device (a 2nd copy in device memory) | auto
  # The durable tier (docs/remote.md): s3://bucket/prefix, gs://bucket/prefix or a
  # path on a mounted disk. Each local commit is uploaded in the background (manifest last); a
  # fresh machine with an empty workdir resumes from there ('': off).
  config.checkpoint.remote = ''
  # Each host's own disk (--remote set): also keep this many other processes' parts (the peer tier)
  config.checkpoint.replicas = 0
  # Which checkpoints are uploaded: every K-th, or 'auto' (every one; with replicas and
  # every='auto', K from Daly for the failures the peers cannot cover: docs/many-hosts.md).
  config.checkpoint.remote_every = ml_collections.FieldReference('auto', field_type=object)
  # replicas + auto: mean time between losses of the whole job (or of R+1 neighbouring hosts)
  config.checkpoint.remote_mtbi = ml_collections.FieldReference('3d', field_type=object)
  config.checkpoint.remote_lease_secs = 60.0  # a writer's lease not renewed this long is taken over
  config.checkpoint.remote_lease = 'on'  # on | off: one writer per prefix (off: not enforced)
  # The whole job's requests a second to the store, split evenly over its processes: 'auto' (the
  # store's documented per-prefix limits x 0.9: S3 3,150 writes/4,950 reads, GCS 900/4,500),
  # 'off', or a number (writes and reads each).
  config.checkpoint.remote_rate = ml_collections.FieldReference('auto', field_type=object)
  config.checkpoint.stop_grace_secs = 25.0  # after a stop signal: time to make the last one durable

  # Exports under <workdir>/exports/, written from a checkpoint's host copy after it commits.
  config.export = ml_collections.ConfigDict()
  config.export.every = 1000  # steps: first checkpoint at/after each multiple, + last step (0: off)
  config.export.formats = 'safetensors,hf'  # comma list of safetensors, hf, bin (12 bytes/param)
  config.export.keep = 2  # newest exported steps kept (0: all)
  config.export.optimizer = False  # also write optimizer.safetensors (Adam m, v) with safetensors
  return config
