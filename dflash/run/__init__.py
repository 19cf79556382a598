"""The life of a training run, built from the parts below it.

start      where a process stands in a run (placement, output folder, process group)
build      target, data, drafter and trainer of a run (`open_target`, shared by cache-hidden)
rows       the training rows (`training_rows`), refused before step 1 when they cannot train
resume     --resume from a checkpoint and --init-from a drafter, checked before the target
finish     checkpoints, the final evaluation and the summary
reference  the single-threaded reference loop
pipelined  training with the pipeline: replicas, checkpoints, failures, signals
replicas   the model objects of each device
checkpoint atomic checkpoints and exact resume
offline    the offline jobs of a run's config (`cache-hidden`)
progress   progress bar, start-up lines and the summary
estimate   memory and FLOPs of one step from the shapes (`--dry-run`)
"""
