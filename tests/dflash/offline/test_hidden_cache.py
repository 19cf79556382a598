import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from dflash import names
from dflash.cli import cli
from dflash.data.datasets import build_datasets
from dflash.offline.hidden_cache import HiddenCacheError, open_hidden_cache, write_hidden_cache
from dflash.run import pipelined as pipeline
from dflash.run.build import build_drafter
from dflash.run.reference import train_reference
from dflash.target.load import wrap_tiny
from dflash.target.tiny import TinyLM
from dflash.train.step import DrafterTrainer
from tests.dflash.app_fixtures import (  # noqa: F401 - fixture
    SMALL_LM,
    record_losses,
    small_cfg,
    tiny_target,
    write_corpus,
)

LAYERS = [1, 2]


def _target(seed: int = 0):
    torch.manual_seed(seed)
    return wrap_tiny(TinyLM(SMALL_LM))


def _data(tmp_path, seq_len: int = 32):
    train, _ = build_datasets(str(write_corpus(tmp_path)), _target().tokenizer, seq_len, 2, 0)
    return train


def _losses(cfg, target, source, steps: int) -> list[float]:
    trainer = DrafterTrainer(build_drafter(cfg, target, LAYERS, torch.device("cpu")), cfg, "cpu")
    return [trainer.step(*source(i)).loss for i in range(steps)]


@pytest.mark.parametrize("soft", [False, True])
def test_training_from_the_cache_gives_the_online_losses(tmp_path, soft) -> None:
    cfg = small_cfg(tmp_path, use_soft_labels=soft)
    target, data = _target(), _data(tmp_path)
    layout = dict(layer_ids=LAYERS, with_final_norm=soft)  # of the cache, written and read
    shards = dict(num_batches=5, batches_per_shard=2)
    out = write_hidden_cache(target, data, tmp_path / "cache", **layout, **shards)
    reader = open_hidden_cache(out, target=target, dataset=data, **layout)

    def online(i):
        batch = data.batch(i)
        docs = batch.doc_ids
        states = target.capture(
            batch.input_ids, LAYERS, with_logits=False, with_final_hidden=soft, doc_ids=docs
        )
        return batch, states

    def cached(i):
        return reader.get(i)

    batch, from_cache = cached(3)
    assert from_cache.hidden.dtype == target.embed_tokens.weight.dtype
    assert torch.equal(from_cache.hidden, online(3)[1].hidden)
    assert torch.equal(batch.doc_ids, data.batch(3).doc_ids)
    assert torch.equal(batch.position_ids, data.batch(3).position_ids)
    assert from_cache.logits is None
    if soft:  # the final-norm state: soft labels without logits, as online
        assert torch.equal(from_cache.final_hidden, online(3)[1].final_hidden)
        logits = target.capture(batch.input_ids, LAYERS, True, doc_ids=batch.doc_ids).logits
        assert torch.equal(reader.get(3, lm_head=target.lm_head)[1].logits, logits)
    assert _losses(cfg, target, cached, 5) == _losses(cfg, target, online, 5)
    with pytest.raises(HiddenCacheError, match="holds batches 0..4"):
        reader.get(5)


def test_an_interrupted_cache_is_continued(tmp_path) -> None:
    target, data = _target(), _data(tmp_path)
    shards = dict(layer_ids=LAYERS, batches_per_shard=2)
    full = write_hidden_cache(target, data, tmp_path / "full", num_batches=5, **shards)
    part = tmp_path / "part"
    write_hidden_cache(target, data, part, num_batches=3, **shards)
    (part / ".shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # a killed write
    write_hidden_cache(target, data, part, num_batches=5, **shards)
    shards = json.loads((part / "index.json").read_text())["shards"]
    assert [s["first_batch"] for s in shards] == [0, 2, 3] and shards[-1]["num_batches"] == 2
    a = open_hidden_cache(full, target=target, dataset=data, layer_ids=LAYERS)
    b = open_hidden_cache(part, target=target, dataset=data, layer_ids=LAYERS)
    for i in range(5):
        assert torch.equal(a.get(i)[1].hidden, b.get(i)[1].hidden)


def test_a_cache_of_another_run_is_refused(tmp_path) -> None:
    target, data = _target(), _data(tmp_path)
    out = write_hidden_cache(target, data, tmp_path / "c", layer_ids=LAYERS, num_batches=2)
    with pytest.raises(HiddenCacheError, match=r"another target layers: it has \[1, 2\]"):
        open_hidden_cache(out, target=target, dataset=data, layer_ids=[1, 3])
    with pytest.raises(HiddenCacheError, match="another --seq-len: it has 32, this run 16"):
        open_hidden_cache(out, target=target, dataset=_data(tmp_path, 16), layer_ids=LAYERS)
    other_order, _ = build_datasets(str(write_corpus(tmp_path)), target.tokenizer, 32, 2, 7)
    with pytest.raises(HiddenCacheError, match="another data"):
        open_hidden_cache(out, target=target, dataset=other_order, layer_ids=LAYERS)
    with pytest.raises(HiddenCacheError, match="another target weights"):
        open_hidden_cache(out, target=_target(seed=1), dataset=data, layer_ids=LAYERS)
    with pytest.raises(HiddenCacheError, match="another target layers"):
        write_hidden_cache(target, data, out, layer_ids=[0], num_batches=3)
    with pytest.raises(HiddenCacheError, match="not a hidden-state cache"):
        open_hidden_cache(tmp_path, target=target, dataset=data, layer_ids=LAYERS)


def test_truncated_or_corrupt_shards_are_refused(tmp_path) -> None:
    target, data = _target(), _data(tmp_path)
    out = write_hidden_cache(target, data, tmp_path / "c", layer_ids=LAYERS, num_batches=2)
    shard = out / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF  # same size, one flipped byte in the tensor data
    shard.write_bytes(bytes(raw))
    reader = open_hidden_cache(out, target=target, dataset=data, layer_ids=LAYERS)
    with pytest.raises(HiddenCacheError, match="corrupt \\(checksum mismatch\\)"):
        reader.get(0)
    shard.write_bytes(bytes(raw[:-100]))
    with pytest.raises(HiddenCacheError, match="truncated or missing"):
        open_hidden_cache(out, target=target, dataset=data, layer_ids=LAYERS)


def _cache_cli(tmp_path, cache, *extra):
    sizes = "--seq-len 32 --batch-size 2 --drafter-layers 1 --steps 6".split()
    opts = ["--data", str(write_corpus(tmp_path)), *sizes]
    args = ["cache-hidden", "--output", str(cache), *opts, *map(str, extra)]
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def _traced(run):
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import tracing

    exporter = InMemorySpanExporter()
    tracing.setup(tracing.TracingConfig(), span_processors=[SimpleSpanProcessor(exporter)])
    try:
        summary = run()
    finally:
        tracing.shutdown(timeout_s=1.0)
    return summary, {s.name for s in exporter.get_finished_spans()}


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize("soft", [False, True])
def test_train_from_the_cache_gives_the_online_losses_through_the_pipeline(
    tmp_path, monkeypatch, soft
) -> None:
    cache = tmp_path / "cache"
    flags = ["--use-soft-labels"] if soft else []
    result = _cache_cli(tmp_path, cache, "--batches-per-shard", 4, *flags)
    assert result.exit_code == 0, result.output
    assert "cache-hidden: 6 batches (384 tokens" in result.output
    seen = record_losses(monkeypatch)
    opts = {"steps": 6, "use_soft_labels": soft, "log_every": 1}
    online_cfg = small_cfg(tmp_path, tmp_path / "online", **opts)
    online, online_spans = _traced(lambda: pipeline.run_pipeline(online_cfg, log=lambda _: None))
    online_losses, seen[:] = list(seen), []
    cfg = small_cfg(tmp_path, tmp_path / "cached", hidden_cache=str(cache), **opts)
    cached, cached_spans = _traced(lambda: pipeline.run_pipeline(cfg, log=lambda _: None))
    assert seen == online_losses and [b for b, _ in seen] == list(range(6))
    assert cached["final_loss"] == online["final_loss"]
    assert names.TARGET_READ in cached_spans and names.TARGET_FORWARD not in cached_spans
    assert names.TARGET_FORWARD in online_spans and names.TARGET_READ not in online_spans
    seen[:] = []
    run = dataclasses.replace(cfg.run, output_dir=str(tmp_path / "cached-reference"))
    reference = train_reference(dataclasses.replace(cfg, run=run), log=lambda _: None)
    assert seen == online_losses and reference["final_loss"] == online["final_loss"]


@pytest.mark.usefixtures("tiny_target")
def test_train_refuses_a_cache_of_another_run_or_too_short(tmp_path) -> None:
    cache = tmp_path / "cache"
    assert _cache_cli(tmp_path, cache, "--num-batches", 3).exit_code == 0

    def train(*extra):
        paths = ["--hidden-cache", str(cache), "--data", str(write_corpus(tmp_path))]
        sizes = "--seq-len 32 --batch-size 2 --drafter-layers 1 --block-size 4".split()
        out = ["--eval-prompts", "0", "--output-dir", str(tmp_path / "o")]
        args = ["train", *paths, *sizes, *out, *map(str, extra)]
        result = CliRunner().invoke(cli, args, catch_exceptions=False)
        assert result.exit_code == 2, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "Traceback" not in result.output, result.output
        return errors[0]

    assert "holds 3 batches" in train("--steps", "4") and "--num-batches 4" in train("--steps", 4)
    assert "another target layers" in train("--steps", 3, "--target-layers", "0")
    assert "another --seq-len" in train("--steps", 3, "--seq-len", 16)
    assert "another final-norm states" in train("--steps", 3, "--use-soft-labels")
    assert "another data" in train("--steps", 3, "--seed", 5)
    shard = cache / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # same size, one byte flipped: found before the first step
    shard.write_bytes(bytes(data))
    assert "corrupt (checksum mismatch)" in train("--steps", 3)
    assert not (tmp_path / "o").exists()  # no step ran, nothing of the run was written
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in train("--steps", 3)


@pytest.mark.parametrize("damage", ["flipped byte", "deleted", "truncated"])
def test_a_rerun_verifies_every_shard_and_writes_a_damaged_one_again(tmp_path, damage) -> None:
    """The reader's advice, "rerun cache-hidden", holds: the rerun does not answer
    "complete" over a damaged shard, nor loop back to the same advice."""
    target, data = _target(), _data(tmp_path)
    cache = tmp_path / "cache"

    def write(log=None):
        options = {"layer_ids": LAYERS, "num_batches": 6, "batches_per_shard": 2, "log": log}
        return write_hidden_cache(target, data, cache, **options)

    write()
    shard = cache / "shard-00001.safetensors"
    good = shard.read_bytes()
    if damage == "flipped byte":
        shard.write_bytes(good[:-9] + bytes([good[-9] ^ 0xFF]) + good[-8:])
    elif damage == "deleted":
        shard.unlink()
    else:
        shard.write_bytes(good[: len(good) // 2])
    with pytest.raises(HiddenCacheError, match="rerun cache-hidden"):  # what the reader says
        open_hidden_cache(cache, target=target, dataset=data, layer_ids=LAYERS).verify(0, 5)
    lines: list[str] = []
    others = {p.name: p.read_bytes() for p in cache.glob("shard-*") if p != shard}
    write(lines.append)
    why = {
        "flipped byte": "corrupt (checksum mismatch)",
        "deleted": "missing",
        "truncated": f"truncated ({len(good) // 2} of {len(good)} bytes)",
    }[damage]
    assert lines == [f"cache-hidden: {shard} was {why}: written again"]
    assert shard.read_bytes() == good  # the same batches give the same bytes
    assert {p.name: p.read_bytes() for p in cache.glob("shard-*") if p != shard} == others
    open_hidden_cache(cache, target=target, dataset=data, layer_ids=LAYERS).verify(0, 5)
    lines.clear()
    write(lines.append)  # an intact cache: verified, nothing written
    assert lines == []


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
def test_bf16_states_are_stored_as_computed_at_half_the_disk(tmp_path, monkeypatch) -> None:
    """A target computing in bf16 writes bf16 states, never widened: half the bytes of
    the fp32 cache, and training from them gives the online bf16 losses bit for bit;
    bf16 against fp32 (cache and training) stays within 2 % over 6 steps."""
    from safetensors import safe_open

    sizes, losses = {}, {}
    seen = record_losses(monkeypatch)
    for precision in ("bf16", "fp32"):
        cache = tmp_path / f"cache-{precision}"
        result = _cache_cli(tmp_path, cache, "--precision", precision)
        assert result.exit_code == 0, result.output
        shards = sorted(cache.glob("shard-*.safetensors"))
        with safe_open(str(shards[0]), "pt") as f:
            dtypes = {f.get_tensor(key).dtype for key in f.keys() if "hidden" in key}
        assert dtypes == {torch.bfloat16 if precision == "bf16" else torch.float32}, dtypes
        sizes[precision] = sum(s.stat().st_size for s in shards)
        opts = {"steps": 6, "precision": precision, "log_every": 1}
        cfg = small_cfg(tmp_path, tmp_path / f"run-{precision}", hidden_cache=str(cache), **opts)
        seen[:] = []
        pipeline.run_pipeline(cfg, log=lambda _: None)
        losses[precision] = [loss for _, loss in seen]
    online = small_cfg(tmp_path, tmp_path / "online-bf16", steps=6, precision="bf16")
    seen[:] = []
    pipeline.run_pipeline(online, log=lambda _: None)
    assert [loss for _, loss in seen] == losses["bf16"]
    assert 0.45 < sizes["bf16"] / sizes["fp32"] < 0.55, sizes
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["bf16"], losses["fp32"], strict=True))
    assert worst < 0.02, (losses, worst)
