"""Hidden states computed by vLLM itself (its `extract_hidden_states` method, through
tools/vllm/extract_hidden_states.py in vLLM's own venv) train the drafter as the online
path does: same target (SmolLM2-135M-Instruct), data, seed and config, 20 steps.

The tolerance is what the dtypes allow. Both engines run the target in fp32, with other
kernels (vLLM's CPU attention and its fused norms against transformers' eager ops): the
states differ by rounding, ~2e-6 relative here (fp32's epsilon 1.2e-7, grown over 30
layers). The first step's loss, from the same initial weights, sees only that: 1e-5
relative. After it the states' rounding moves the gradients, and Adam, which divides each
coordinate by its own scale, turns a small change of a near-zero gradient into a step of
the full learning rate: the runs may drift apart, by how much depends on the data and
varies from run to run (6e-6 to 9e-5 relative over these 20 steps; 2.5e-3 on 16 other
chats). 1e-2 bounds all 20 steps; a
wrong layer, row or mask changes the loss at once by far more (it differs by 10-50 %
between batches).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, die_with_parent
from safetensors.torch import load_file
from vllm_fixtures import (  # noqa: F401 - fixtures
    dflash_ok,
    end_leftovers,
    new_marker,
    smollm2_dir_fixture,
    vllm_env,
    vllm_python_fixture,
)

SCRIPT = REPO_ROOT / "tools" / "vllm" / "extract_hidden_states.py"
STEPS = 20
STATES_REL = 1e-4  # per layer and sample, ||vLLM - ours|| / ||ours||
FIRST_STEP_REL = 1e-5
ALL_STEPS_REL = 1e-2
# What decides the rows and the features (cache-hidden takes these) ...
# fp32 throughout: SmolLM2 (hidden 576) would run in bf16 under --precision auto on a CPU
# with native bf16, online but not from the states' files, and the losses compared here
# are those of the same arithmetic on two sources of the same states.
DATA_OPTIONS = (
    "--seq-len 128 --batch-size 2 --drafter-layers 2 --seed 0 --packing docs --precision fp32"
).split()
# ... and the rest of the training run.
TRAIN_OPTIONS = (
    f"--block-size 4 --num-anchors 8 --steps {STEPS} --log-every 1 --eval-prompts 0 --overwrite"
).split()
CHATS = [
    (
        "What is a prime number?",
        "A whole number above one whose only divisors are one and itself, such as 2, 3, 5 and 7.",
    ),
    ("Name three colors.", "Red, green and blue."),
    (
        "Explain recursion in one sentence.",
        "A function solves a problem by calling itself on a smaller version of the same problem.",
    ),
    (
        "How do I reverse a list in Python?",
        "Use my_list.reverse() in place, or my_list[::-1] for a reversed copy.",
    ),
    ("What does HTTP stand for?", "HyperText Transfer Protocol, what browsers fetch pages with."),
    (
        "Give me a haiku about the sea.",
        "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide breathes and sleeps.",
    ),
    ("What is 12 times 12?", "12 times 12 is 144."),
    (
        "Describe a cat.",
        "A small, furry carnivore with sharp claws, keen senses and a fondness "
        "for naps in the sun.",
    ),
    (
        "Why is the sky blue?",
        "Air scatters blue sunlight the most, for its short wavelength, so the sky looks blue.",
    ),
    ("What is a linked list?", "Nodes that each hold a value and a pointer to the next node."),
    ("Say hello in French.", "Bonjour!"),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
    (
        "What is photosynthesis?",
        "Plants make sugar from sunlight, water and carbon dioxide, and release oxygen.",
    ),
    ("Give an example of a noun.", "Apple is a noun."),
]


def _chats(path: Path) -> Path:
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
        for q, a in CHATS
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _extract(python: Path, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    """The script in vLLM's venv; no process of it may outlive it."""
    marker = new_marker()
    try:
        done = subprocess.run(
            [str(python), str(SCRIPT), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=vllm_env(marker),
            check=False,
            preexec_fn=die_with_parent,
        )
    finally:
        left = end_leftovers(marker)
    assert not left, f"processes {left} of vLLM outlived extract_hidden_states.py"
    return done


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.mark.slow
@pytest.mark.vllm
def test_training_from_vllms_hidden_states_gives_the_online_losses(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    data = [
        "--target",
        str(smollm2_dir),
        "--data",
        str(_chats(tmp_path / "chats.jsonl")),
        *DATA_OPTIONS,
    ]
    files = tmp_path / "from-vllm"
    dflash_ok(
        "cache-hidden",
        "--format",
        "speculators",
        "--samples-only",
        "--output",
        str(files),
        *data,
        timeout_s=600,
    )
    done = _extract(
        vllm_python,
        "--target",
        str(smollm2_dir),
        "--samples",
        str(files / "samples.jsonl"),
        "--output",
        str(files),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eagle_aux_hidden_state_layer_ids [2, 28, 30]" in done.stdout  # ours 1, 27; the last
    # The files against this project's own target runner's, sample for sample.
    own = tmp_path / "own"
    dflash_ok("cache-hidden", "--format", "speculators", "--output", str(own), *data, timeout_s=600)
    names = sorted(p.name for p in (own / "hidden_states").iterdir())
    assert names == sorted(p.name for p in (files / "hidden_states").iterdir())
    worst = 0.0
    for name in names:
        ours, theirs = (load_file(str(d / "hidden_states" / name)) for d in (own, files))
        assert torch.equal(ours["token_ids"], theirs["token_ids"]), name
        assert torch.equal(ours["loss_mask"], theirs["loss_mask"]), name
        a, b = ours["hidden_states"], theirs["hidden_states"]
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        for k in range(a.shape[1]):
            worst = max(worst, float((a[:, k] - b[:, k]).norm() / a[:, k].norm()))
    assert worst <= STATES_REL, f"vLLM's states differ from ours by {worst:.2e} relative"
    # Training: online, then from vLLM's files.
    dflash_ok(
        "train", *data, *TRAIN_OPTIONS, "--output-dir", str(tmp_path / "online"), timeout_s=600
    )
    log = dflash_ok(
        "train",
        *data,
        *TRAIN_OPTIONS,
        "--hidden-cache",
        str(files),
        "--output-dir",
        str(tmp_path / "cached"),
        timeout_s=600,
    ).stderr
    assert "the target's decoder layers never run while training" in log
    online, cached = _losses(tmp_path / "online"), _losses(tmp_path / "cached")
    assert len(online) == len(cached) == STEPS
    rel = [abs(a - b) / abs(a) for a, b in zip(online, cached, strict=True)]
    figures = (
        f"max abs {max(abs(a - b) for a, b in zip(online, cached, strict=True)):.3g}, "
        f"max rel {max(rel):.3g}, first step rel {rel[0]:.3g}; states {worst:.2e}"
    )
    print(f"losses, vLLM's states against the online run: {figures}")
    assert rel[0] <= FIRST_STEP_REL, figures
    assert max(rel) <= ALL_STEPS_REL, figures


@pytest.mark.slow
@pytest.mark.vllm
def test_bad_input_to_the_extraction_is_one_line_before_vllm_starts(
    vllm_python: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    samples = tmp_path / "samples.jsonl"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "dflash_samples.json").write_text(json.dumps({"layer_ids": [1, 27]}))

    def error(*args: str, lines: list[dict] | None = None) -> str:
        samples.write_text("".join(json.dumps(line) + "\n" for line in lines or []))
        done = _extract(
            vllm_python,
            "--target",
            str(smollm2_dir),
            "--samples",
            str(samples),
            *args,
            timeout_s=300,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [s for s in done.stderr.splitlines() if s.startswith("Error:")]
        assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
        return errors[0]

    one = [{"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]
    out = ["--output", str(tmp_path / "out")]
    assert "records [1, 27]" in error(*out, "--target-layers", "1,9", lines=one)
    assert "--target-layers is needed" in error("--output", str(tmp_path / "bare"), lines=one)
    assert "layer 30 is not a decoder layer" in error(
        "--output", str(tmp_path / "bare"), "--target-layers", "30", lines=one
    )
    assert "outside the target's vocabulary of 49152" in error(
        *out, lines=[{"token_ids": [1, 10**6], "loss_mask": [1, 1]}]
    )
    assert "3 token ids, 2 loss-mask entries" in error(
        *out, lines=[{"token_ids": [1, 2, 3], "loss_mask": [1, 1]}]
    )
    assert "no sample" in error(*out, lines=[])
