"""Hidden states of a target computed by vLLM itself, written as `train --hidden-cache` reads
them (speculators' per-sample layout):

  python tools/vllm/extract_hidden_states.py --target DIR --samples SAMPLES.jsonl \\
      --output OUT [--target-layers 1,9,17] [-- VLLM ENGINE ARGS, e.g. --tensor-parallel-size 8]

Run it with a python that has vLLM (tools/vllm/venv.sh prints the CPU build's); it never
imports dflash, whose environment vLLM cannot join. SAMPLES.jsonl holds one sample a line,
{"token_ids": [...], "loss_mask": [0/1 ...], "index": i} (index: default the line number);
`dflash-train cache-hidden --format speculators --samples-only --output OUT` writes it as
OUT/samples.jsonl, with OUT/dflash_samples.json, the manifest of the online run's rows, which
names the layers and the dtype too. Each sample becomes OUT/hidden_states/hs_{index}.safetensors:
token_ids int64[t], loss_mask bool[t], hidden_states [t, K+1, D]: the outputs of our decoder
layers --target-layers (vLLM's eagle_aux_hidden_state_layer_ids count the embedding output
as 0: ours + 1) in their order, then the last decoder layer's output before the final norm
(vLLM's id num_layers), which soft labels use; as speculators' own generation writes them.

vLLM runs the target with its `extract_hidden_states` speculative method: the states of the
layers named go into a cache-only KV cache group, and a KV connector writes each finished
request's rows to a file. vLLM's ExampleHiddenStatesConnector copies them through CUDA streams
and pinned memory; without a GPU, hidden_states_connector.py gathers them with the CPU.
A sample whose file exists and reads is kept: an interrupted run continues.

--spool-size BYTES makes OUT a bounded spool that a training run reads while this writes
(`train --target-engine vllm`): the samples are written in the order of SAMPLES.jsonl, and
each vLLM call waits until what OUT holds plus what the call writes fits in BYTES. The
protocol is specified in dflash/offline/spool.py (this file cannot import dflash); the
functions named spool_* here are its writer's side.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

SAMPLES_DIR = "hidden_states"
MANIFEST = "dflash_samples.json"  # written by dflash-train cache-hidden --samples-only
RAW_DIR = ".vllm-states"  # where the connector writes, one file per request
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SPOOL_HEADER_BYTES = 512  # dflash.offline.spool.HEADER_BYTES


class UsageError(Exception):
    """Bad input: one line, exit 2."""


# ------------------------------------------------------------------ input


def parse_layers(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--target-layers {text!r}: comma-separated layer numbers") from None


def read_samples(path: Path, vocab: int) -> list[tuple[int, list[int], list[bool]]]:
    """(index, token ids, loss mask) of every line; a bad line is one error naming it."""
    if not path.is_file():
        raise UsageError(f"--samples {path}: no such file")
    samples, seen = [], set()
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = [int(t) for t in row["token_ids"]]
                mask = [bool(m) for m in row.get("loss_mask", [1] * len(ids))]
                index = int(row.get("index", number - 1))
            except (ValueError, KeyError, TypeError) as err:
                raise UsageError(
                    f"--samples {path} line {number}: not a sample "
                    f'{{"token_ids": [...], "loss_mask": [...]}} ({type(err).__name__}: {err})'
                ) from None
            if not ids or len(mask) != len(ids):
                raise UsageError(
                    f"--samples {path} line {number}: {len(ids)} token ids, "
                    f"{len(mask)} loss-mask entries"
                )
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise UsageError(
                    f"--samples {path} line {number}: token id {bad[0]} is outside the "
                    f"target's vocabulary of {vocab}"
                )
            if index in seen:
                raise UsageError(f"--samples {path} line {number}: index {index} again")
            seen.add(index)
            samples.append((index, ids, mask))
    if not samples:
        raise UsageError(f"--samples {path}: no sample")
    return samples


def read_manifest(out: Path) -> dict[str, Any] | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{path} is unreadable: {err}") from None


def target_config(target: str) -> dict[str, Any]:
    """The decoder's config of a Hugging Face folder or hub id (a multimodal one's text part)."""
    from transformers import AutoConfig  # vLLM's dependency

    try:
        config = AutoConfig.from_pretrained(target)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise UsageError(f"--target {target}: no Hugging Face config ({first})") from None
    return config.get_text_config().to_dict()


def resolve_layers(
    given: str | None, manifest: dict[str, Any] | None, num_layers: int
) -> list[int]:
    """Our layer ids: --target-layers, else the manifest's; both must agree."""
    named = parse_layers(given) if given is not None else None
    recorded = [int(i) for i in manifest["layer_ids"]] if manifest else None
    if named is None and recorded is None:
        raise UsageError(
            "--target-layers is needed (our decoder layer numbers, as `train --target-layers`): "
            f"the output folder has no {MANIFEST} that records them"
        )
    if named is not None and recorded is not None and named != recorded:
        raise UsageError(
            f"--target-layers {named}, but {MANIFEST} of the output folder records {recorded}"
        )
    layers = named if named is not None else recorded
    assert layers is not None
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or not layers:
        raise UsageError(
            f"--target-layers {layers}: layer {bad[0] if bad else '(none)'} is not a decoder "
            f"layer of the target (0..{num_layers - 1})"
        )
    if len(set(layers)) != len(layers):
        raise UsageError(f"--target-layers {layers} names a layer twice")
    return layers


def engine_args(rest: list[str]) -> dict[str, Any]:
    """The vLLM engine arguments given after `--`, as LLM(...) keywords (defaults left out)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm engine arguments"))
    try:
        given = parser.parse_args(rest)
    except SystemExit:
        raise UsageError(f"vLLM engine arguments {' '.join(rest)!r} do not parse") from None
    defaults = vars(parser.parse_args([]))
    return {k: v for k, v in vars(given).items() if v != defaults.get(k)}


# ------------------------------------------------------------------ extraction


def sample_path(out: Path, index: int) -> Path:
    return out / SAMPLES_DIR / f"hs_{index}.safetensors"


def is_complete(path: Path, length: int, width: int) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            shape = f.get_slice("hidden_states").get_shape()
            return shape[0] == length and shape[1] == width
    except Exception:  # noqa: BLE001 - any unreadable file is written again
        return False


def wait_unlocked(lock: Path, timeout_s: float) -> None:
    """The connector holds an exclusive lock on FILE.lock until FILE is written."""
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM did not finish writing {lock.with_suffix('')} in {timeout_s:.0f} s"
                    ) from None
                time.sleep(0.05)
    finally:
        os.close(fd)


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for begin in range(0, len(items), size):
        yield items[begin : begin + size]


def convert(
    raw: Path,
    out_path: Path,
    sample: tuple[int, list[int], list[bool]],
    order: list[int],
    dtype: torch.dtype,
    width: int,
    times: dict[str, int] | None = None,
) -> None:
    """vLLM's file (its layers ascending) -> ours: our layer order, then the last layer.
    `times`: the engine's wall-clock ns of the sample (queued_ns, extracted_ns), kept in
    the file's metadata for the trace (its write ends at the file's mtime)."""
    index, ids, mask = sample
    data = load_file(str(raw))
    if data["token_ids"].tolist() != ids:
        raise RuntimeError(f"sample {index}: vLLM's file {raw.name} holds other token ids")
    states = data["hidden_states"]
    want = (len(ids), max(order) + 1, width)
    if tuple(states.shape) != want or states.dtype != dtype:
        raise RuntimeError(
            f"sample {index}: vLLM wrote hidden states {list(states.shape)} {states.dtype}, "
            f"not {list(want)} {dtype}"
        )
    tensors = {
        "token_ids": torch.tensor(ids, dtype=torch.int64),
        "hidden_states": states[:, order].contiguous(),
        "loss_mask": torch.tensor(mask, dtype=torch.bool),
    }
    tmp = out_path.with_name(out_path.name + ".tmp")
    metadata = {f"dflash.engine.{k}": str(v) for k, v in (times or {}).items()}
    save_file(tensors, str(tmp), metadata=metadata or None)
    os.replace(tmp, out_path)


# ------------------------------------------------------------------ spool (writer's side)


def spool_sample_bytes(length: int, layers: int, width: int, itemsize: int) -> int:
    """dflash.offline.spool.sample_bytes: one sample's file."""
    return length * layers * width * itemsize + length * 8 + length + SPOOL_HEADER_BYTES


def spool_bytes(out: Path) -> int:
    """dflash.offline.spool.spool_bytes: every file under OUT/hidden_states and the raw dir."""
    total = 0
    for sub in (SAMPLES_DIR, RAW_DIR):
        try:
            entries = list(os.scandir(out / sub))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # taken by the reader meanwhile
                pass
    return total


def spool_parts(
    samples: list[tuple[int, list[int], list[bool]]],
    bound: int,
    raw_layers: int,
    layers: int,
    width: int,
    itemsize: int,
    most: int,
) -> Iterator[tuple[list[tuple[int, list[int], list[bool]]], int]]:
    """The samples in order, in calls of at most `most` whose bytes (the raw files of the
    call, and one converted file beside them) take at most half the bound, so that the
    reader drains one half while the engine fills the other; -> (call, its bytes)."""
    part: list[tuple[int, list[int], list[bool]]] = []
    raw = largest = 0
    for sample in samples:
        t = len(sample[1])
        one_raw = spool_sample_bytes(t, raw_layers, width, itemsize)
        one = spool_sample_bytes(t, layers, width, itemsize)
        if one_raw + one > bound:
            raise UsageError(
                f"--spool-size {bound} bytes: sample {sample[0]} of {t} tokens needs "
                f"{one_raw + one} (its raw and converted files)"
            )
        need = raw + one_raw + max(largest, one)
        if part and (len(part) >= most or need > max(bound // 2, one_raw + one)):
            yield part, raw + largest
            part, raw, largest = [], 0, 0
        part.append(sample)
        raw, largest = raw + one_raw, max(largest, one)
    if part:
        yield part, raw + largest


def spool_wait(out: Path, need: int, bound: int, poll_s: float = 0.02) -> None:
    """Waits until the spool has room for `need` more bytes."""
    while spool_bytes(out) + need > bound:
        time.sleep(poll_s)


def extract(args: argparse.Namespace, rest: list[str]) -> str:
    # Absolute: vLLM's workers write there from their own processes.
    out = Path(args.output).resolve()
    config = target_config(args.target)
    num_layers, width = int(config["num_hidden_layers"]), int(config["hidden_size"])
    vocab = int(config["vocab_size"])
    manifest = read_manifest(out)
    layers = resolve_layers(args.target_layers, manifest, num_layers)
    samples = read_samples(Path(args.samples), vocab)
    dtype_name = args.dtype or (manifest or {}).get("dtype") or "float32"
    if dtype_name not in DTYPES:
        raise UsageError(f"{MANIFEST}: dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
    # vLLM captures the layers named in ascending order, each once; the last layer
    # (vLLM's id num_layers) always follows ours, as speculators writes it.
    wanted = [i + 1 for i in layers] + [num_layers]
    captured = sorted(set(wanted))
    order = [captured.index(i) for i in wanted]
    if args.spool_size is not None:  # each file is taken (and deleted) by the reader
        todo = samples
    else:
        todo = [
            s for s in samples if not is_complete(sample_path(out, s[0]), len(s[1]), len(wanted))
        ]
    (out / SAMPLES_DIR).mkdir(parents=True, exist_ok=True)
    if not todo:
        return f"extract-hidden-states: all {len(samples)} samples already in {out / SAMPLES_DIR}"
    # One token is generated after each sample: it needs a position too.
    longest = max(len(ids) for _, ids, _ in todo) + 1
    limit = config.get("max_position_embeddings")
    if limit is not None and longest > int(limit):
        raise UsageError(
            f"--samples {args.samples}: a sample of {longest - 1} tokens, the target takes "
            f"{limit} positions (one more is generated after each sample)"
        )
    given = engine_args(rest)  # vLLM loads from here on
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    raw_dir = out / RAW_DIR
    raw_dir.mkdir(exist_ok=True)
    kv_transfer: dict[str, Any] = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(raw_dir)},
    }
    if current_platform.is_cpu():
        # The workers import the connector by module name: this file's folder on their path.
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [here, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        sys.path.insert(0, here)
        kv_transfer |= {
            "kv_connector": "HostHiddenStatesConnector",
            "kv_connector_module_path": "hidden_states_connector",
        }
    options: dict[str, Any] = {
        "dtype": dtype_name,
        "enforce_eager": True,
        "max_model_len": longest,
        # Each sample's states come from its own forward, as in the online run.
        "enable_prefix_caching": False,
        **given,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": captured}},
        },
        "kv_transfer_config": kv_transfer,
    }
    start = time.perf_counter()
    llm = LLM(model=args.target, **options)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        tokens = 0
        itemsize = DTYPES[dtype_name].itemsize
        if args.spool_size is None:
            parts: Iterator[tuple[list[Any], int]] = ((p, 0) for p in chunks(todo, args.chunk))
        else:
            sizes = (len(captured), len(wanted), width, itemsize)
            parts = spool_parts(todo, args.spool_size, *sizes, args.chunk)
        for part, need in parts:
            if args.spool_size is not None:
                spool_wait(out, need, args.spool_size)
            prompts = [{"prompt_token_ids": ids} for _, ids, _ in part]
            queued_ns = time.time_ns()  # the wall clock: the training run's trace joins it
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times = {"queued_ns": queued_ns, "extracted_ns": time.time_ns()}
            for (index, ids, mask), output in zip(part, outputs, strict=True):
                where = (output.kv_transfer_params or {}).get("hidden_states_path")
                if where is None:
                    raise RuntimeError(f"vLLM returned no hidden-states file for sample {index}")
                raw = Path(where)
                lock = raw.with_name(raw.name + ".lock")
                wait_unlocked(lock, args.timeout_s)
                sample = (index, ids, mask)
                where_to = sample_path(out, index)
                convert(raw, where_to, sample, order, DTYPES[dtype_name], width, times)
                raw.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                tokens += len(ids)
    finally:
        shutdown(llm)
    try:
        raw_dir.rmdir()
    except OSError:
        pass  # files of requests that never finished; harmless
    took = time.perf_counter() - start
    return (
        f"extract-hidden-states: {len(todo)} samples ({tokens:,} tokens) in "
        f"{out / SAMPLES_DIR} in {took:.1f} s; our layers {layers} (vLLM's "
        f"eagle_aux_hidden_state_layer_ids {captured}), then the last layer; {dtype_name}"
    )


def shutdown(llm: Any) -> None:
    """Stops vLLM's engine-core and worker processes: left alive, each holds gigabytes."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as err:  # noqa: BLE001 - the processes are ended below anyway
        print(f"extract-hidden-states: vLLM's shutdown failed: {err}", file=sys.stderr)
    import psutil  # a vLLM dependency

    left = psutil.Process().children(recursive=True)
    for child in left:
        child.terminate()
    _, alive = psutil.wait_procs(left, timeout=10)
    for child in alive:
        child.kill()


def one_line(err: BaseException, most: int = 300) -> str:
    """The error's first line, and its second where the first only counts (pydantic's
    "1 validation error for ModelConfig" names the reason below it: a target vLLM cannot
    load), at most `most` characters (vLLM's list of its architectures follows)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    text = lines[0]
    if len(lines) > 1 and "validation error" in text:  # the reason: the line of its type
        text += ": " + next((line for line in lines[1:] if "[type=" in line), lines[1])
    return text if len(text) <= most else text[: most - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="extract_hidden_states.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="the target: Hugging Face folder or id")
    parser.add_argument("--samples", required=True, help="JSONL: token_ids, loss_mask per line")
    parser.add_argument("--output", required=True, help="folder: OUTPUT/hidden_states/hs_{i}")
    parser.add_argument(
        "--target-layers", default=None, help="our decoder layer numbers (default: the manifest's)"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="the states' dtype (default: the manifest's, else float32)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=256,
        help="samples per vLLM call (bounds the files waiting on disk)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="how long to wait for vLLM to write one sample's file",
    )
    parser.add_argument(
        "--spool-size",
        type=int,
        default=None,
        help="bytes: OUT is a spool of at most this many, which a training run empties",
    )
    args = parser.parse_args(argv)
    try:
        print(extract(args, rest))
    except UsageError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - one line; vLLM's own log above has the trace
        print(
            f"Error: {type(err).__name__}: {one_line(err)} (vLLM's log is above)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
