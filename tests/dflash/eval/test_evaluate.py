import itertools
import json
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from dflash.config.settings import LossConfig
from dflash.drafter.model import DFlashDrafter, DrafterConfig
from dflash.eval.evaluate import evaluate_tau
from dflash.eval.prompts import PromptError, load_chat_prompts
from dflash.eval.speculative import speculative_generate
from dflash.eval.walk import WalkRow, prepare_walk, walk_cycles, walk_tau
from dflash.nn.kvcache import KVCache
from dflash.objective.blocks import block_labels, build_blocks, select_anchors
from dflash.objective.reference import dflash_loss
from dflash.target.decoding import GenerationError
from dflash.target.generation import generate, greedy_generate
from dflash.target.load import wrap_tiny
from dflash.target.model import TargetModel
from dflash.target.tiny import TinyLM, TinyLMConfig

SMALL_LM = TinyLMConfig(hidden_size=32, num_layers=6, num_heads=2, intermediate_size=64)
BS = 4
PROMPTS = [[10, 20, 30, 40, 50], [97, 98, 99], [1]]
NO_STOP: tuple[int, ...] = ()


@pytest.fixture(scope="module")
def target() -> TargetModel:
    torch.manual_seed(0)
    return wrap_tiny(TinyLM(SMALL_LM))


def make_drafter(target: TargetModel) -> DFlashDrafter:
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=BS)
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head)


@dataclass
class OracleDrafter:
    """Proposes the target's true greedy tokens, spoiling draft index 1 every other cycle."""

    reference: list[int]
    config: DrafterConfig
    cycles: int = 0
    training: bool = False
    seen: list[int] = field(default_factory=list)

    def _logits(self, anchor_token: int, anchor_pos: int) -> torch.Tensor:
        assert self.reference[anchor_pos] == anchor_token
        proposal = self.reference[anchor_pos + 1 : anchor_pos + BS]
        if self.cycles % 2:
            proposal[1] = (proposal[1] + 1) % 256
        self.cycles += 1
        return torch.nn.functional.one_hot(torch.tensor(proposal), 260).float()

    def draft_logits(self, hidden: torch.Tensor, anchor_token: int, anchor_pos: int):
        assert hidden.shape[1] >= anchor_pos  # features of every token before the anchor
        return self._logits(anchor_token, anchor_pos)

    def draft_logits_cached(self, new_hidden, anchor_token: int, anchor_pos: int, cache):
        self.seen.append(new_hidden.shape[1])  # features the drafter's cache lacked
        return self._logits(anchor_token, anchor_pos)

    def eval(self) -> None:
        pass

    def train(self, mode: bool) -> None:
        pass


@pytest.mark.parametrize("use_cache", [False, True])
def test_acceptance_counts_follow_the_drafts(target: TargetModel, use_cache: bool) -> None:
    prompt, n = PROMPTS[0], 13
    reference = prompt + greedy_generate(target, prompt, n + BS, use_cache=False)
    oracle = OracleDrafter(reference, make_drafter(target).config)
    tokens, stats = speculative_generate(target, oracle, prompt, n, use_cache=use_cache)  # type: ignore[arg-type]
    assert tokens == reference[len(prompt) : len(prompt) + n]
    # 1 token from the prefill, then cycles of 4 (all accepted) and 2 (spoiled at index 1).
    assert stats.accepted_per_cycle == [3, 1, 3, 1]
    assert stats.target_forwards == 5 and stats.new_tokens == n
    if use_cache:  # the prompt, then the anchor plus the accepted drafts of each cycle
        assert oracle.seen == [len(prompt), 4, 2, 4]
    fresh = OracleDrafter(reference, oracle.config)
    result = evaluate_tau(target, fresh, [prompt], n, stop_token_ids=NO_STOP, use_cache=use_cache)  # type: ignore[arg-type]
    assert result.tau == result.tau_pooled == (4 + 2 + 4 + 2) / 4
    assert result.acceptance_per_position == [1.0, 0.5, 0.5]


def test_tau_is_the_mean_of_per_prompt_means() -> None:
    from dflash.eval.evaluate import _summarize
    from dflash.eval.speculative import SpecStats

    stats = [SpecStats([3, 3, 3, 3], 5, 16), SpecStats([0, 0], 3, 3)]
    figures = _summarize(stats, BS)
    assert figures["tau"] == (4.0 + 1.0) / 2  # each prompt counts once
    assert figures["tau_pooled"] == (4 * 4 + 2 * 1) / 6  # each cycle counts once
    assert figures["acceptance_per_position"] == [4 / 6, 4 / 6, 4 / 6]


@pytest.mark.parametrize("use_cache", [False, True])
def test_speculative_equals_greedy_with_an_untrained_drafter(target, use_cache) -> None:
    drafter = make_drafter(target)
    for prompt in PROMPTS:
        tokens, stats = speculative_generate(target, drafter, prompt, 12, use_cache=use_cache)
        assert tokens == greedy_generate(target, prompt, 12, use_cache=False)
        assert stats.target_forwards == 1 + len(stats.accepted_per_cycle)
    opts = {"stop_token_ids": NO_STOP, "use_cache": use_cache, "compare_baseline": True}
    result = evaluate_tau(target, drafter, PROMPTS, 12, **opts)
    assert 1.0 <= result.tau <= BS
    assert len(result.acceptance_per_position) == BS - 1
    assert result.num_cycles > 0 and result.new_tokens == 3 * 12
    assert result.tokens_per_target_forward == pytest.approx(36 / (3 + result.num_cycles))
    assert result.speedup is not None and result.speedup > 0


def test_cached_generation_equals_the_cache_less_one(target: TargetModel) -> None:
    for prompt in PROMPTS:
        assert generate(target, prompt, 20) == generate(target, prompt, 20, use_cache=False)
    cache = KVCache()
    ids = torch.tensor([PROMPTS[0] + [7, 8, 9]])
    full = target.logits(ids)
    part = target.forward_cached(ids[:, :5], cache, [1, 2])
    target.crop_cache(cache, 3)  # forget positions 3, 4 and feed them again
    rest = target.forward_cached(ids[:, 3:], cache, [1, 2])
    assert torch.allclose(rest.logits, full[:, 3:], atol=1e-5)
    assert part.hidden.shape == (1, 5, 64) and cache.seq_len() == 8


def test_generation_stops_after_a_stop_token(target: TargetModel) -> None:
    free = greedy_generate(target, PROMPTS[0], 12)
    stop = free[4]
    first = free.index(stop)
    assert greedy_generate(target, PROMPTS[0], 12, stop_token_ids=[stop]) == free[: first + 1]
    drafter = make_drafter(target)
    tokens, _ = speculative_generate(target, drafter, PROMPTS[0], 12, stop_token_ids=[stop])
    assert tokens == free[: first + 1]


def test_bad_decoding_settings_are_one_line_errors(target: TargetModel) -> None:
    drafter = make_drafter(target)
    with pytest.raises(GenerationError, match="--max-new-tokens 0 must be > 0"):
        evaluate_tau(target, drafter, PROMPTS, 0)
    with pytest.raises(GenerationError, match="--temperature -0.5 must be >= 0"):
        speculative_generate(target, drafter, PROMPTS[0], 4, temperature=-0.5)


def _train_on_greedy_text(target: TargetModel, drafter: DFlashDrafter, steps: int) -> None:
    """A few steps on the target's own continuations: enough to accept some drafts."""
    seqs = [p + greedy_generate(target, p, 24) for p in PROMPTS[:2]]
    length = min(map(len, seqs))
    ids = torch.tensor([s[:length] for s in seqs])  # [2, T]
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    hidden = target.capture(ids, drafter.config.target_layer_ids, with_logits=False).hidden
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        anchors, keep = select_anchors(loss_mask, 16, gen)
        blocks = build_blocks(ids, anchors, BS, drafter.mask_id)
        labels, valid = block_labels(ids, loss_mask, anchors, keep, BS)
        logits = drafter(hidden, blocks, anchors, keep)
        loss = dflash_loss(logits, labels, valid, LossConfig()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.slow
def test_trained_drafter_same_tau_with_and_without_caches(target: TargetModel) -> None:
    drafter = make_drafter(target)
    untrained = evaluate_tau(target, drafter, PROMPTS[:2], 16, stop_token_ids=NO_STOP)
    _train_on_greedy_text(target, drafter, steps=40)
    for prompt in PROMPTS:
        tokens, _ = speculative_generate(target, drafter, prompt, 16)
        assert tokens == greedy_generate(target, prompt, 16, use_cache=False)
    cached = evaluate_tau(target, drafter, PROMPTS, 16, stop_token_ids=NO_STOP)
    plain = evaluate_tau(target, drafter, PROMPTS, 16, stop_token_ids=NO_STOP, use_cache=False)
    assert cached.tau > untrained.tau
    assert (cached.tau, cached.tau_pooled) == (plain.tau, plain.tau_pooled)
    assert cached.acceptance_per_position == plain.acceptance_per_position
    assert drafter.training  # evaluate_tau restores the mode it found


@pytest.mark.slow
@pytest.mark.parametrize("max_new_tokens", [16, 5])
def test_the_serving_walk_replays_greedy_speculative_decoding(target, max_new_tokens) -> None:
    """One drafter forward over the target's continuations gives the cycles decoding
    takes, so the same τ, pooled τ and acceptance per position (5 tokens: the last cycle
    scores drafts past the end, as the verifier does)."""
    drafter = make_drafter(target)
    _train_on_greedy_text(target, drafter, steps=40)
    layers = drafter.config.target_layer_ids
    rows = prepare_walk(target, layers, PROMPTS, max_new_tokens, BS)
    walked = walk_tau(drafter, rows, max_new_tokens, NO_STOP)
    decoded = evaluate_tau(target, drafter, PROMPTS, max_new_tokens, stop_token_ids=NO_STOP)
    assert decoded.tau_pooled > 1.2  # drafts are accepted: the comparison means something
    assert walked.tau == pytest.approx(decoded.tau, abs=1e-12)
    assert walked.tau_pooled == pytest.approx(decoded.tau_pooled, abs=1e-12)
    assert walked.acceptance_per_position == pytest.approx(decoded.acceptance_per_position)
    assert drafter.training  # the walk restores the mode it found


def test_walk_cycles_count_as_decoding_does() -> None:
    """Anchors 3 (the target's first token), then 3+2+1 = 6, then 6+0+1 = 7; a cycle
    starts while fewer than max_new_tokens are out (anchor 7: 5 of them), and none after
    a stop token among the accepted drafts and the verifier's own."""
    tokens = [0, 1, 2, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    row = WalkRow(tokens, prompt_len=3, hidden=torch.zeros(1, len(tokens), 1))
    drafts = torch.full((len(tokens) - 3, 3), -1)
    drafts[0] = torch.tensor([11, 12, 99])  # at anchor 3: two accepted
    drafts[3] = torch.tensor([99, 15, 16])  # at anchor 6: none
    drafts[4] = torch.tensor([15, 16, 17])  # at anchor 7: three
    assert walk_cycles(drafts, row, max_new_tokens=6) == [2, 0, 3]
    assert walk_cycles(drafts, row, max_new_tokens=5) == [2, 0]
    assert walk_cycles(drafts, row, max_new_tokens=4) == [2]
    assert walk_cycles(drafts, row, max_new_tokens=5, stop_token_ids=[12]) == [2]
    assert walk_cycles(drafts, row, max_new_tokens=5, stop_token_ids=[10]) == []


def _exact_distribution(target: TargetModel, prompt: list[int], n: int, vocab: int, t: float):
    """p(x1..xn | prompt) at temperature t for every sequence of the tiny vocabulary."""
    dist = {}
    for seq in itertools.product(range(vocab), repeat=n):
        logits = target.logits(torch.tensor([prompt + list(seq[:-1])]))[0, len(prompt) - 1 :]
        probs = torch.softmax(logits.double() / t, -1)
        dist[seq] = float(torch.prod(probs[torch.arange(n), torch.tensor(seq)]))
    return dist


@pytest.mark.slow
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_sampling_keeps_the_targets_output_distribution(draft_sampling) -> None:
    """Greedy drafts accepted with probability p(x) (the authors' and vLLM's rule) and
    sampled drafts accepted with min(1, p/q) both decode the target's own law."""
    vocab, n, runs, temp = 5, 3, 3000, 0.8
    torch.manual_seed(0)
    sizes = dict(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
    tiny = TinyLM(TinyLMConfig(vocab_size=vocab + 1, **sizes))
    with torch.no_grad():
        tiny.lm_head.weight.mul_(40.0)  # peaked, distinct distributions per context
        tiny.lm_head.weight[vocab] = -1e4  # row 5 is the mask row: never produced
    target = wrap_tiny(tiny)
    cfg = DrafterConfig.for_target(target, num_layers=1, block_size=3, mask_token_id=vocab)
    torch.manual_seed(3)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head).eval()
    prompt = [1, 2]
    exact = _exact_distribution(target, prompt, n, vocab, temp)
    gen = torch.Generator().manual_seed(0)
    opts = {"temperature": temp, "generator": gen, "draft_sampling": draft_sampling}
    counts = Counter(
        tuple(speculative_generate(target, drafter, prompt, n, **opts)[0]) for _ in range(runs)
    )
    tv = 0.5 * sum(abs(counts[s] / runs - p) for s, p in exact.items())
    assert tv < 0.06, f"total variation {tv:.3f} from the target's distribution"
    # The check can fail: accepting every draft unverified gives another law.
    hidden = target.capture(torch.tensor([prompt]), cfg.target_layer_ids, False).hidden
    p1 = torch.softmax(target.logits(torch.tensor([prompt]))[0, -1] / temp, -1)
    unverified = Counter()
    for _ in range(runs // 3):
        first = int(torch.multinomial(p1, 1, generator=gen))
        q = torch.softmax(drafter.draft_logits(hidden, first, len(prompt)) / temp, -1)
        unverified[(first, *torch.multinomial(q, 1, generator=gen)[:, 0].tolist())] += 1
    tv_bad = 0.5 * sum(abs(unverified[s] / (runs // 3) - p) for s, p in exact.items())
    assert tv_bad > 0.15, f"unverified drafts are too close to the target ({tv_bad:.3f})"


def test_chat_prompts_cut_at_the_last_user_turn(tmp_path) -> None:
    from dflash.data.tokenizer import BOS_ID, ByteTokenizer

    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    sharegpt = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    rows = [{"messages": chat}, {"turns": ["first", "second"]}, {"conversations": sharegpt}]
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tok = ByteTokenizer()
    texts = [bytes(p[1:]).decode() for p in load_chat_prompts(path, tok)]
    assert texts[0] == "<|user|>\nhi\n<|assistant|>\nyo\n<|user|>\n2+2?\n<|assistant|>\n"
    assert texts[1] == "<|user|>\nfirst\n<|assistant|>\n"
    assert texts[2] == "<|user|>\nq\n<|assistant|>\n"
    assert all(p[0] == BOS_ID for p in load_chat_prompts(path, tok))
    assert len(load_chat_prompts(path, tok, limit=2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no chat"}) + "\n")
    with pytest.raises(PromptError, match=r"bad.jsonl:1: no chat turns"):
        load_chat_prompts(bad, tok)
    bad.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(PromptError, match="no chat turns"):
        load_chat_prompts(bad, tok)


def test_chat_template_renders_the_generation_prompt(tmp_path) -> None:
    from tests.dflash.hf_fixtures import save_word_tokenizer

    tok = save_word_tokenizer(tmp_path)
    path = tmp_path / "eval.jsonl"
    messages = [{"role": "user", "content": "add a b"}, {"role": "assistant", "content": "x"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    (ids,) = load_chat_prompts(path, tok)
    assert tok.decode(ids) == "<s> user add a b </s> <s> assistant"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hugging_face_target_with_dynamic_cache_decodes_like_greedy(tmp_path, arch) -> None:
    from dflash.target.load import load_target
    from tests.dflash.hf_fixtures import save_hf_target

    hf = load_target(str(save_hf_target(tmp_path / arch, arch)))
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(hf, num_layers=1, block_size=4)
    drafter = DFlashDrafter(cfg, hf.embed_tokens, hf.lm_head).eval()
    prompt = [2, 5, 6, 7]
    reference = greedy_generate(hf, prompt, 24, use_cache=False)
    assert greedy_generate(hf, prompt, 24) == reference  # DynamicCache path
    cached, stats = speculative_generate(hf, drafter, prompt, 24)
    plain, plain_stats = speculative_generate(hf, drafter, prompt, 24, use_cache=False)
    assert cached == plain == reference
    assert stats.accepted_per_cycle == plain_stats.accepted_per_cycle


def test_eval_of_a_saved_drafter_on_chat_prompts(target, tmp_path, monkeypatch) -> None:
    from dflash.drafter.io import save_drafter
    from dflash.eval.config import EvalConfig
    from dflash.eval.evaluate import evaluate_drafter_dir
    from dflash.target import load as target_mod

    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: target)
    saved = save_drafter(make_drafter(target), tmp_path / "drafter")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    rows = [chat, {"text": "skipped"}, {"turns": ["def f(x):"]}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines: list[str] = []
    settings = EvalConfig(eval_data=str(chats), num_prompts=None, max_new_tokens=12)
    figures = evaluate_drafter_dir(
        saved, "builtin:tiny", settings, "cpu", log=lines.append
    ).to_dict()
    assert figures["prompts"] == 2 and 0 < figures["new_tokens"] <= 24
    prompts = load_chat_prompts(chats, target.tokenizer)
    drafter = make_drafter(target)
    direct = evaluate_tau(target, drafter, prompts, 12)
    assert (figures["tau"], figures["tau_pooled"]) == (direct.tau, direct.tau_pooled)
    assert figures["speedup"] == pytest.approx(figures["greedy_s"] / figures["speculative_s"])
    skipped = "skipped 1 unusable JSONL lines"
    assert any(skipped in line and "chats.jsonl:2" in line for line in lines)
    assert any("pooled" in line and "vs greedy" in line for line in lines)
    with pytest.raises(GenerationError, match="--max-new-tokens 0"):
        EvalConfig(max_new_tokens=0)
    with pytest.raises(GenerationError, match="--temperature -1"):
        EvalConfig(temperature=-1.0)


def test_accepted_drafts_inside_loops_are_counted_apart() -> None:
    from dflash.eval.speculative import SpecStats

    # prompt 10 11 12 13; output loops "1 2 3 4" twice: from the second loop on, every
    # 4-gram has occurred before.
    prompt = [10, 11, 12, 13]
    out = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    stats = SpecStats(sequence=prompt + out)
    # cycles: 3 drafts accepted + 1 (positions 4..7), then 3 + 1 (8..11), then 1 + 1 (12..13)
    stats.cycle_starts, stats.accepted_per_cycle = [4, 8, 12], [3, 3, 1]
    assert stats.repeated_positions() == {11, 12, 13}
    inside, total, clean = stats.split_by_repeats()
    assert (inside, total) == (1, 7)  # the draft at 12; 11 is cycle 2's target token
    assert clean == [3]  # only the first cycle touches no repeated position


def test_every_turn_of_a_turns_file_is_evaluated_after_the_targets_reply(
    target, tmp_path, monkeypatch
) -> None:
    """MT-Bench's layout: the second question comes after the target's own answer to the
    first (at temperature 0 the speculative output is that answer)."""
    from dflash.data.tokenizer import decode_text
    from dflash.drafter.io import save_drafter
    from dflash.eval.config import EvalConfig
    from dflash.eval.evaluate import evaluate_drafter_dir
    from dflash.eval.prompts import render_prompt
    from dflash.target import load as target_mod
    from dflash.target.generation import greedy_generate

    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: target)
    saved = save_drafter(make_drafter(target), tmp_path / "drafter")
    chats = tmp_path / "turns.jsonl"
    turns = [["def f(x):", "and g?"], ["import os"]]
    chats.write_text("".join(json.dumps({"turns": t}) + "\n" for t in turns))
    settings = EvalConfig(eval_data=str(chats), num_prompts=None, max_new_tokens=8)
    figures = evaluate_drafter_dir(
        saved, "builtin:tiny", settings, "cpu", log=lambda _: None
    ).to_dict()
    assert (figures["prompts"], figures["turns"]) == (2, 3)
    # The second turn's prompt holds the target's greedy answer to the first.
    tok = target.tokenizer

    def user(content: str) -> dict[str, str]:
        return {"role": "user", "content": content}

    first = render_prompt(tok, [user("def f(x):")])
    answer = greedy_generate(target, first, 8, stop_token_ids=target.stop_token_ids)
    reply = {"role": "assistant", "content": decode_text(tok, answer)}
    second = render_prompt(tok, [user("def f(x):"), reply, user("and g?")])
    drafter = make_drafter(target)
    one_turn = render_prompt(tok, [user("import os")])
    direct = evaluate_tau(target, drafter, [first, one_turn, second], 8)
    assert figures["tau_pooled"] == pytest.approx(direct.tau_pooled)
