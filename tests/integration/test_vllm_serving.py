"""The real engine in the loop: drafters trained by the README's recipe (regenerate, then
train) on SmolLM2-135M-Instruct, served by vLLM's CPU build (tools/vllm/venv.sh) as saved,
through its offline `LLM` API and through its OpenAI server on loopback.

What must hold for a user who serves what this project trains:
- the directory loads as saved (no conversion; its files unchanged by serving);
- greedy outputs with the drafter equal the target served alone, on every prompt;
- vLLM's mean acceptance length and per-position acceptance equal `dflash-train eval`'s
  pooled figures within 2 %, for a whole-vocabulary drafter, a `--draft-vocab-size` one and
  a `--save-dtype bfloat16` one served in bf16;
- `eval --server` (τ from the engine's /metrics) equals in-process eval within 2 %;
- `regenerate --server` against vLLM writes the in-process regeneration's replies.

The drafters are trained on the target's own replies to the evaluation prompts, so they
accept many drafts: a disagreement between the engines shows at every position.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CHAT_PROMPTS, REPO_ROOT, die_with_parent
from vllm_fixtures import (  # noqa: F401
    dflash_cli,
    dflash_ok,
    end_leftovers,
    new_marker,
    smollm2_dir_fixture,
    vllm_env,
    vllm_python_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.vllm]

PROMPTS = CHAT_PROMPTS[:8]
NEW_TOKENS = 32
HELDOUT = "0.001"  # every prompt is trained on: the drafters are meant to accept
TOLERANCE = 0.02
GENERATE = REPO_ROOT / "tools" / "vllm" / "generate.py"
# Small rows, one drafter layer, every position an anchor, a steep schedule: the replies
# are learned by heart.
# fp32, as vLLM serves these drafters and as `eval` measures them: --precision auto would
# train SmolLM2 (hidden 576) in bf16 on a CPU with native bf16.
TRAIN = (
    "--precision fp32 "
    f"--heldout-fraction {HELDOUT} --keep-cut-replies --seq-len 128 --batch-size 4 "
    "--block-size 8 --drafter-layers 1 --num-anchors 32 --steps 80 --warmup-steps 5 "
    "--lr 3e-3 --eval-prompts 0 --trace-level off --profile-interval 1000"
).split()
DRAFTERS = {  # name -> (extra train flags, dtype vLLM serves it in)
    "whole": ([], "float32"),
    "pruned": (["--draft-vocab-size", "2048"], "float32"),
    # The whole drafter's weights saved by a run in bf16 (one step at a vanishing lr): the
    # bf16 save and vLLM's bf16 forward, without a third training of the drafter.
    "bf16": ("--steps 1 --warmup-steps 0 --lr 1e-12 --save-dtype bfloat16".split(), "bfloat16"),
}


def _tree_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _close(ours: float, theirs: float) -> bool:
    return abs(theirs - ours) <= TOLERANCE * max(abs(ours), 1e-9)


def _positions_close(ours: list[float], theirs: list[float], slack: float = 0.0) -> bool:
    # Shares of drafts: an absolute 2 % of the drafts where a position is rarely accepted;
    # `slack` on top (a share's own step, 1/drafts, in bf16: see the test).
    return len(ours) == len(theirs) and all(
        abs(a - b) <= TOLERANCE * max(a, 0.05) + slack for a, b in zip(ours, theirs, strict=True)
    )


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> dict[str, Any]:
    """Prompts, the target's regenerated replies, three trained drafters and their
    in-process `dflash-train eval` figures."""
    root = tmp_path_factory.mktemp("vllm-serving")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in PROMPTS)
    )
    regen = root / "regen.jsonl"
    # fp32, as vLLM serves the target here: under --precision auto a CPU with native bf16
    # would regenerate in bf16, whose greedy replies are not fp32's.
    dflash_ok(
        "regenerate",
        "--precision",
        "fp32",
        "--target",
        str(smollm2_dir),
        "--data",
        str(prompts),
        "--output",
        str(regen),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--heldout-fraction",
        HELDOUT,
    )
    drafters, evals = {}, {}
    for name, (extra, dtype) in DRAFTERS.items():
        out = root / name
        init = ["--init-from", str(drafters["whole"])] if name == "bf16" else []
        dflash_ok(
            "train",
            "--target",
            str(smollm2_dir),
            "--data",
            str(regen),
            *TRAIN,
            *extra,
            *init,
            "--output-dir",
            str(out),
        )
        drafters[name] = out / "drafter"
        if dtype == "float32":  # bf16: on the prompts both bf16 targets agree on (below)
            evals[name] = _eval(drafters[name], smollm2_dir, prompts, dtype, root / name)
    ids = _rendered(smollm2_dir, prompts)
    return {
        "root": root,
        "prompts": prompts,
        "regen": regen,
        "drafters": drafters,
        "evals": evals,
        "target": smollm2_dir,
        "ids": ids,
    }


def _eval(drafter: Path, target: Path, prompts: Path, dtype: str, work: Path) -> dict[str, Any]:
    """`dflash-train eval`'s figures, target and drafter in `dtype` as vLLM serves them."""
    figures = work / f"eval-{dtype}.json"
    dflash_ok(
        "eval",
        "--drafter",
        str(drafter),
        "--target",
        str(target),
        "--eval-data",
        str(prompts),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--dtype",
        dtype,
        "--json",
        str(figures),
    )
    return json.loads(figures.read_text())


def _greedy_here(target: Path, prompts: list[list[int]], dtype: str) -> list[list[int]]:
    """The target's greedy replies in this process (transformers), `dtype` throughout."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, dtype))
    replies = []
    with torch.no_grad():
        for ids in prompts:
            out = model.eval().generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            replies.append(out[0, len(ids) :].tolist())
    return replies


def _rendered(target: Path, prompts: Path) -> list[list[int]]:
    """The prompts as `dflash-train eval --eval-data` renders them (token ids)."""
    from dflash.eval.prompts import render_prompt
    from dflash.target.load import load_tokenizer

    tokenizer = load_tokenizer(str(target))
    lines = [json.loads(line)["messages"] for line in prompts.read_text().splitlines()]
    return [render_prompt(tokenizer, m) for m in lines]


def _offline(vllm_python: Path, requests: list[dict[str, Any]], work: Path) -> list[Any]:
    """tools/vllm/generate.py over `requests`, one engine at a time; no engine process
    outlives it."""
    request_file, result_file = work / "requests.json", work / "results.json"
    request_file.write_text(json.dumps(requests))
    marker = new_marker()
    try:
        done = subprocess.run(
            [str(vllm_python), str(GENERATE), str(request_file), str(result_file)],
            capture_output=True,
            text=True,
            timeout=1500,
            env=vllm_env(marker),
            check=False,
        )
    finally:
        left = end_leftovers(marker)
    assert done.returncode == 0, f"vLLM failed:\n{done.stderr[-4000:]}"
    assert not left, f"vLLM processes outlived the engine's shutdown: {left}"
    return json.loads(result_file.read_text())


@pytest.mark.timeout(3600)
def test_vllm_serves_every_drafter_as_saved_with_our_acceptance(recipe, vllm_python):
    hashes = {name: _tree_hash(d) for name, d in recipe["drafters"].items()}
    common = {"target": str(recipe["target"]), "max_tokens": NEW_TOKENS, "max_model_len": 1024}
    every = {**common, "prompts": recipe["ids"]}
    alone_fp32, alone_bf16 = _offline(
        vllm_python,
        [
            {**every, "drafter": None, "dtype": "float32"},
            {**every, "drafter": None, "dtype": "bfloat16"},
        ],
        recipe["root"],
    )
    # In bf16 two implementations of one target round differently, and a near-tie can turn
    # a greedy reply (one of these 8 on this CPU, at its 6th token): τ compares drafters
    # only on trajectories both targets take, so the bf16 figures are measured on the
    # prompts whose bf16 replies here equal vLLM's.
    here_bf16 = _greedy_here(recipe["target"], recipe["ids"], "bfloat16")
    agree = [i for i, reply in enumerate(here_bf16) if reply == alone_bf16["outputs"][i]]
    assert len(agree) >= len(PROMPTS) // 2, f"bf16 replies agree on {len(agree)} prompts only"
    lines = recipe["prompts"].read_text().splitlines(keepends=True)
    agreed = recipe["root"] / "prompts-bf16.jsonl"
    agreed.write_text("".join(lines[i] for i in agree))
    evals = dict(recipe["evals"])
    drafters, root = recipe["drafters"], recipe["root"]
    evals["bf16"] = _eval(drafters["bf16"], recipe["target"], agreed, "bfloat16", root / "bf16")
    prompts_of = {"float32": recipe["ids"], "bfloat16": [recipe["ids"][i] for i in agree]}
    alone = {
        "float32": alone_fp32["outputs"],
        "bfloat16": [alone_bf16["outputs"][i] for i in agree],
    }
    requests = [
        {**common, "prompts": prompts_of[dtype], "drafter": str(drafters[name]), "dtype": dtype}
        for name, (_, dtype) in DRAFTERS.items()
    ]
    results = _offline(vllm_python, requests, root)
    for (name, (_, dtype)), served in zip(DRAFTERS.items(), results, strict=True):
        assert served["outputs"] == alone[dtype], f"{name}: outputs differ from the target's"
        ours = evals[name]
        drafts = served["num_drafts"]
        tau = 1 + served["num_accepted_tokens"] / drafts
        per_position = [a / drafts for a in served["accepted_per_position"]]
        assert _close(ours["tau_pooled"], tau), (name, ours["tau_pooled"], tau)
        # In bf16 the two implementations' drafters round differently too: a near-tie
        # flips about one draft per position (88 drafts here), τ stays within 0.5 %.
        slack = 1 / drafts if dtype == "bfloat16" else 0.0
        assert _positions_close(ours["acceptance_per_position"], per_position, slack), (
            name,
            ours["acceptance_per_position"],
            per_position,
        )
        assert tau > 1.2, f"{name}: the drafter barely accepts ({tau:.3f}): the test shows little"
        print(
            f"{name} ({dtype}, {len(prompts_of[dtype])} prompts): vLLM τ pooled {tau:.4f}, "
            f"ours {ours['tau_pooled']:.4f}; per position vLLM "
            f"{[round(p, 3) for p in per_position]}, ours "
            f"{[round(p, 3) for p in ours['acceptance_per_position']]}"
        )
    for name, directory in recipe["drafters"].items():
        assert _tree_hash(directory) == hashes[name], f"serving changed {directory}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def serve(vllm_python: Path, recipe: dict[str, Any]) -> Iterator[Any]:
    """Starts vLLM's OpenAI server on loopback (optionally with a drafter); -> its URL."""
    started: list[tuple[subprocess.Popen[str], str]] = []

    def start(drafter: Path | None, traces_to: str | None = None) -> str:
        """`traces_to`: vLLM's --otlp-traces-endpoint (OTLP/gRPC), its service `vllm`."""
        port, marker = _free_port(), new_marker()
        args = [
            str(vllm_python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(recipe["target"]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--seed",
            "0",
        ]
        if drafter is not None:
            block = json.loads((drafter / "config.json").read_text())["block_size"]
            spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1}
            args += ["--speculative-config", json.dumps(spec)]
        env = vllm_env(marker)
        if traces_to is not None:
            args += ["--otlp-traces-endpoint", traces_to]
            env["OTEL_SERVICE_NAME"] = "vllm"
        log = open(recipe["root"] / f"serve-{port}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            preexec_fn=die_with_parent,
        )
        started.append((proc, marker))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return url
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"vllm serve exited:\n{Path(log.name).read_text()[-3000:]}")
                time.sleep(1)
        pytest.fail("vllm serve did not become healthy in 300 s")

    yield start
    for proc, marker in started:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        end_leftovers(marker)


def _completions(url: str, prompts: list[list[int]]) -> list[str]:
    """Greedy replies of the OpenAI server to token-id prompts, one at a time."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    texts = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0}
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as reply:
            texts.append(json.loads(reply.read())["choices"][0]["text"])
    return texts


def _regenerated_replies(regen: Path) -> list[str]:
    return [json.loads(line)["messages"][-1]["content"] for line in regen.read_text().splitlines()]


@pytest.mark.timeout(3600)
def test_eval_server_measures_our_tau_through_vllm_serve(recipe, serve, jaeger):
    drafter = recipe["drafters"]["whole"]
    url = serve(drafter, traces_to=jaeger.otlp_grpc_endpoint)
    ours = recipe["evals"]["whole"]
    out = recipe["root"] / "served.json"
    service = f"dflash-eval-{new_marker()}"
    done = dflash_ok(
        "eval",
        "--server",
        url,
        "--target",
        str(recipe["target"]),
        "--eval-data",
        str(recipe["prompts"]),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--json",
        str(out),
        "--otlp-endpoint",
        jaeger.otlp_http_endpoint,
        "--service-name",
        service,
    )
    served = json.loads(out.read_text())
    assert served["served"]["server"] == url
    assert served["prompts"] == len(PROMPTS)
    assert served["other_traffic"] is None
    assert _close(ours["tau_pooled"], served["tau_pooled"]), (ours["tau_pooled"], served)
    assert _close(ours["tau"], served["tau"]), (ours["tau"], served["tau"])
    assert _positions_close(ours["acceptance_per_position"], served["acceptance_per_position"])
    assert "eval (server): τ" in done.stderr
    print(
        f"eval --server: τ {served['tau']:.4f} pooled {served['tau_pooled']:.4f} in "
        f"{served['eval_s']:.1f} s; in process τ {ours['tau']:.4f} pooled "
        f"{ours['tau_pooled']:.4f} in {ours['eval_s']:.1f} s"
    )
    # Speculative decoding is lossless: the server's greedy replies with the drafter are
    # the target's own, as regeneration decoded them in this process.
    assert _completions(url, recipe["ids"]) == _regenerated_replies(recipe["regen"])
    _one_trace_holds_the_command_and_the_engine(jaeger, service, done.stderr)


def _one_trace_holds_the_command_and_the_engine(jaeger: Any, service: str, stderr: str) -> None:
    """Each completion is our GenAI client span, and vLLM's `llm_request` span (exported
    by the engine itself) is its child in the same trace, found through Jaeger's API."""
    assert "failed 0" in stderr, stderr[-2000:]

    def engine_spans(traces: list[dict[str, Any]]) -> list[dict[str, Any]]:
        spans = [s for t in traces for s in t["spans"]]
        return [s for s in spans if s["operationName"] == "llm_request"]

    traces = jaeger.wait_for(
        lambda: jaeger.traces(service),
        lambda found: len(engine_spans(found)) >= len(PROMPTS),
        timeout_s=90,
        waiting_for=f"vLLM's llm_request spans in the traces of {service}",
    )
    (trace,) = traces
    spans = {s["spanID"]: s for s in trace["spans"]}
    services = {pid: p["serviceName"] for pid, p in trace["processes"].items()}
    (root,) = [s for s in spans.values() if s["operationName"] == "dflash.eval"]
    clients = [s for s in spans.values() if s["operationName"].startswith("text_completion ")]
    assert len(clients) == len(PROMPTS)
    for client in clients:
        assert services[client["processID"]] == service
        assert [r["spanID"] for r in client["references"]] == [root["spanID"]]
        tags = {t["key"]: t["value"] for t in client["tags"]}
        assert tags["span.kind"] == "client" and tags["gen_ai.provider.name"] == "vllm"
    parents = set()
    for span in engine_spans(traces):
        assert services[span["processID"]] == "vllm"
        (ref,) = span["references"]
        parents.add(ref["spanID"])
    assert parents == {c["spanID"] for c in clients}


@pytest.mark.timeout(3600)
def test_regenerate_server_against_vllm_writes_the_in_process_replies(recipe, serve, tmp_path):
    url = serve(None)
    out = tmp_path / "regen-server.jsonl"
    dflash_ok(
        "regenerate",
        "--server",
        url,
        "--target",
        str(recipe["target"]),
        "--data",
        str(recipe["prompts"]),
        "--output",
        str(out),
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--heldout-fraction",
        HELDOUT,
        "--concurrency",
        "4",
    )
    ours = [json.loads(line) for line in recipe["regen"].read_text().splitlines()]
    theirs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["messages"] for t in theirs] == [o["messages"] for o in ours]
    # A server that drafts nothing is no speculative server: one line, exit 2, no traceback.
    done = dflash_cli(
        "eval",
        "--server",
        url,
        "--target",
        str(recipe["target"]),
        "--eval-data",
        str(recipe["prompts"]),
        "--max-new-tokens",
        "4",
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "speculative" in errors[0], done.stderr[-2000:]


@pytest.mark.timeout(3600)
def test_train_ends_with_tau_measured_by_vllm(recipe, vllm_python, tmp_path):
    out, marker = tmp_path / "run", new_marker()
    server = "-m vllm.entrypoints.openai.api_server --dtype float32 --max-model-len 1024"
    command = f"{vllm_python} {server} --enforce-eager"
    # Later flags win: a few steps, a held-out share to take the prompts from.
    evaluation = "--steps 4 --heldout-fraction 0.5 --eval-prompts 2 --eval-new-tokens 16"
    args = [sys.executable, "-m", "dflash.cli", "train", "--target", str(recipe["target"])]
    args += ["--data", str(recipe["regen"]), *TRAIN, *evaluation.split()]
    args += ["--eval-engine", "vllm", "--vllm-command", command, "--output-dir", str(out)]
    try:
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=1200, env=vllm_env(marker), check=False
        )
    finally:
        left = end_leftovers(marker)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not left, f"the engine outlived the run: {left}"
    summary = json.loads((out / "summary.json").read_text())
    served = summary["served"]
    assert served["requests"] == 2 and served["num_drafts"] > 0
    assert served["num_speculative_tokens"] == 7
    assert summary["tau_pooled"] == served["tau_pooled"] >= 1.0
    assert "measured by the serving engine" in (out / "report.html").read_text()
    assert (out / "vllm.log").stat().st_size > 0
