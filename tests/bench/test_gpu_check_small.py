import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_gpu_check_runs_at_reduced_size_on_cpu() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--small", "--steps", "1",
         "--warmup", "0"],
        env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    out = done.stdout
    for mode in ("off", "sync", "events"):
        assert f"cuda-timing {mode}" in out
    assert out.count("sync host") == 5  # every phase got an event time to compare
    assert "no GPU figures were measured" in out
