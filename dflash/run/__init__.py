"""The life of a training run, built from the parts below it.

One entry point, read top to bottom: `dflash-train train` calls
`pipelined.run_training(cfg)`: `start_run` (rank, devices, the folder's lock), the
telemetry, then `run_pipeline`: `wiring.wire_run` (`build_run`, the drafter replicas, the
stages), `Pipeline.run`, where every step ends in `bookkeeping.StepBookkeeping.after_step`,
and `outcome.end_training` (`finish`: the final checkpoint, evaluation and summary).
`run_pipeline` alone is the same run without telemetry (tests, benches);
`reference.train_reference` is the single-threaded loop the pipeline is tested against,
with the same start, build, `after_step` and finish.

start      where a process stands in a run (placement, output folder, process group)
folder     the output folder's lock and files; outputs: whose file a path is
build      target, data, drafter and trainer of a run (`open_target`, shared by cache-hidden)
rows       the training rows (`training_rows`), refused before step 1 when they cannot train
resume     --resume from a checkpoint and --init-from a drafter, checked before the target
features   where the target's features come from (`feature_plan`), one source each in
           target_features (the live target), cached_features (--hidden-cache) and
           streamed_features (a vLLM engine, run by streamed, through a spool)
finish     checkpoints, the final evaluation and the summary (engine: --eval-engine vllm)
evaluations  τ while training (--eval-every)
reference  the single-threaded reference loop
pipelined  training with the pipeline: `run_training` and `run_pipeline`
wiring     a built run wired into the pipeline's stages
bookkeeping  what each step leaves behind: step count, metrics, progress, checkpoints
outcome    how a pipelined run ends: a failed stage, a stop signal, or the finish
replicas   the model objects of each device
checkpoint atomic checkpoints and exact resume
offline    the offline jobs of a run's config (`cache-hidden`); inspect: `inspect-data`
progress   progress bar, start-up lines and the summary
estimate   memory and FLOPs of one step from the shapes (`--dry-run`)
size_checks  the sizes refused before any model loads (positions, memory, layers)
"""
