import json

import pytest
import yaml
from click.testing import CliRunner

from dflash import cli as cli_mod
from dflash.config.settings import TrainConfig, option_default, option_map
from tests.dflash.app_fixtures import NON_DEFAULT, small_options, tiny_target  # noqa: F401 - fixture
from tests.dflash.config.test_config import without_invocation_flags


def invoke(args, env=None):
    return CliRunner().invoke(cli_mod.cli, args, env=env, catch_exceptions=False)


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@pytest.fixture
def captured(monkeypatch):
    """Replace training by recording the config the CLI built."""
    seen: list[TrainConfig] = []
    monkeypatch.setattr("dflash.run.pipelined.run_training", lambda cfg, **_: seen.append(cfg))
    return seen


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--block-size", "1"], ["--block-size", "1"]),
        (["--num-anchors", "0"], ["--num-anchors", "0"]),
        (["--kl-temperature", "0"], ["--kl-temperature", "0"]),
        (["--kl-temperature", "-2"], ["--kl-temperature", "-2"]),
        (["--streak-alpha", "1.5"], ["--streak-alpha", "1.5"]),
        (["--kl-weight", "-0.1"], ["--kl-weight", "-0.1"]),
        (["--steps", "0"], ["--steps", "0"]),
        (["--hs-queue-size", "0"], ["--hs-queue-size"]),
        (["--trace-sample-ratio", "2"], ["--trace-sample-ratio"]),
        (["--target-layers", "1,x"], ["--target-layers"]),
        (["--target-layers", "2,0"], ["--target-layers '2,0'", "ascending", "(give 0,2)"]),
        (["--target-layers", "1,3,1"], ["--target-layers '1,3,1'", "layer 1 is named twice"]),
        (["--chat-rendering", "turns"], ["--chat-rendering", "turns"]),
        (["--lr", "inf"], ["--lr", "inf"]),
        (["--lr", "nan"], ["--lr", "nan"]),
        (["--kl-temperature", "-inf"], ["--kl-temperature"]),
        (["--block-size", "100000"], ["--block-size", "100000", "--seq-len"]),
        (["--trace-level", "loud"], ["--trace-level", "loud"]),
        (["--otlp-endpoint", "notaurl"], ["--otlp-endpoint", "notaurl", "http(s)://"]),
        (["--otlp-endpoint", "ftp://h:4317"], ["--otlp-endpoint", "ftp://h:4317"]),
        (["--torch-profile", "5:5"], ["--torch-profile", "5:5", "empty range"]),
        (["--torch-profile", "x"], ["--torch-profile", "'x'", "START:STOP"]),
    ],
)
def test_bad_values_exit_2_with_one_line(args, fragments, captured) -> None:
    assert_one_line_error(invoke(["train", *args]), *fragments)
    assert captured == []


def test_no_arguments_means_train_with_defaults(captured) -> None:
    assert invoke([]).exit_code == 0
    assert captured == [TrainConfig()]


def test_precedence_flag_over_env_over_file_over_default(tmp_path, captured) -> None:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"steps": 11, "lr": 0.5, "batch-size": 3, "seed": 4}))
    env = {"DFLASH_STEPS": "22", "DFLASH_LR": "0.25"}
    result = invoke(["train", "--config", str(cfg_file), "--steps", "33"], env=env)
    assert result.exit_code == 0, result.output
    cfg = captured[0]
    assert cfg.run.steps == 33  # flag
    assert cfg.optim.lr == 0.25  # env over file
    assert cfg.data.batch_size == 3 and cfg.run.seed == 4  # file over default
    assert cfg.data.seq_len == TrainConfig().data.seq_len


def test_toml_config_with_pipeline_and_telemetry_keys(tmp_path, captured) -> None:
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(
        'target_layers = [1, 2]\ndrafter-devices = "cpu,cpu"\ntrace_level = "step"\n'
        "use_soft_labels = true\nprofile_interval = 5\n"
    )
    assert invoke(["--config", str(cfg_file)]).exit_code == 0
    cfg = captured[0]
    assert cfg.target.layer_ids == (1, 2) and cfg.pipeline.drafter_devices == ("cpu", "cpu")
    assert cfg.telemetry.trace_level == "step" and cfg.loss.use_soft_labels
    assert cfg.telemetry.profile_interval_s == 5.0


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("stepz: 3\n", ["unknown key", "stepz"]),
        ("steps: 1.5\n", ["steps", "1.5"]),
        ("steps: ten\n", ["steps", "ten"]),
        ("use_soft_labels: 3\n", ["use_soft_labels"]),
        ("- a list\n", ["mapping"]),
        ("steps: [unclosed\n", ["cannot parse"]),
        ("objective:\n  kl_weight: 0.5\n", ["c.yaml", "unknown section objective"]),
        ("run:\n  stepz: 3\n", ["c.yaml", "run.stepz"]),
        ("schema_version: 7\nrun: {}\n", ["c.yaml", "schema_version", "7"]),
        ("steps: 3\nsteps: 4\n", ["cannot parse", "'steps' appears twice"]),
        ("steps: 3\nrun:\n  steps: 4\n", ["--steps is set twice", "'steps'", "'run.steps'"]),
        ("batch_size: 3\nbatch-size: 4\n", ["--batch-size is set twice", "'batch-size'"]),
        ('{"steps": 3, "steps": 4}', ["c.json", "'steps' appears twice"]),
        ("steps = 3\nsteps = 4\n", ["c.toml", "cannot parse"]),
        (b"steps: 3 # \xff\xfe\n", ["c.yaml", "not UTF-8"]),
    ],
)
def test_bad_config_files(tmp_path, content, fragments, captured) -> None:
    suffix = next((f".{s}" for s in ("json", "toml") if f"c.{s}" in fragments), ".yaml")
    cfg_file = tmp_path / f"c{suffix}"
    if isinstance(content, bytes):
        cfg_file.write_bytes(content)
    else:
        cfg_file.write_text(content)
    assert_one_line_error(invoke(["train", "--config", str(cfg_file)]), *fragments)


def test_missing_config_file(tmp_path) -> None:
    assert_one_line_error(invoke(["train", "--config", str(tmp_path / "x.yaml")]), "x.yaml")


def _train_args(tmp_path, **extra):
    opts = {**small_options(tmp_path), **extra}
    args = ["train"]
    for key, value in opts.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def test_missing_target_path(tmp_path) -> None:
    result = invoke(_train_args(tmp_path, target=str(tmp_path / "no-model")))
    assert_one_line_error(result, "no-model")


@pytest.mark.slow  # imports transformers
def test_a_hub_id_that_cannot_be_reached_fails_within_seconds(tmp_path, monkeypatch) -> None:
    """Offline (HF_HUB_OFFLINE here; no DNS or no route take the same path after the
    probe): one line at once, not half a minute of retries."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    started = time.monotonic()
    result = invoke(_train_args(tmp_path, target="no-such-org/no-such-model"))
    assert_one_line_error(result, "no-such-org/no-such-model", "cannot be reached")
    assert time.monotonic() - started < 10


@pytest.mark.slow  # imports transformers
def test_target_that_is_not_a_causal_lm(tmp_path) -> None:
    model_dir = tmp_path / "t5"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    # Refused from its config.json, before any weights load.
    result = invoke(_train_args(tmp_path, target=str(model_dir)))
    assert_one_line_error(result, str(model_dir), "'t5' model is not a Llama/Qwen-style decoder")
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    assert_one_line_error(invoke(_train_args(tmp_path, target=str(plain_dir))), "plain")


@pytest.mark.slow  # builds two small transformers models
def test_a_target_of_another_family_or_with_damaged_weights_is_one_line(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.dflash.hf_fixtures import save_hf_target, save_word_tokenizer

    gpt2 = tmp_path / "gpt2"
    config = GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=300)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    save_word_tokenizer(gpt2)
    result = invoke(_train_args(tmp_path, target=str(gpt2), output_dir=str(tmp_path / "r1")))
    assert_one_line_error(result, "'gpt2' model is not a Llama/Qwen-style decoder")
    qwen = save_hf_target(tmp_path / "qwen")
    weights = qwen / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = invoke(_train_args(tmp_path, target=str(qwen), output_dir=str(tmp_path / "r2")))
    assert_one_line_error(result, str(qwen), "weights are damaged")


@pytest.mark.usefixtures("tiny_target")
def test_layer_ids_out_of_range(tmp_path) -> None:
    assert_one_line_error(invoke(_train_args(tmp_path, target_layers="1,9")), "9")


@pytest.mark.usefixtures("tiny_target")
def test_empty_and_unreadable_corpus(tmp_path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(invoke(_train_args(tmp_path, data=str(empty))), "empty.txt")
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\xfa")
    assert_one_line_error(invoke(_train_args(tmp_path, data=str(binary))), "blob.txt")


def test_resume_from_missing_or_corrupt_checkpoint(tmp_path) -> None:
    result = invoke(_train_args(tmp_path, resume=str(tmp_path / "gone")))
    assert_one_line_error(result, "gone")
    bad = tmp_path / "checkpoints" / "step-00000001"
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_text("{not json")
    assert_one_line_error(invoke(_train_args(tmp_path, resume="latest")), "corrupt")


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_target")
def test_train_then_eval_with_json(tmp_path) -> None:
    args = _train_args(tmp_path, eval_prompts=2, eval_new_tokens=8, eval_prompt_tokens=8)
    result = invoke(args)
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert 1.0 <= summary["tau"] <= 4.0 and summary["steps"] == 6
    out = tmp_path / "eval.json"
    drafter, corpus = tmp_path / "drafter", tmp_path / "corpus.txt"
    sizes = "--eval-prompts 2 --max-new-tokens 8 --eval-prompt-tokens 8".split()
    result = invoke(
        ["eval", "--drafter", str(drafter), "--data", str(corpus), *sizes, "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert 1.0 <= figures["tau"] <= 4.0 and len(figures["acceptance_per_position"]) == 3
    assert figures["tau"] == pytest.approx(summary["tau"])  # same prompts, same drafter
    assert figures["tau_pooled"] == pytest.approx(summary["tau_pooled"])
    assert figures["speedup"] > 0 and summary["speedup"] > 0
    assert figures["speedup"] == pytest.approx(figures["greedy_s"] / figures["speculative_s"])
    assert "τ" in result.output and "pooled" in result.output and "vs greedy" in result.output


def test_help_shows_units_defaults_and_env_vars() -> None:
    text = " ".join(invoke(["train", "--help"]).output.split())  # help wraps lines
    for fragment in (
        "--steps",
        "DFLASH_STEPS",
        f"default: {option_default('steps')}",
        "--use-soft-labels / --no-use",
        "--otlp-protocol",
        "--profile-interval",
        "Seconds",
    ):
        assert fragment in text
    assert invoke(["eval", "--help"]).exit_code == 0
    assert invoke(["prepare-target", "--help"]).exit_code == 0


@pytest.mark.slow  # regenerates the embedded default's data on first use (cached afterwards)
def test_tiny_end_to_end_on_the_embedded_default(tmp_path) -> None:
    small = "--steps 4 --batch-size 2 --seq-len 64 --num-anchors 4 --eval-prompts 2"
    result = invoke(
        ["train", *small.split(), "--eval-new-tokens", "16", "--output-dir", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens_per_s"] > 0 and summary["wall_s"] > 0
    assert 1.0 <= summary["tau"] <= 8.0 and summary["final_loss"] > 0
    assert "loss: block size 8" in result.output and "summary:" in result.output


def test_eval_rejects_a_bad_device_and_a_non_drafter_dir(tmp_path) -> None:
    result = invoke(["eval", "--drafter", str(tmp_path), "--device", "gpu7"])
    assert_one_line_error(result, "gpu7")
    assert_one_line_error(invoke(["eval", "--drafter", str(tmp_path)]), "not a DFlash checkpoint")


def test_eval_rejects_bad_decoding_settings_and_chatless_eval_data(tmp_path) -> None:
    drafter = ["eval", "--drafter", str(tmp_path)]
    bad = (("--max-new-tokens", "0"), ("--max-new-tokens", "-3"), ("--temperature", "-0.5"))
    for flag, value in bad:
        assert_one_line_error(invoke([*drafter, flag, value]), flag, value)
    chatless = tmp_path / "eval.jsonl"
    chatless.write_text(json.dumps({"text": "no turns"}) + "\n" + "[1, 2]\n")
    result = invoke([*drafter, "--eval-data", str(chatless)])
    assert_one_line_error(result, "eval.jsonl", "no chat turns", "skipped 2 lines", "eval.jsonl:1")


def _flags(values):
    args = []
    for name, value in values.items():
        opt = option_map()[name]
        if opt.kind is bool:
            args.append(opt.flag if value else "--no-" + opt.flag[2:])
        else:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            args += [opt.flag, text]
    return args


def test_saved_config_json_reproduces_the_run_exactly(tmp_path, captured) -> None:
    """Every field set by flag, saved as OUTPUT_DIR/config.json, read back by --config:
    the same run, without the flags of that one invocation (--overwrite, --resume, ...)."""
    training = {k: v for k, v in NON_DEFAULT.items() if k != "dry_run"}  # it would not train
    assert invoke(["train", *_flags(training)]).exit_code == 0
    first = captured[0]
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(first.to_dict(), indent=2))
    result = invoke(["train", "--config", str(saved)])
    assert result.exit_code == 0, result.output
    assert captured[1] == without_invocation_flags(first) != TrainConfig()
    assert "left out" not in result.output  # config.json holds none of them


def test_environment_variables_are_derived_for_every_option(captured) -> None:
    not_bool = {name: v for name, v in NON_DEFAULT.items() if option_map()[name].kind is not bool}
    env = {option_map()[name].envvar: _flags({name: v})[-1] for name, v in not_bool.items()}
    assert invoke(["train"], env=env).exit_code == 0
    for name, value in NON_DEFAULT.items():
        opt = option_map()[name]
        if opt.kind is not bool:
            assert getattr(getattr(captured[0], opt.section), opt.field) == value, name


def test_unwritable_output_dir_is_one_line_before_any_work(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = invoke(_train_args(tmp_path, output_dir=str(blocker / "run")))
    assert_one_line_error(result, "--output-dir", "cannot create or write")


@pytest.mark.slow  # imports transformers
def test_seq_len_beyond_the_targets_positions(tmp_path) -> None:
    from tests.dflash.hf_fixtures import save_tiny_hf_model

    model_dir = tmp_path / "hf"
    save_tiny_hf_model(model_dir)  # max_position_embeddings 256
    result = invoke(_train_args(tmp_path, target=str(model_dir), seq_len=512))
    assert_one_line_error(result, "--seq-len 512", "max_position_embeddings 256")


@pytest.mark.usefixtures("tiny_target")
@pytest.mark.parametrize("flag", ["timeline", "torch_profile"])
def test_unwritable_telemetry_paths_are_one_line_before_training(tmp_path, flag) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    if flag == "timeline":
        args = _train_args(tmp_path, timeline=str(blocker / "timeline.json"))
    else:  # OUTPUT_DIR/profile cannot be made: OUTPUT_DIR/profile is a file
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "profile").write_text("")
        args = _train_args(tmp_path, output_dir=str(tmp_path / "out"), torch_profile="1:2")
    result = invoke(args)
    assert_one_line_error(result, "--" + flag.replace("_", "-"))
    assert (
        not (tmp_path / "checkpoints").exists() and not (tmp_path / "out" / "checkpoints").exists()
    )


def test_report_on_a_folder_that_is_not_a_run(tmp_path) -> None:
    assert_one_line_error(invoke(["report", str(tmp_path)]), "summary.json", "missing")


@pytest.mark.usefixtures("tiny_target")
def test_train_writes_the_report_and_report_rebuilds_it(tmp_path) -> None:
    result = invoke(_train_args(tmp_path))
    assert result.exit_code == 0, result.output
    for name in ("report.html", "stats.json", "timeline.json", "summary.json"):
        assert (tmp_path / name).is_file(), name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] and summary["telemetry"]["files"]["stats"].endswith("stats.json")
    (tmp_path / "report.html").unlink()
    result = invoke(["report", str(tmp_path)])
    assert result.exit_code == 0 and result.output.strip() == str(tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert 'data-chart="timeline"' in html and "drafter.step" in html


@pytest.mark.parametrize(
    ("command", "fragments"),
    [
        (["eval", "--drafter", "{tmp}", "--json", "{file}/e.json"], ["--json", "not a folder"]),
        (["regenerate", "--output", "{file}/out.jsonl"], ["--output", "is a file, not a folder"]),
        (["cache-hidden", "--output", "{file}/c"], ["--output", "is a file, not a folder"]),
        (["export", "--drafter", "{tmp}", "--output", "{file}/d"], ["--output", "not a folder"]),
        (["train", "--trace-file", "{tmp}"], ["--trace-file", "it is a folder"]),
        (["train", "--timeline", "{file}/t.json"], ["--timeline", "is a file, not a folder"]),
    ],
)
def test_every_output_path_is_checked_before_any_model_loads(tmp_path, command, fragments):
    import time

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = [a.format(tmp=tmp_path, file=blocker) for a in command]
    started = time.monotonic()
    assert_one_line_error(invoke(args), *fragments)
    assert time.monotonic() - started < 5  # refused before a target or drafter loads


@pytest.mark.parametrize(
    "command", [["train"], ["prepare-target"], ["regenerate", "--output", "{tmp}/r.jsonl"]]
)
def test_a_cache_folder_that_cannot_be_written_is_refused_at_once(tmp_path, command) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    args = [a.format(tmp=tmp_path) for a in command]
    if command == ["train"]:
        args = _train_args(tmp_path)
    result = invoke(args, env={"DFLASH_CACHE_DIR": str(blocker)})
    assert_one_line_error(result, "DFLASH_CACHE_DIR", "it is a file, not a folder")
