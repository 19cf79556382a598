import io
import threading
import time

import pytest

from dflash.config.settings import config_from_options
from dflash.run.progress import (
    LineStream,
    Progress,
    format_loss_config,
    format_run_config,
    format_summary,
)


def figures(loss: float, tau: float = 1.5) -> dict:
    return {"loss": loss, "tau_estimate": tau}


def test_plain_lines_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(total_steps=20, stream=stream, interval_s=1e9)
    for step in range(1, 21):
        logged = step == 1 or step % 2 == 0
        progress.update(step, num_tokens=100, figures=figures(2.0 / step) if logged else None)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 1/20  loss 2.0000  τ≈1.50")
    assert lines[-1].startswith("step 20/20") and "tokens/s" in lines[-1]
    assert "eta 0:00" in lines[-1]
    assert 3 <= len(lines) <= 12  # periodic, not one per step


def test_bar_on_a_terminal() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    progress = Progress(total_steps=5, stream=stream)
    for step in range(1, 6):
        progress.update(step, num_tokens=10, figures=figures(1.0))
    progress.close()
    assert "5/5" in stream.getvalue() and "loss=1.0000" in stream.getvalue()


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"block_size": 16}, ["γ 7 (by block size)", "streak weighting off"]),
        ({"block_size": 16, "loss_decay_gamma": 3.0}, ["γ 3 (set)"]),
        # Streak weights already decay over block positions: they replace γ ...
        (
            {"block_size": 16, "streak_alpha": 0.3},
            ["no γ decay (streak weights replace it", "streak α 0.3"],
        ),
        # ... unless the user sets both.
        (
            {"block_size": 16, "streak_alpha": 0.3, "loss_decay_gamma": 7.0},
            ["γ 7 (set, applied on top of the streak weights)", "streak α 0.3"],
        ),
        ({"use_soft_labels": True, "kl_temperature": 2.0}, ["KL T=2", "soft labels on"]),
        ({}, ["block size 8", "up to 16 anchors", "noise: all non-anchor masked"]),
        (
            {"noise_schedule": "linear:0.5:1", "steps": 40},
            ["noise: masked share 0.5 -> 1 over 40 steps"],
        ),
    ],
)
def test_loss_line_names_every_setting(options, fragments) -> None:
    line = format_loss_config(config_from_options(options))
    for fragment in fragments:
        assert fragment in line, line
    assert "\n" not in line


def test_run_line_names_the_hidden_cache_not_the_unread_data() -> None:
    online = format_run_config(config_from_options({"data": "corpus.txt"}), "builtin", "cpu")
    assert "data corpus.txt," in online and "hidden cache" not in online, online
    cfg = config_from_options({"data": "corpus.txt", "hidden_cache": "cache/"})
    batches = format_run_config(cfg, "builtin", "cpu")  # a batch cache: --data's rows
    assert "data corpus.txt," in batches and "hidden cache" not in batches, batches
    samples = format_run_config(cfg, "builtin", "cpu", rows_in_cache=True)
    assert "hidden cache cache/," in samples and "corpus.txt" not in samples, samples


def test_summary_text() -> None:
    text = format_summary(
        {"steps": 3, "wall_s": 1.5, "tokens_per_s": 1234.0, "final_loss": 2.5, "tau": 1.75}
    )
    assert "3 steps" in text and "1,234 tokens/s training" in text and "τ on held-out 1.750" in text


def test_line_stream_hands_over_whole_lines_once_ended() -> None:
    emitted: list[str] = []
    stream = LineStream(emitted.append)
    print("table line 1\ntable line 2", file=stream, flush=True)  # text, then "\n"
    stream.write("partial")
    assert emitted == ["table line 1\ntable line 2"]
    stream.write(" line\nnext\n")
    assert emitted[-1] == "partial line\nnext"


def test_write_without_a_bar_prints_plainly() -> None:
    out = io.StringIO()
    progress = Progress(total_steps=5, stream=out)
    print("interval: last 1.0s", file=progress.line_stream(), flush=True)
    progress.write("note")
    assert out.getvalue() == "interval: last 1.0s\nnote\n"


class _SlowStream(io.StringIO):
    """A stream whose writes take long enough for another thread to come in between."""

    def write(self, text: str) -> int:
        time.sleep(0.0005)
        return super().write(text)


def test_a_table_from_the_reporter_thread_never_joins_a_progress_line() -> None:
    stream = _SlowStream()
    progress = Progress(total_steps=400, stream=stream, interval_s=0.0)
    tables = progress.line_stream()

    def reporter() -> None:  # what tracing.Reporter does on its thread: print(table, file=...)
        for _ in range(40):
            print("interval: last 5.3s\nphase  count", file=tables)

    thread = threading.Thread(target=reporter)
    thread.start()
    for step in range(1, 401):
        progress.update(step, 8, {"loss": 1.0, "tau_estimate": 1.0})
    thread.join()
    lines = stream.getvalue().splitlines()
    assert sum(line.startswith("step ") for line in lines) >= 40
    assert lines.count("interval: last 5.3s") == 40 and lines.count("phase  count") == 40
    assert all(line.startswith(("step ", "interval: ", "phase ")) for line in lines), lines
