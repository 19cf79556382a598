"""The drafter takes the target's geometry, and rotates exactly as the target does."""

import pytest
import torch

from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.nn.rope import RopeError, RopeSpec, rope_from_config
from dflash.target.geometry import TargetError, geometry_from_hf_config
from dflash.target.load import load_target
from dflash.target.model import check_mask_token_unused, resolve_mask_token
from tests.dflash.hf_fixtures import SPARE_ROWS, llama3_config, qwen3_config, save_hf_target

POSITIONS = torch.tensor([[0, 1, 7, 63, 64, 200, 1000, 4000]])


def _hf_rotary(config):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cls = Qwen3RotaryEmbedding if config.model_type == "qwen3" else LlamaRotaryEmbedding
    return cls(config)


def _drafter_for_geometry(config) -> DFlashDrafter:
    geo = geometry_from_hf_config(config)
    sizes = dict(hidden_size=config.hidden_size, num_layers=1, intermediate_size=32, block_size=4)
    heads = dict(num_heads=geo.num_heads, num_kv_heads=geo.num_kv_heads, head_dim=geo.head_dim)
    positions = dict(rope=geo.rope, max_position_embeddings=geo.max_position_embeddings)
    vocab = dict(target_layer_ids=[1], mask_token_id=0, vocab_size=8)
    cfg = DrafterConfig(**sizes, **heads, **positions, **vocab, rms_eps=geo.rms_norm_eps)
    return DFlashDrafter(cfg, torch.nn.Embedding(8, config.hidden_size), torch.nn.Linear(64, 8))


YARN = dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=128)
LINEAR = dict(rope_type="linear", rope_theta=1e4, factor=2.0)


@pytest.mark.parametrize(
    "config",
    [
        qwen3_config(40),
        llama3_config(40),
        qwen3_config(40, rope_parameters=YARN),
        llama3_config(40, rope_parameters=LINEAR),
    ],
    ids=["qwen3-default", "llama3-scaling", "qwen3-yarn", "llama-linear"],
)
def test_drafter_rope_equals_the_targets_rotary_embedding(config) -> None:
    drafter = _drafter_for_geometry(config)
    x = torch.zeros(1, POSITIONS.shape[1], config.head_dim)
    ref_cos, ref_sin = _hf_rotary(config)(x, POSITIONS)
    cos, sin = drafter.rope(POSITIONS)
    assert cos.shape == ref_cos.shape == (1, POSITIONS.shape[1], 32)
    assert torch.allclose(cos, ref_cos, atol=1e-5) and torch.allclose(sin, ref_sin, atol=1e-5)


def test_llama3_scaling_changes_the_low_frequencies() -> None:
    plain = _drafter_for_geometry(llama3_config(40, rope_parameters={"rope_theta": 5e5}))
    scaled = _drafter_for_geometry(llama3_config(40))
    assert torch.allclose(plain._inv_freq[:2], scaled._inv_freq[:2])  # short wavelengths kept
    assert torch.allclose(plain._inv_freq[-1] / 8, scaled._inv_freq[-1])  # long ones / factor


def test_geometry_fields_come_from_the_target_config() -> None:
    qwen = geometry_from_hf_config(qwen3_config(40))
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (4, 2, 32)
    assert qwen.rope == RopeSpec(1e6) and qwen.rms_norm_eps == 1e-5
    assert qwen.max_position_embeddings == 512 and not qwen.attention_bias
    llama = geometry_from_hf_config(llama3_config(40))
    assert (llama.num_kv_heads, llama.head_dim, llama.attention_bias) == (1, 32, True)
    assert llama.rope.rope_type == "llama3" and llama.rope.theta == 5e5
    assert llama.rope.scaling["factor"] == 8.0


def test_rope_reads_both_config_layouts() -> None:
    v4 = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    v5 = {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}
    assert rope_from_config(v4) == rope_from_config(v5) == RopeSpec(5e5, "linear", {"factor": 2.0})
    assert rope_from_config({}) == RopeSpec(10000.0)
    with pytest.raises(RopeError, match="'dynamic' depends on the sequence length"):
        rope_from_config({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_mask_token_choice_order() -> None:
    class Tok:
        mask_token_id = None

        def __len__(self) -> int:
            return 10

    assert resolve_mask_token(Tok(), 16).source == "spare-row"
    assert resolve_mask_token(Tok(), 16).token_id == 10
    assert resolve_mask_token(Tok(), 16, explicit_id=3).source == "explicit"
    with pytest.raises(TargetError, match="--mask-token-id 16 is out of range"):
        resolve_mask_token(Tok(), 16, explicit_id=16)
    with pytest.raises(TargetError, match="give --mask-token-id"):
        resolve_mask_token(Tok(), 10)
    Tok.mask_token_id = 4
    assert resolve_mask_token(Tok(), 10).source == "tokenizer"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_drafter_for_a_hugging_face_target_has_its_geometry(tmp_path, arch) -> None:
    target = load_target(str(save_hf_target(tmp_path / arch, arch)))
    cfg = DrafterConfig.for_target(target, num_layers=2, block_size=4)
    assert (cfg.head_dim, cfg.num_heads) == (32, 4) and cfg.hidden_size == 64
    assert cfg.num_kv_heads == (2 if arch == "qwen3" else 1)
    assert cfg.rope.theta == (1e6 if arch == "qwen3" else 5e5)
    assert cfg.mask_token_source == "spare-row"
    assert cfg.mask_token_id == target.embed_tokens.num_embeddings - SPARE_ROWS
    assert target.stop_token_ids == (target.tokenizer.eos_token_id,)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    rotary = target.model.model.rotary_emb
    ref_cos, _ = rotary(torch.zeros(1, 8, 32), POSITIONS)
    assert torch.allclose(drafter.rope(POSITIONS)[0], ref_cos, atol=1e-5)


def test_a_mask_id_the_data_uses_is_an_error() -> None:
    import numpy as np

    check_mask_token_unused(9, [np.array([1, 2, 3]), torch.tensor([4, 5])])
    with pytest.raises(TargetError, match="--mask-token-id 5 is a token the training data uses"):
        check_mask_token_unused(5, [np.array([1, 2, 3]), torch.tensor([4, 5])])
