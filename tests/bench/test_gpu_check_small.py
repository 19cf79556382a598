import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_gpu_check_runs_at_reduced_size_on_cpu() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = ROOT / "bench" / "gpu_check.py"
    command = [sys.executable, str(script), "--small", "--steps", "1", "--warmup", "0"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=True)
    out = done.stdout
    for mode in ("off", "sync", "events"):
        assert f"cuda-timing {mode}" in out
    assert out.count("sync host") == 5  # every phase got an event time to compare
    assert "no GPU figures were measured" in out
