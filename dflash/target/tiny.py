"""The built-in tiny target: a Llama-style byte-level causal LM.

The project trained it itself on the embedded corpus (scripts/train_tiny_target.py)
and ships its weights (SHIPPED_DIR, 2.5 MB in bfloat16), so the embedded default needs
no download, trains no target on a fresh machine and decodes with the same weights
everywhere. Other shapes and recipes (tests, experiments) are trained once and cached.
The model part reads top to bottom; preparation (shipped, or trained + cached) follows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.data.corpus import embedded_corpus
from dflash.data.documents import document_causal_mask, document_positions
from dflash.data.tokenizer import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID
from dflash.files import cache_dir as cache_dir_default
from dflash.files import replacing, sha256_file, write_json_atomic
from dflash.nn.kvcache import KVCache
from dflash.nn.layers import RMSNorm, SwiGLU, apply_rope, merge_heads, rope_cos_sin, split_heads
from dflash.nn.rope import RopeSpec
from dflash.nn.schedule import warmup_cosine
from dflash.target.geometry import TargetError, TargetGeometry

SHIPPED_DIR = Path(__file__).resolve().parent / "weights" / "tiny"
"""The shipped weights of builtin:tiny (made by scripts/train_tiny_target.py)."""
SHIPPED_SHA256 = "968c9bc210b9c20a4aebf38053d950d38abb27480fc1353c0c167e0d14e5caa0"
"""SHA-256 of SHIPPED_DIR/model.safetensors: every machine decodes with these weights."""

Rope = tuple[Tensor, Tensor]  # (cos, sin), each float32[B, T, Hd], of the rows' positions


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = BYTE_VOCAB_SIZE
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    intermediate_size: int = 352
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_position_embeddings(self) -> int:
        # Plain rope has no hard limit; a property, so the weights' cache key stays put.
        return 8192

    def geometry(self) -> TargetGeometry:
        """The target geometry of this LM (no grouped-query attention, plain rope)."""
        return TargetGeometry(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rope=RopeSpec(self.rope_theta),
            rms_norm_eps=self.rms_eps,
            max_position_embeddings=self.max_position_embeddings,
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyLMConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.theta = cfg.num_heads, cfg.head_dim, cfg.rope_theta
        self.layer_idx = layer_idx  # this layer's slot in a KVCache
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(
        self, x: Tensor, rope: Rope, mask: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        """x[B, T, D]; rope: (cos, sin) of x's positions; mask[B, 1, T, T] (True = attend)
        replaces the plain causal mask when given; with a cache, x continues the cached
        positions."""
        cos, sin = rope
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # 3 x [B, T, D]
        q = apply_rope(split_heads(q, self.num_heads), cos, sin)  # [B, H, T, Hd]
        k = apply_rope(split_heads(k, self.num_heads), cos, sin)  # [B, H, T, Hd]
        v = split_heads(v, self.num_heads)  # [B, H, T, Hd]
        if cache is None:
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.o_proj(merge_heads(out))  # [B, T, D]
        past = cache.layer_len(self.layer_idx)
        k, v = cache.update(self.layer_idx, k, v)  # [B, H, past+T, Hd]
        t = q.shape[2]
        # is_causal aligns top-left; with a past the diagonal sits at column past.
        mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(merge_heads(out))  # [B, T, D]


class TinyDecoderLayer(nn.Module):
    def __init__(self, cfg: TinyLMConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, x: Tensor, rope: Rope, mask: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        x = x + self.attn(self.input_norm(x), rope, mask, cache)
        return x + self.mlp(self.post_attn_norm(x))


class TinyLM(nn.Module):
    """Decoder-only LM; `layers[i]`'s output is "target layer i" for the drafter."""

    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TinyDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # The Hugging Face accessor names, so TargetModel treats both kinds alike.
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self, input_ids: Tensor, doc_ids: Tensor | None = None, cache: KVCache | None = None
    ) -> Tensor:
        """input_ids[B, T] -> logits[B, T, V].

        doc_ids[B, T] (packed rows): attention stays inside each document and
        positions restart at 0 per document, as if each ran alone. With a cache,
        input_ids follow the cached positions (one document: doc_ids must be None).
        """
        b, t = input_ids.shape
        mask = None
        if doc_ids is None:
            past = cache.seq_len() if cache is not None else 0
            positions = torch.arange(past, past + t, device=input_ids.device).expand(b, t)
        else:
            assert cache is None, "cached decoding runs one document"
            positions, mask = document_positions(doc_ids), document_causal_mask(doc_ids)
        rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, rope, mask, cache)
        return self.lm_head(self.norm(x))


# --- preparation: deterministic training on the embedded corpus, then a cache ---


@dataclass(frozen=True)
class TinyRecipe:
    """How the tiny target is trained; part of the cache key. The defaults made the shipped
    weights (scripts/train_tiny_target.py: about half an hour on two CPU cores)."""

    steps: int = 2400
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    eval_batches: int = 8
    format_version: int = 1


def _token_stream(texts: list[str]) -> Tensor:
    """All documents as one int16 stream of BOS + bytes + EOS (compact: ~10 M tokens)."""
    parts = []
    for text in texts:
        if not text:
            continue
        body = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)
        parts += [torch.tensor([BOS_ID], dtype=torch.int16), body.to(torch.int16)]
        parts.append(torch.tensor([EOS_ID], dtype=torch.int16))
    return torch.cat(parts)


def _sample_windows(stream: Tensor, batch: int, seq_len: int, gen: torch.Generator) -> Tensor:
    """Random windows of seq_len+1 tokens -> LongTensor[batch, seq_len+1]."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)  # [batch, seq_len+1]
    return stream[idx].long()


def _lm_loss(model: TinyLM, windows: Tensor) -> Tensor:
    logits = model(windows[:, :-1])  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())


def _lr_at(step: int, recipe: TinyRecipe) -> float:
    return recipe.lr * warmup_cosine(step, recipe.warmup_steps, recipe.steps, 0.1)


@torch.no_grad()
def heldout_loss(model: TinyLM, recipe: TinyRecipe, seed: int) -> float:
    """Mean next-byte CE (nats) on fixed windows of the held-out split."""
    gen = torch.Generator().manual_seed(seed + 1)
    stream = _token_stream(embedded_corpus("heldout"))
    model.eval()
    losses = [
        _lm_loss(model, _sample_windows(stream, recipe.batch_size, recipe.seq_len, gen)).item()
        for _ in range(recipe.eval_batches)
    ]
    return sum(losses) / len(losses)


def train_tiny_lm(
    cfg: TinyLMConfig, recipe: TinyRecipe, seed: int, log: Callable[[str], None] = print
) -> TinyLM:
    """Train the tiny LM on the embedded train split; same seed -> same weights."""
    torch.manual_seed(seed)
    model = TinyLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    stream = _token_stream(embedded_corpus("train"))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay}]
    opt = torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    start_s = time.perf_counter()
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, recipe)
        loss = _lm_loss(model, _sample_windows(stream, recipe.batch_size, recipe.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == recipe.steps - 1:
            elapsed_s = time.perf_counter() - start_s
            log(
                f"tiny target: step {step + 1}/{recipe.steps} loss {loss.item():.3f} "
                f"({elapsed_s:.0f} s)"
            )
    model.eval()
    return model


def cache_key(cfg: TinyLMConfig, recipe: TinyRecipe, seed: int) -> str:
    """Hash of architecture, recipe, seed and Python version (the corpus is the stdlib)."""
    blob = json.dumps(
        {
            "arch": asdict(cfg),
            "recipe": asdict(recipe),
            "seed": seed,
            "python": sys.version.split()[0],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def shipped_target(directory: Path = SHIPPED_DIR, sha256: str = SHIPPED_SHA256) -> Path:
    """`directory` when its weights are the shipped ones, else one line saying how to
    get them back."""
    weights = directory / "model.safetensors"
    if not (directory / "config.json").is_file() or not weights.is_file():
        why = "are missing"
    elif sha256_file(weights) != sha256:
        why = "are not the shipped file (another SHA-256)"
    else:
        return directory
    raise TargetError(
        f"the weights of builtin:tiny ({weights}) {why}: restore them from the repository "
        f"(git checkout -- {directory}) or remake them with scripts/train_tiny_target.py"
    )


def prepare_builtin_target(
    cache_dir: Path | str | None = None,
    seed: int = 0,
    log: Callable[[str], None] = print,
    cfg: TinyLMConfig | None = None,
    recipe: TinyRecipe | None = None,
) -> Path:
    """The tiny target's directory: the shipped weights for the default architecture,
    recipe and seed (checked against SHIPPED_SHA256; never retrained: that takes half an
    hour and would give other weights); any other combination is trained once and cached.

    A cached one is written to a temporary sibling then renamed, so an interrupted
    preparation never leaves a directory that looks complete.
    """
    cfg, recipe = cfg or TinyLMConfig(), recipe or TinyRecipe()
    if (cfg, recipe, seed) == (TinyLMConfig(), TinyRecipe(), 0):
        return shipped_target()
    root = Path(cache_dir) if cache_dir is not None else cache_dir_default()
    final = root / "targets" / cache_key(cfg, recipe, seed)
    if final.exists():
        why = cached_damage(final)
        if why is None:
            return final
        log(f"tiny target: the cached {final} {why}: it is prepared again")
        shutil.rmtree(final, ignore_errors=True)
    from safetensors.torch import save_file

    log(f"tiny target: preparing {final} (one time, about a minute or two on a CPU)")
    start_s = time.perf_counter()
    model = train_tiny_lm(cfg, recipe, seed, log)
    loss = heldout_loss(model, recipe, seed)
    prep_s = time.perf_counter() - start_s
    log(f"tiny target: held-out loss {loss:.3f} nats/byte, prepared in {prep_s:.0f} s")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        meta = {
            "arch": asdict(cfg),
            "recipe": asdict(recipe),
            "seed": seed,
            "heldout_loss": loss,
            "prep_s": prep_s,
            "sha256": sha256_file(tmp / "model.safetensors"),
        }
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first; its copy is equivalent (same key).
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def cached_damage(directory: Path) -> str | None:
    """Why a cached tiny target cannot be loaded as it was written (a file missing, cut
    short or changed: its config.json records the weights' SHA-256), or None."""
    try:
        meta = json.loads((directory / "config.json").read_text())
        TinyLMConfig(**meta["arch"])
    except (OSError, ValueError, KeyError, TypeError):
        return "has no readable config.json"
    weights = directory / "model.safetensors"
    if not weights.is_file():
        return "has no model.safetensors"
    if "sha256" in meta:
        return (
            None
            if sha256_file(weights) == meta["sha256"]
            else "has other weights than it recorded (another SHA-256)"
        )
    try:  # written before the SHA-256 was recorded: it must at least read whole
        load_tiny_lm(directory)
    except TargetError:
        return "has weights that do not load"
    return None


def save_tiny_lm(
    model: TinyLM,
    directory: Path,
    recipe: TinyRecipe,
    seed: int,
    extra: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """The weights (in `dtype`) and config.json of a trained tiny LM, each written
    atomically (scripts/train_tiny_target.py writes the shipped directory with this)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    meta = {
        "arch": asdict(model.config),
        "recipe": asdict(recipe),
        "seed": seed,
        "dtype": str(dtype).removeprefix("torch."),
        **(extra or {}),
    }
    with replacing(Path(directory) / "model.safetensors") as tmp:
        save_file(state, str(tmp))
    write_json_atomic(Path(directory) / "config.json", meta)


def load_tiny_lm(directory: Path) -> TinyLM:
    """The tiny LM saved in `directory`; TargetError naming the file when it is missing,
    damaged or of another shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        meta = json.loads((directory / "config.json").read_text())
        model = TinyLM(TinyLMConfig(**meta["arch"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TargetError(f"tiny target {directory}: config.json is unreadable ({exc})") from None
    weights = directory / "model.safetensors"
    try:
        model.load_state_dict(load_file(str(weights)))
    except (OSError, SafetensorError, RuntimeError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetError(f"tiny target {weights}: its weights do not load ({why})") from None
    return model.eval()
