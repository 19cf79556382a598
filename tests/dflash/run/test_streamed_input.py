"""`train --target-engine vllm`: bad input is one `Error:` line, exit 2, before any model
loads (the project's own venv has no vLLM: the engine never starts here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

from dflash.cli import cli
from dflash.offline.spool import Spool
from dflash.run.streamed import Engine, engine_env, rank_batches, rank_files


def _train_error(tmp_path: Path, *args: str) -> str:
    done = CliRunner().invoke(
        cli,
        [
            "train",
            "--target-engine",
            "vllm",
            "--packing",
            "docs",
            "--steps",
            "1",
            "--output-dir",
            str(tmp_path / "run"),
            *args,
        ],
    )
    assert done.exit_code == 2, done.output
    errors = [line for line in done.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in done.output, done.output
    return errors[0]


def test_bad_streaming_input_is_one_line_before_any_model_loads(tmp_path: Path) -> None:
    python = sys.executable  # this venv has no vLLM
    assert subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0
    assert "has no vLLM" in _train_error(tmp_path, "--vllm-python", python)
    assert "needs --vllm-python" in _train_error(tmp_path)
    small = _train_error(tmp_path, "--vllm-python", python, "--spool-size", "1KiB")
    assert "--spool-size 1KiB" in small and "smaller than one sample" in small
    assert "not a size" in _train_error(tmp_path, "--spool-size", "lots")
    blocker = tmp_path / "file"
    blocker.write_text("")
    spool = ["--vllm-python", python, "--spool-dir", str(blocker / "spool")]
    assert "is not writable" in _train_error(tmp_path, *spool)
    held = Spool(tmp_path / "held")
    try:
        used = ["--vllm-python", python, "--spool-dir", str(tmp_path / "held")]
        assert "in use by another run" in _train_error(tmp_path, *used)
    finally:
        held.close()
    assert "--packing must be docs" in _train_error(tmp_path, "--packing", "concat")


def test_the_engines_own_error_line_names_why_it_ended(tmp_path: Path) -> None:
    # The extraction script's last words on a full disk (its `except` prints the OSError
    # as one line), after pages of vLLM's own log: the run's line carries them.
    said = "Error: OSError: [Errno 28] No space left on device (vLLM's log is above)"
    script = (
        "import sys\n"
        "for _ in range(500): print('INFO vllm ' + 'x' * 200)\n"
        f"print({said!r}, file=sys.stderr)\n"
        "sys.exit(1)\n"
    )
    log = tmp_path / "vllm-extract.log"
    engine = Engine([sys.executable, "-c", script], log)
    engine.process.wait(60)
    why = engine.error()
    assert why is not None and why.startswith("the vLLM engine exited with code 1 "), why
    assert "(OSError: [Errno 28] No space left on device (vLLM's log is above))" in why, why
    assert why.endswith(f"see {log}"), why
    engine.stop()  # ended already: nothing to do, and no error
    # An engine killed outright writes no line: the code and the log alone.
    killed = Engine([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"], log)
    killed.process.wait(60)
    assert killed.error() == f"the vLLM engine exited with code -9: see {log}"


def test_each_rank_streams_its_own_batches_files_and_devices(tmp_path: Path) -> None:
    # The batches of a rank are the pipeline's (every world_size-th from the next one):
    # disjoint across ranks, together every batch.
    mine = [list(rank_batches(5, last, r, 2)) for r, last in ((0, 9), (1, 10))]
    assert mine == [[5, 7, 9], [6, 8, 10]]
    assert list(rank_batches(5, 8, 0, 1)) == [5, 6, 7, 8]
    assert rank_files(tmp_path, 0, 1) == (
        tmp_path / "vllm-samples.jsonl",
        tmp_path / "vllm-extract.log",
    )
    assert rank_files(tmp_path, 1, 2) == (
        tmp_path / "vllm-samples.rank-00001.jsonl",
        tmp_path / "vllm-extract.rank-00001.log",
    )
    # The engine is no torchrun worker; it runs on its rank's target GPUs, counted in
    # the run's own CUDA_VISIBLE_DEVICES.
    run = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    run |= {"TORCHELASTIC_RUN_ID": "x", "CUDA_VISIBLE_DEVICES": "4,5,6,7", "HF_HOME": "/hf"}
    gpus = [torch.device("cuda", 1), torch.device("cuda", 3)]
    assert engine_env(gpus, run) == {"CUDA_VISIBLE_DEVICES": "5,7", "HF_HOME": "/hf"}
    assert engine_env([torch.device("cuda", 2)], {})["CUDA_VISIBLE_DEVICES"] == "2"
    assert engine_env([torch.device("cpu")], run) == {
        "CUDA_VISIBLE_DEVICES": "4,5,6,7",
        "HF_HOME": "/hf",
    }
