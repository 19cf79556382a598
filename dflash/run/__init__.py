"""The life of a training run, built from the parts below it.

lifecycle  start (placement, output folder, process group), build, resume, save, summary
reference  the single-threaded reference loop
pipelined  training with the pipeline: replicas, checkpoints, failures, signals
replicas   the model objects of each device
checkpoint atomic checkpoints and exact resume
offline    the offline jobs of a run's config (`cache-hidden`)
progress   progress bar, start-up lines and the summary
estimate   memory and FLOPs of one step from the shapes (`--dry-run`)
"""
