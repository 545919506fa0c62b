"""Base configuration: every field the trainer reads, one comment each.

Model files (gpt_micro, gpt_tiny, gpt_small, gpt_1b, gpt_8b, gpt_70b) are small overlays on
this one. Override any field on the command line: ``--config.train.steps=100``.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.workdir = "runs/default"  # metrics.jsonl, checkpoints, tokenizer and token cache go here
  c.dry_run = False  # print per-device memory and flops of the step (nothing allocated), stop

  c.model = ml_collections.ConfigDict()
  c.model.factory = "models.gpt:model_spec"  # "module:function": config -> ntp_jax.model.ModelSpec
  c.model.init_from = ""  # "" = random init; "hf:/path/to/folder" = local Hugging Face Llama folder
  c.model.vocab_size = 4096  # vocabulary (BPE trained to this size on text corpora)
  c.model.d_model = 256  # residual width
  c.model.n_layers = 4  # decoder blocks
  c.model.n_heads = 8  # query heads
  c.model.n_kv_heads = 4  # key/value heads (grouped-query attention)
  c.model.head_dim = 32  # features per head
  c.model.d_ff = 768  # SwiGLU hidden width
  c.model.rope_theta = 500_000.0  # RoPE base (Llama 3)
  c.model.norm_eps = 1e-5  # RMSNorm epsilon
  c.model.ffn_granularity = 1  # MLP columns per shard unit
  c.model.vocab_granularity = 1  # vocabulary rows per shard unit
  c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
  # Parameter storage; with bfloat16 the optimizer keeps fp32 master weights and moments
  c.model.param_dtype = "float32"
  c.model.tie_embeddings = False  # output head = embedding table transposed (no separate head)
  c.model.scan_layers = True  # decoder blocks under jax.lax.scan: compile time flat in depth
  # Rematerialisation per block: none | full | dots_saveable | dots_with_no_batch_dims_saveable
  c.model.remat = "none"

  c.mesh = ml_collections.ConfigDict()
  c.mesh.tp = 8  # slots per TP group (devices per scale-up domain)
  c.mesh.dp = 1  # DP replicas

  c.ntp = ml_collections.ConfigDict()
  c.ntp.failed = ""  # failed slots: "3", "3,5" (replica 0) or replica:slot pairs "0:2,1:5"
  c.ntp.slot_weights = ""  # per-slot relative speeds, "1,1,0.5,..." (empty: equal)
  # Batch shares: proportional (~ TP degree; the global batch shrinks with failures), constant
  # (the healthy batch spread ~ TP degree: failures leave every step's sequences unchanged),
  # or equal
  c.ntp.rebalance = "proportional"
  c.ntp.fail_at = ""  # failures while training: "STEP@REPLICA:SLOT", "20.mid@0:3" inside the step
  c.ntp.repair_at = ""  # repairs while training: "STEP@REPLICA:SLOT"
  c.ntp.recovery = "live"  # live (state from DP peers) or restart (last checkpoint)
  # Compile the plans one more failure or repair can reach, in the background: next_failure,
  # none, or auto (next_failure on GPU/TPU; none on CPU, where compiling takes the step's cores)
  c.ntp.precompile = "auto"
  c.ntp.precompile_max_programs = 256  # programs compiled ahead per plan change (0: no bound)
  c.ntp.precompile_max_host_gb = 8.0  # stop compiling ahead past this host-memory growth (0: none)

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200  # optimizer steps
  c.train.seed = 0  # parameter init and data order
  c.train.batch_size = 16  # sequences per step of the healthy job (see ntp.rebalance)
  # Micro-batches of a healthy replica's share (gradient accumulation): lower activation memory,
  # the same step. Other replicas run as many as keep theirs no larger.
  c.train.microbatches = 1
  c.train.seq_len = 128  # tokens per sequence
  c.train.lr = 3e-3  # peak learning rate
  c.train.min_lr_ratio = 0.1  # final learning rate / peak (cosine decay)
  c.train.warmup_steps = 20  # linear warmup steps
  # Learning-rate schedule length in steps (0: train.steps). Set it to the final step count when
  # a run is trained in parts (100 steps, then resumed to 150), so that each part follows one curve.
  c.train.schedule_steps = 0
  c.train.b1 = 0.9  # Adam beta1
  c.train.b2 = 0.95  # Adam beta2
  c.train.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only)
  c.train.clip_norm = 1.0  # global gradient-norm clip
  # Optimizer state: replicated (every replica holds all of its shards' state), zero1 (the
  # Adam moments and float32 master weights split over the replicas of each peer group, ZeRO-1)
  # or zero2 (also each micro-batch's gradient reduce-scattered at once, ZeRO-2)
  c.train.optimizer_sharding = "replicated"
  c.train.optimizer_copies = 1  # zero*: replicas holding each piece (1..mesh.dp; 2+ survive a loss)
  c.train.log_every = 10  # progress line every N steps
  c.train.eval_every = 50  # validation loss every N steps and at the end (0 = off)
  c.train.eval_sequences = 32  # held-out sequences in the validation loss (a fixed set)
  c.train.tensorboard = False  # also metrics as TensorBoard event files in WORKDIR/tensorboard
  c.train.plot = True  # WORKDIR/goodput.png at the end: the whole run across resumes, events marked

  c.checkpoint = ml_collections.ConfigDict()
  # Steps between checkpoints (also one at the end and on SIGTERM/SIGINT); 0 = off.
  c.checkpoint.every = 50
  c.checkpoint.keep = 2  # newest checkpoints kept
  c.checkpoint.dir = ""  # empty: WORKDIR/checkpoints
  c.checkpoint.resume = True  # continue from the latest checkpoint in checkpoint.dir, this plan

  c.distributed = ml_collections.ConfigDict()
  # Several processes (jax.distributed). All empty: one process, or the cluster's own settings
  # (SLURM, Open MPI) when it runs several; python -m ntp_jax.launch sets them for one machine.
  c.distributed.coordinator = ""  # host:port of process 0
  c.distributed.num_processes = 0  # processes in the job (0: from the launcher or the cluster)
  c.distributed.process_id = -1  # this process's index (-1: from the launcher or the cluster)
  c.distributed.processes_per_domain = 1  # consecutive processes forming one scale-up domain
  c.distributed.heartbeat_timeout_s = 30.0  # a silent process is lost after this; others stop
  # The survivors write the last completed step as a checkpoint within this many seconds
  # before they stop (a just-in-time checkpoint); 0: off
  c.distributed.jit_checkpoint_s = 60.0
  # The survivors go on training with their replicas instead of stopping (JAX's
  # jax_enable_recoverability; docs/multihost.md says what it needs and cannot survive)
  c.distributed.recoverable = False
  # Recoverable CPU jobs: seconds a collective waits for its peers before the step raises and
  # is thrown away (gloo); 0: 2 x heartbeat_timeout_s, at least 10 (docs/multihost.md)
  c.distributed.collective_timeout_s = 0.0
  # JAX's coordination service runs outside the workers (python -m ntp_jax.coordinator; the
  # launcher sets this itself), so that process 0 can be lost like any other
  c.distributed.external_coordinator = False
  # The devices this process drives (jax.distributed's local_device_ids): "" JAX's choice
  # (every device it sees; under SLURM or Open MPI on GPU only the one of its local rank),
  # "all" every device it sees (srun --gpus-per-task=1 binds one; a process per node sees its
  # node's), or ids "0,1,2,3" (docs/multihost.md)
  c.distributed.local_device_ids = ""

  c.compile = ml_collections.ConfigDict()
  # JAX's persistent compilation cache (a restart loads its programs): a folder, "none", or ""
  # (JAX_COMPILATION_CACHE_DIR when set, else WORKDIR/compile_cache)
  c.compile.cache_dir = ""

  c.data = ml_collections.ConfigDict()
  c.data.path = ""  # text file / folder / glob, or uint16 .bin tokens; empty: Python stdlib source
  c.data.max_corpus_bytes = 4_000_000  # bytes of text read (tokenizer training and packing)
  c.data.val_fraction = 0.02  # share of sequences held out for validation (end of the stream)
  return c
