"""docs/training.md's SmolLM2 recipe, run as the doc shows it: `bash bench/smollm2_recipe.sh
WORK` with vLLM's CPU build (tools/vllm/venv.sh) and SmolLM2-135M-Instruct
(tools/vllm/model.sh), at tiny sizes through the environment the script reads.

What must hold for a user who runs that one command:
- every stage finishes (prompts, vLLM regeneration, the speculators cache, training, vLLM's
  judgement) and says its seconds; the drafter is saved and vLLM's τ on HumanEval is read;
- the recipe.yaml the script writes is the one the doc shows;
- no vLLM process of the run outlives it (the regeneration server and the judge's);
- a second run finds every stage done and skips it, starting no engine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT
from vllm_fixtures import (  # noqa: F401
    end_leftovers,
    engine_leftovers,
    new_marker,
    smollm2_dir_fixture,
    vllm_env,
    vllm_python_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.vllm]

DOC = REPO_ROOT / "docs" / "training.md"
SECTION = "#### Learning on a real model, measured by the engine"
# Enough for each stage to run for real: a few prompts, steps and HumanEval problems.
# Training's final evaluation of the recipe's 16 held-out prompts would take most of its time.
SIZES = {"PROMPTS": "8", "STEPS": "4", "HUMANEVAL": "4", "EVAL_PROMPTS": "2"}
STAGES = ("prompts", "regen", "cache", "train", "judge")
RUN_TIMEOUT_S = 1500  # two vLLM starts and a training on two shared cores
RERUN_TIMEOUT_S = 300


def _section() -> str:
    text = DOC.read_text()
    start = text.index(SECTION)
    # The next heading (level 2 to 4): a code block's comments start with a single `#`.
    end = re.compile(r"\n#{2,4} ").search(text, start + len(SECTION))
    return text[start : end.start() if end else len(text)]


def _documented_command() -> list[str]:
    """The section's one bash command, as argv."""
    blocks = re.findall(r"```bash\n(.*?)```", _section(), re.S)
    assert len(blocks) == 1, f"{SECTION} should show one bash block, shows {len(blocks)}"
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(lines) == 1, f"{SECTION}'s bash block should be one command: {lines}"
    argv = shlex.split(lines[0])
    assert argv[:2] == ["bash", "bench/smollm2_recipe.sh"] and len(argv) == 3, argv
    return argv


def _documented_recipe() -> dict[str, Any]:
    blocks = re.findall(r"```yaml\n(.*?)```", _section(), re.S)
    assert len(blocks) == 1, f"{SECTION} should show one yaml block, shows {len(blocks)}"
    recipe = yaml.safe_load(blocks[0])
    assert isinstance(recipe, dict)
    return recipe


def _run(
    argv: list[str], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """ARGV in the repository's root, in a session of its own: on a timeout the whole
    session is ended, not the script alone."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(argv)} took over {timeout_s} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, "")


@pytest.mark.timeout(RUN_TIMEOUT_S + RERUN_TIMEOUT_S + 60)
def test_documented_recipe_runs_and_judges(
    tmp_path: Path, vllm_python: Path, smollm2_dir: Path
) -> None:
    work = tmp_path / "smollm2"
    argv = [*_documented_command()[:2], str(work)]  # the doc's command, our folder
    marker = new_marker()
    env = {**vllm_env(marker), **SIZES, "VLLM": str(vllm_python)}
    try:
        done = _run(argv, env, RUN_TIMEOUT_S)
        assert done.returncode == 0, f"the recipe failed:\n{done.stdout[-6000:]}"
        left = engine_leftovers(marker)
        assert left == [], f"processes of the recipe outlive it: {left}"

        for stage in STAGES:
            assert re.search(rf"smollm2-recipe: {stage} took \d+ s", done.stdout), stage
        assert (work / "run" / "drafter" / "config.json").is_file()
        assert len((work / "humaneval.jsonl").read_text().splitlines()) == 4

        written = yaml.safe_load((work / "recipe.yaml").read_text())
        shown = _documented_recipe()
        # The doc spells the target as this machine's cache would hold it; the script
        # writes where tools/vllm/model.sh put it.
        assert str(shown.pop("target")).endswith("models/smollm2-135m-instruct/hf")
        assert written.pop("target") == str(smollm2_dir)
        assert written == shown

        rows = (work / "judge.jsonl").read_text().splitlines()
        assert len(rows) == 1
        judged = json.loads(rows[0])["vllm"]
        humaneval = judged["humaneval.jsonl"]
        assert humaneval["prompts"] == 4
        assert humaneval["tau_pooled"] >= 1.0, humaneval
        assert judged["heldout"]["prompts"] == 2 and judged["heldout"]["tau_pooled"] >= 1.0
        assert f"humaneval.jsonl {humaneval['tau_pooled']:.3f}" in done.stdout

        again = _run(argv, env, RERUN_TIMEOUT_S)
        assert again.returncode == 0, again.stdout[-4000:]
        for stage in STAGES:
            assert f"smollm2-recipe: {stage} skipped" in again.stdout, again.stdout[-4000:]
        assert len((work / "judge.jsonl").read_text().splitlines()) == 1
    finally:
        end_leftovers(marker)
