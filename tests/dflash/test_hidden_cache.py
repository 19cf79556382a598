import json

import pytest
import torch
from app_fixtures import SMALL_LM, small_cfg, write_corpus
from dflash.trainer import DrafterTrainer, build_drafter

from dflash.data import build_datasets
from dflash.hidden_cache import HiddenCacheError, open_hidden_cache, write_hidden_cache
from dflash.target import wrap_tiny
from dflash.tiny import TinyLM

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
    out = write_hidden_cache(
        target, data, tmp_path / "cache", layer_ids=LAYERS, num_batches=5,
        with_final_norm=soft, batches_per_shard=2,
    )  # fmt: skip
    reader = open_hidden_cache(out, target=target, dataset=data, layer_ids=LAYERS,
                               with_final_norm=soft)  # fmt: skip

    def online(i):
        batch = data.batch(i)
        docs = batch.doc_ids
        return batch, target.capture(batch.input_ids, LAYERS, with_logits=False,
                                     with_final_hidden=soft, doc_ids=docs)  # fmt: skip

    def cached(i):
        return reader.get(i, lm_head=target.lm_head if soft else None)

    batch, from_cache = cached(3)
    assert from_cache.hidden.dtype == target.embed_tokens.weight.dtype
    assert torch.equal(from_cache.hidden, online(3)[1].hidden)
    assert _losses(cfg, target, cached, 5) == _losses(cfg, target, online, 5)
    with pytest.raises(HiddenCacheError, match="holds batches 0..4"):
        reader.get(5)


def test_an_interrupted_cache_is_continued(tmp_path) -> None:
    target, data = _target(), _data(tmp_path)
    full = write_hidden_cache(target, data, tmp_path / "full", layer_ids=LAYERS, num_batches=5,
                              batches_per_shard=2)  # fmt: skip
    part = tmp_path / "part"
    write_hidden_cache(target, data, part, layer_ids=LAYERS, num_batches=3, batches_per_shard=2)
    (part / ".shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # a killed write
    write_hidden_cache(target, data, part, layer_ids=LAYERS, num_batches=5, batches_per_shard=2)
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
    with pytest.raises(HiddenCacheError, match="another data"):
        open_hidden_cache(out, target=target, dataset=_data(tmp_path, 16), layer_ids=LAYERS)
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
