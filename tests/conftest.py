import os

# Tests run on 2-core machines, often beside other work: one intra-op thread per
# process keeps torch from oversubscribing the cores (children inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
