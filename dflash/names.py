"""Span and attribute names of a training run, in one place (docs/design.md §5).

The code, the tests and the dashboard's test read them from here. Attribute keys are
namespaced `dflash.*`, except the registered OpenTelemetry conventions (`thread.*`).
"""

from __future__ import annotations

# --- spans: one trace per batch ------------------------------------------------------
BATCH = "batch"  # root, started by the prefetcher, ended after the drafter step
DATA_BATCH = "data.batch"  # the prefetcher building the batch (the prefetch track's slices)
BATCH_QUEUE_WAIT = "batch_queue.wait"
TARGET_FORWARD = "target.forward"
TARGET_READ = "target.read"  # in place of target.forward when training from a hidden cache
HS_QUEUE_WAIT = "hs_queue.wait"
HS_QUEUE_PUT = "hs_queue.put"  # a target thread blocked on a full hs_queue: drafter-bound
DRAFTER_STEP = "drafter.step"
# A streamed run's engine (--target-engine vllm): one sample from its vLLM call to its
# file in the spool, times the engine recorded, under the target.read that took it.
ENGINE_SAMPLE = "engine.sample"
ANCHOR_SELECTION = "drafter.anchor_selection"
BLOCK_PREDICTION = "drafter.block_prediction"
LOSS = "drafter.loss"
BACKWARD = "drafter.backward"
OPTIMIZER = "drafter.optimizer"
DRAFTER_PHASES = (ANCHOR_SELECTION, BLOCK_PREDICTION, LOSS, BACKWARD, OPTIMIZER)
# Between backward and optimizer when replicas or ranks combine gradients; its children
# tell a replica waiting for the others of its process from the reduction itself (which,
# across ranks, includes waiting for the slowest rank).
GRAD_SYNC = "drafter.grad_sync"
GRAD_SYNC_WAIT = "drafter.grad_sync.wait"
GRAD_SYNC_REDUCE = "drafter.grad_sync.reduce"
GRAD_SYNC_PHASES = (GRAD_SYNC, GRAD_SYNC_WAIT, GRAD_SYNC_REDUCE)
# Traces of their own, outside any batch.
CHECKPOINT_SAVE = "checkpoint.save"
EVAL = "eval"
EVAL_WALK = "eval.walk"  # the serving walk on a logged step (dflash.eval.walk)
# The run's start-up: one trace, before the first batch.
RUN_STARTUP = "run.startup"
RUN_RESUME = "run.resume"  # reading and checking the --resume checkpoint
TARGET_LOAD = "target.load"  # loading (or first preparing) the target
DATA_PREPARE = "data.prepare"  # reading, tokenizing and packing the data
DATA_REGENERATE = "data.regenerate"  # the embedded default's regenerated text (cached)
DRAFTER_BUILD = "drafter.build"  # the drafter, its trainer and their replicas
STARTUP_PHASES = (RUN_RESUME, TARGET_LOAD, DATA_PREPARE, DATA_REGENERATE, DRAFTER_BUILD)
_PER_BATCH = (
    BATCH,
    DATA_BATCH,
    BATCH_QUEUE_WAIT,
    TARGET_FORWARD,
    TARGET_READ,
    ENGINE_SAMPLE,
    HS_QUEUE_PUT,
    HS_QUEUE_WAIT,
)
_OUTSIDE_BATCHES = (CHECKPOINT_SAVE, EVAL, EVAL_WALK, RUN_STARTUP, *STARTUP_PHASES)
SPANS = (*_PER_BATCH, DRAFTER_STEP, *DRAFTER_PHASES, *GRAD_SYNC_PHASES, *_OUTSIDE_BATCHES)

# --- what a stage thread is doing when it fails or stalls (no span, no statistics) ------
BATCH_QUEUE_PUT = "batch_queue.put"
DRAFTER_BOOKKEEPING = "drafter.bookkeeping"  # progress, logged figures, checkpoints

# --- attribute keys --------------------------------------------------------------------
STEP = "dflash.step"
BATCH_ID = "dflash.batch.id"
SAMPLE_INDEX = "dflash.sample.index"  # engine.sample: the n-th sample the run reads
TOKENS = "dflash.tokens"
QUEUE_DEPTH = "dflash.queue.depth"
DEVICE = "dflash.device"
GRAD_BYTES = "dflash.grad_sync.bytes"  # the gradients reduced, in bytes
WORLD_SIZE = "dflash.world_size"
RANK = "dflash.rank"
ABANDONED = "dflash.batch.abandoned"
THREAD_NAME = "thread.name"
THREAD_ID = "thread.id"
# On logged steps (every --log-every), on the drafter.step span.
METRIC_LOSS = "dflash.loss"
METRIC_TAU_ESTIMATE = "dflash.tau_estimate"
METRIC_GRAD_NORM = "dflash.grad_norm"
METRIC_LR = "dflash.lr"
METRIC_ACCURACY = "dflash.accuracy_per_position"
# On the drafter.step spans of the steps a --torch-profile window records.
PROFILE_FILE = "dflash.profile.file"
