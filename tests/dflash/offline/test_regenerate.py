import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dflash.offline.config import RegenerateConfig, RegenerateError
from dflash.offline.regenerate import regenerate
from dflash.target.generation import generate_batch, generate_padded, greedy_generate
from dflash.target.load import load_target, wrap_tiny
from dflash.target.tiny import TinyLM, TinyLMConfig

WORDS = "hello how are you fine thanks what is the weather sunny and cold tell me more".split()
U, A, S = "user", "assistant", "system"
CONVERSATIONS = [
    [
        (U, "hello how are you"),
        (A, "fine thanks"),
        (U, "what is the weather"),
        (A, "sunny and cold"),
    ],
    [(S, "tell me"), (U, "how are you"), (A, "fine")],
    [(U, "what is the weather"), (A, "cold")],
    [(U, "tell me more"), (A, "the weather is sunny"), (U, "and")],
    [(U, "hello"), (A, "hello")],
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Llama and a word-level tokenizer with a chat template, saved."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<|im_start|>", "<|im_end|>", *WORDS])}
    vocab |= {r: len(vocab) + i for i, r in enumerate(["user", "assistant", "system"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = dict(unk_token="[UNK]", eos_token="<|im_end|>", pad_token="<|im_end|>")
    specials["additional_special_tokens"] = ["<|im_start|>"]
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, **specials)
    tok.chat_template = TEMPLATE
    end = vocab["<|im_end|>"]
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    attention = dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    ends = dict(eos_token_id=end, bos_token_id=None, pad_token_id=end)
    cfg = LlamaConfig(vocab_size=len(vocab), **sizes, **attention, **ends)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _write_chats(path, conversations=CONVERSATIONS, extra_lines=()):
    chats = [[{"role": r, "content": c} for r, c in conv] for conv in conversations]
    lines = [json.dumps({"messages": messages}) for messages in chats]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


# No held-out documents: every conversation is regenerated.
SETTINGS = RegenerateConfig(max_new_tokens=6, batch_size=4, chunk_lines=2, heldout_fraction=0.0)


def _reference_reply(target, messages, settings) -> str:
    """transformers' own greedy `generate` on the templated conversation so far."""
    tok, model = target.tokenizer, target.model
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    greedy = dict(do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    new = model.generate(torch.tensor([ids]), max_new_tokens=settings.max_new_tokens, **greedy)
    out = new[0, len(ids) :].tolist()
    if tok.eos_token_id in out:
        out = out[: out.index(tok.eos_token_id)]
    return tok.decode(out, skip_special_tokens=True)


def test_regenerated_replies_are_transformers_greedy_generate(hf_dir, tmp_path) -> None:
    target = load_target(str(hf_dir))
    data = _write_chats(tmp_path / "chats.jsonl", extra_lines=['{"messages": "x"}'])
    progress = []
    out = tmp_path / "regen.jsonl"
    report = regenerate(target, str(data), out, settings=SETTINGS, progress=progress.append)
    assert report.skipped.skipped_lines == 1 and progress[-1].lines_done == report.lines
    assert progress[-1].tokens_per_s > 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == len(CONVERSATIONS) and report.new_tokens > 0
    for conv, record in zip(CONVERSATIONS, written, strict=True):
        so_far = []
        if conv[-1][0] == "user":  # a prompt: its reply is added
            conv = [*conv, ("assistant", None)]
        for (role, content), msg in zip(conv, record["messages"], strict=True):
            assert msg["role"] == role
            if role == "assistant":
                assert msg["content"] == _reference_reply(target, so_far, SETTINGS)
            else:
                assert msg["content"] == content
            so_far.append(msg)


def test_text_continuations_are_greedy_generate(hf_dir, tmp_path) -> None:
    target = load_target(str(hf_dir))
    data = tmp_path / "texts.jsonl"
    texts = ["hello how are you fine thanks what is the weather", "tell me more and more"]
    data.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    settings = RegenerateConfig(max_new_tokens=4, prefix_tokens=3, heldout_fraction=0.0)
    regenerate(target, str(data), tmp_path / "out.jsonl", settings=settings)
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    tok = target.tokenizer
    first = tok(texts[0], add_special_tokens=False)["input_ids"][:3]
    new = target.model.generate(
        torch.tensor([first]),
        max_new_tokens=4,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id,
    )
    tail = new[0, 3:].tolist()
    tail = tail[: tail.index(tok.eos_token_id)] if tok.eos_token_id in tail else tail
    assert written[0] == {"text": tok.decode(first + tail, skip_special_tokens=True), "id": 0}
    assert len(written) == 3  # windows of 3 + 4 tokens: two in the first text, one in the second


def test_tiny_cached_generation_is_the_uncached_greedy_decoding() -> None:
    torch.manual_seed(0)
    config = TinyLMConfig(hidden_size=32, num_layers=3, num_heads=2, intermediate_size=64)
    target = wrap_tiny(TinyLM(config))
    prompts = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(1)).tolist()
    cached = generate_batch(target, prompts, max_new_tokens=10, stop_token_ids=())
    assert cached == [greedy_generate(target, p, 10) for p in prompts]
    stop = cached[0][4]
    stopped = generate_batch(target, prompts[:1], max_new_tokens=10, stop_token_ids=(stop,))
    assert stopped == [cached[0][: cached[0].index(stop)]]


def test_an_interrupted_regeneration_continues_and_a_foreign_output_is_refused(
    hf_dir, tmp_path
) -> None:
    target = load_target(str(hf_dir))
    data = _write_chats(tmp_path / "chats.jsonl")
    full = tmp_path / "full.jsonl"
    regenerate(target, str(data), full, settings=SETTINGS)
    part = tmp_path / "part.jsonl"
    regenerate(target, str(data), part, settings=SETTINGS)
    lines = full.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:3]) + lines[3][:10])  # killed while writing line 4
    report = regenerate(target, str(data), part, settings=SETTINGS)
    assert report.resumed_from_line == 2 and part.read_text() == full.read_text()
    assert regenerate(target, str(data), part, settings=SETTINGS).new_tokens == 0  # complete
    other = RegenerateConfig(max_new_tokens=3, batch_size=4, chunk_lines=2, heldout_fraction=0.0)
    with pytest.raises(RegenerateError, match="not a resumable file of this run"):
        regenerate(target, str(data), part, settings=other)
    stranger = tmp_path / "notes.jsonl"
    stranger.write_text('{"text": "mine"}\n')
    with pytest.raises(RegenerateError, match="no run record"):
        regenerate(target, str(data), stranger, settings=SETTINGS)
    assert stranger.read_text() == '{"text": "mine"}\n'


def test_a_regeneration_resumed_from_a_copy_of_its_input_continues_and_an_old_record_is_refused(
    hf_dir, tmp_path
) -> None:
    """The held-out split hashes each record's content: the same data at another path
    holds the same records out, so the run record matches and the run continues."""
    target = load_target(str(hf_dir))
    settings = dataclasses.replace(SETTINGS, heldout_fraction=0.4)
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    data = _write_chats(tmp_path / "here" / "chats.jsonl")
    full = tmp_path / "full.jsonl"
    regenerate(target, str(data), full, settings=settings)
    kept = full.read_text().splitlines(keepends=True)
    assert 2 < len(kept) < len(CONVERSATIONS)  # some are held out, and never regenerated
    part = tmp_path / "part.jsonl"
    regenerate(target, str(data), part, settings=settings)
    part.write_text(kept[0] + kept[1] + kept[2][:5])  # killed while writing line 3
    moved = tmp_path / "there" / "copy.jsonl"
    moved.write_bytes(data.read_bytes())
    report = regenerate(target, str(moved), part, settings=settings)
    assert report.resumed_from_line == 2 and part.read_text() == full.read_text()
    meta = part.with_name(part.name + ".run.json")
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "format": 1}))  # begun before the split by content
    with pytest.raises(RegenerateError, match="held documents out by their file path"):
        regenerate(target, str(moved), part, settings=settings)
    assert part.read_text() == full.read_text()


def _cli(*args):
    from click.testing import CliRunner

    from dflash.cli import cli

    return CliRunner().invoke(cli, ["regenerate", *map(str, args)], catch_exceptions=False)


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    return errors[0]


def test_regenerate_command_writes_resumes_and_refuses(hf_dir, tmp_path, monkeypatch) -> None:
    target = load_target(str(hf_dir))
    # A relative data path: the held-out split hashes it, so it must not change per run.
    monkeypatch.chdir(tmp_path)
    _write_chats(tmp_path / "chats.jsonl", extra_lines=["[1]", '{"messages": "x"}'])
    data = Path("chats.jsonl")
    reference = tmp_path / "reference.jsonl"
    settings = dataclasses.replace(SETTINGS, heldout_fraction=0.01)  # as the command's flag
    regenerate(target, str(data), reference, settings=settings)
    out = tmp_path / "regen.jsonl"
    recipe = "--max-new-tokens 6 --batch-size 4 --chunk-lines 2 --heldout-fraction 0.01".split()
    flags = ["--target", hf_dir, "--data", data, *recipe, "--device", "cpu"]
    result = _cli(*flags, "--output", out)
    assert result.exit_code == 0, result.output
    assert out.read_text() == reference.read_text()
    assert f"skipped 2 unusable JSONL lines (first: {data}:6" in result.output
    assert "tokens/s" in result.output and f"{len(CONVERSATIONS)} lines" in result.output
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + lines[3][:7])  # killed while writing line 4
    result = _cli(*flags, "--output", out)
    assert result.exit_code == 0 and "continued after line 2" in result.output, result.output
    assert out.read_text() == reference.read_text()
    before = out.read_text()
    error = _one_error_line(_cli(*flags, "--output", out, "--temperature", 0.5))
    assert str(out) in error and "not a resumable file of this run" in error
    assert out.read_text() == before  # nothing already written is lost
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "wizard", "content": "x"}]}\n"text"\n')
    error = _one_error_line(_cli(*flags[:2], "--data", bad, "--output", tmp_path / "o.jsonl"))
    assert "nothing to regenerate" in error and f"skipped 2 lines; first: {bad}:1" in error
    assert "unknown role 'wizard'" in error
    for flag, value in (("--max-new-tokens", 0), ("--temperature", -1), ("--prefix-tokens", 0)):
        error = _one_error_line(_cli(*flags, "--output", tmp_path / "x.jsonl", flag, value))
        assert f"{flag} {value}" in error
    stops = ["--stop-token-ids", "3,99999999"]
    error = _one_error_line(_cli(*flags, "--output", tmp_path / "y.jsonl", *stops))
    assert "--stop-token-ids 99999999: not in the vocabulary" in error
    assert not (tmp_path / "y.jsonl").exists()


def test_the_embedded_default_is_regenerated_once_per_target_and_recipe(
    tmp_path, monkeypatch
) -> None:
    from dflash.config.settings import config_from_options
    from dflash.data.corpus import EMBEDDED_CORPUS, embedded_corpus
    from dflash.data.tokenizer import ByteTokenizer
    from dflash.offline import regenerate as regen_mod
    from dflash.run.rows import training_rows

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))
    recipe = RegenerateConfig(
        max_new_tokens=4, prefix_tokens=16, windows_per_document=1, batch_size=256, chunk_lines=512
    )
    monkeypatch.setattr(regen_mod, "EMBEDDED_RECIPE", recipe)
    torch.manual_seed(0)
    config = TinyLMConfig(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
    target = wrap_tiny(TinyLM(config))
    lines: list[str] = []
    path = regen_mod.embedded_regeneration(target, 0.05, lines.append)
    assert any("generated once" in line for line in lines) and path.parent.name == "regen"
    rates = [line.rsplit(", ", 1)[1] for line in lines if " windows, " in line]
    assert rates and all(r.endswith(" tokens/s") and r != "0 tokens/s" for r in rates), rates
    direct = tmp_path / "direct.jsonl"
    regenerate(target, "embedded", direct, settings=dataclasses.replace(recipe))
    assert path.read_text() == direct.read_text()
    held_in = [t for t in embedded_corpus("train") if len(t.encode()) >= 16]
    written = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(written) == len(held_in)
    prefixes = [t.encode()[:16].decode(errors="ignore")[:8] for t in held_in]
    assert all(w.startswith(p) for w, p in zip(written, prefixes, strict=True))
    monkeypatch.setattr(regen_mod, "regenerate", lambda *a, **k: pytest.fail("not cached"))
    assert regen_mod.embedded_regeneration(target, 0.05, lines.append) == path
    monkeypatch.setattr(regen_mod, "EMBEDDED_RECIPE", dataclasses.replace(recipe, max_new_tokens=5))
    with pytest.raises(pytest.fail.Exception, match="not cached"):
        regen_mod.embedded_regeneration(target, 0.05, lines.append)  # another recipe, another key
    monkeypatch.setattr(regen_mod, "EMBEDDED_RECIPE", recipe)
    opts = {"seq_len": 64, "batch_size": 2}
    train, heldout = training_rows(config_from_options(opts), target, lines.append)
    corpus_train, corpus_heldout = training_rows(
        config_from_options({**opts, "data": EMBEDDED_CORPUS}), target, lines.append
    )
    assert len(train) < len(corpus_train) and train.fingerprint() != corpus_train.fingerprint()
    assert (heldout.stream == corpus_heldout.stream).all()  # the same evaluation prompts
    tok = ByteTokenizer()  # every regenerated window, framed BOS ... EOS, is in the rows
    framed = sum(len(w.encode()) + 2 for w in written)
    assert int((train.ids != tok.pad_token_id).sum()) == framed


def test_a_prompt_set_is_answered_and_a_file_without_user_turns_refused(hf_dir, tmp_path) -> None:
    target = load_target(str(hf_dir))
    prompts = [[("user", "hello how are you")], [("system", "tell me"), ("user", "what is")]]
    data = _write_chats(tmp_path / "prompts.jsonl", prompts)
    regenerate(target, str(data), tmp_path / "answers.jsonl", settings=SETTINGS)
    written = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    for conv, record in zip(prompts, written, strict=True):
        messages = record["messages"]
        assert [m["role"] for m in messages] == [r for r, _ in conv] + ["assistant"]
        assert messages[-1]["content"] == _reference_reply(target, messages[:-1], SETTINGS)
    no_user = _write_chats(tmp_path / "none.jsonl", [[("system", "tell me")]])
    with pytest.raises(RegenerateError, match="no conversation has a user turn"):
        regenerate(target, str(no_user), tmp_path / "x.jsonl", settings=SETTINGS)


def test_replies_cut_at_the_budget_are_marked_and_left_out_of_training(hf_dir, tmp_path) -> None:
    from dflash.data.datasets import load_corpus
    from dflash.data.sources import CUT_KEY

    target = load_target(str(hf_dir))
    data = _write_chats(tmp_path / "chats.jsonl")
    short = dataclasses.replace(SETTINGS, max_new_tokens=2)
    regenerate(target, str(data), tmp_path / "cut.jsonl", settings=short)
    written = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    cut = [any(m.get(CUT_KEY) for m in r["messages"]) for r in written]
    tok = target.tokenizer
    assert any(cut)  # two tokens: most replies run out before their stop token
    whole = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}]
    with (tmp_path / "cut.jsonl").open("a") as f:  # and one conversation of whole replies
        f.write(json.dumps({"messages": whole}) + "\n")
    written.append({})
    cut.append(False)
    kept = load_corpus(str(tmp_path / "cut.jsonl"), tok, 0.0)
    assert kept.report.cut_replies == sum(cut)
    assert len(kept.train) + len(kept.heldout) == len(written) - sum(cut)
    everything = load_corpus(str(tmp_path / "cut.jsonl"), tok, 0.0, keep_cut=True)
    assert len(everything.train) + len(everything.heldout) == len(written)


def test_padded_rows_leave_the_batch_at_their_stop_and_equal_generate_alone(hf_dir) -> None:
    target = load_target(str(hf_dir))
    model = target.model
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [6], [9, 9, 8, 7, 6]]

    plain = dict(max_new_tokens=12, do_sample=False, top_k=None, top_p=None, temperature=None)

    def alone(prompt, stop):
        new = model.generate(torch.tensor([prompt]), eos_token_id=stop, pad_token_id=0, **plain)
        out = new[0, len(prompt) :].tolist()
        return out[: out.index(stop)] if stop in out else out

    free = alone(prompts[3], -1)  # -1: no stop (transformers warns, and decodes on)
    stop = free[2]  # row 3 leaves the batch after two tokens, the others decode on
    expected = [alone(p, stop) for p in prompts]
    assert len(expected[3]) == 2 and max(map(len, expected)) == 12, expected
    got = generate_padded(target, prompts, max_new_tokens=12, stop_token_ids=[stop])
    assert got == expected


class _StubEngine:
    """An OpenAI-compatible endpoint that answers prompt i with WORDS[-1 - i] after
    `delays[i]` seconds (or with HTTP 400 for `refused`), and records when each request
    was in flight: what the scheduling of `regenerate --server` is judged by."""

    def __init__(self, prompts: list[list[int]], delays: dict[int, float], refused=()):
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.spans: dict[int, tuple[float, float]] = {}
        self.most, lock, in_flight = 0, threading.Lock(), [0]
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802 - the http.server hook name
                self._send(200, {"data": [{"id": "stub"}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/completions":
                    self._send(404, {})
                    return
                which = prompts.index(body["prompt"])
                with lock:
                    in_flight[0] += 1
                    engine.most = max(engine.most, in_flight[0])
                start = time.perf_counter()
                time.sleep(delays.get(which, 0.0))
                with lock:
                    in_flight[0] -= 1
                    engine.spans[which] = (start, time.perf_counter())
                if which in refused:
                    self._send(400, {"error": "refused"})
                    return
                choice = {"text": WORDS[-1 - which], "finish_reason": "stop"}
                self._send(200, {"choices": [choice], "usage": {"completion_tokens": 1}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _regenerate_served(hf_dir, tmp_path, delays, refused=()):
    """Eight one-turn prompts in chunks of 4, two requests in flight, through a stub."""
    from dflash.data.chat import chat_prompt_ids
    from dflash.target.served import CompletionClient, ServerSettings, TokenizerTarget

    tok = load_target(str(hf_dir)).tokenizer
    data = _write_chats(tmp_path / "prompts.jsonl", [[(U, word)] for word in WORDS[:8]])
    prompts = [chat_prompt_ids(tok, [{"role": U, "content": w}]) for w in WORDS[:8]]
    engine = _StubEngine(prompts, delays, refused)
    out = tmp_path / "answers.jsonl"
    try:
        client = CompletionClient(ServerSettings(engine.url, concurrency=2, retries=0))
        target = TokenizerTarget(str(hf_dir), tok)
        client.connect(target, log=lambda line: None)
        settings = dataclasses.replace(SETTINGS, chunk_lines=4)
        regenerate(target, str(data), out, settings=settings, server=client)
    finally:
        engine.close()
    return engine, out


def test_a_server_gets_the_next_chunk_while_one_reply_is_slow(hf_dir, tmp_path) -> None:
    """--concurrency stays full across chunk boundaries, the earlier chunk first in line,
    and the file keeps the input's order: one slow reply no longer idles the server."""
    delays = {0: 0.8} | {i: 0.05 for i in range(1, 8)}
    engine, out = _regenerate_served(hf_dir, tmp_path, delays)
    written = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert [m[0]["content"] for m in written] == WORDS[:8]
    assert [m[1]["content"] for m in written] == [WORDS[-1 - i] for i in range(8)]
    spans = engine.spans
    assert engine.most == 2
    # The second chunk began while the first's slow reply was still coming ...
    assert spans[4][0] < spans[0][1]
    # ... and only once every request of the first chunk had been sent.
    assert max(spans[i][0] for i in range(4)) <= min(spans[i][0] for i in range(4, 8))


def test_a_refused_request_ends_the_run_at_once_and_the_chunk_ahead_sends_no_more(
    hf_dir, tmp_path
) -> None:
    import time

    from dflash.target.served import ServerError

    start = time.perf_counter()
    with pytest.raises(ServerError, match="HTTP 400"):
        _regenerate_served(hf_dir, tmp_path, {0: 1.0} | {i: 0.2 for i in range(2, 8)}, {1})
    # Only the slow request already in flight is waited for, not the prompts after it.
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "answers.jsonl").read_text()
