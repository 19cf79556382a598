"""Progress bar, startup lines and the end-of-run summary.

A tqdm bar when stderr is a terminal; plain periodic lines otherwise, so logs of
batch jobs stay readable and grep-able. Other output printed while the bar is up (the
interval tables, log lines) goes through `Progress.write`, tqdm's own writer, so the
bar stays on the last line instead of running into the text.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from dflash.config.settings import TrainConfig
from dflash.log import Log
from dflash.objective.noise import NoiseSchedule
from dflash.observe.report import tau_notes
from dflash.summary import JSON


class BufferedLog:
    """A log whose lines wait for `release`: what a run's start-up says about its target
    and data is printed once every check has passed, so that a refused run prints its
    one `Error:` line alone (a run that fails drops them with it). `live` is the log
    itself, for progress that must show while it happens (minutes of target preparation
    or regeneration)."""

    def __init__(self, log: Log) -> None:
        self.live = live_log(log)
        self._log = log
        self._held: list[str] | None = []

    def __call__(self, line: str) -> None:
        if self._held is None:
            self._log(line)
        else:
            self._held.append(line)

    def release(self) -> None:
        """Prints the held lines; later lines go straight through."""
        held, self._held = self._held, None
        for line in held or ():
            self._log(line)


def live_log(log: Log) -> Callable[[str], None]:
    """The log that prints at once: `log` itself unless it holds its lines (BufferedLog)."""
    return getattr(log, "live", log)


def format_loss_config(cfg: TrainConfig) -> str:
    """The objective on one line (the telemetry line follows it)."""
    obj = cfg.loss
    gamma, alpha = cfg.gamma, obj.confidence_alpha
    weighting = "D-PACE" if obj.position_weighting == "dpace" else "streak"
    if gamma is None:
        decay = f"no γ decay ({weighting} weights replace it; set --loss-decay-gamma to add it)"
    elif alpha is not None:
        decay = f"γ {gamma:g} (set, applied on top of the {weighting} weights)"
    else:
        decay = f"γ {gamma:g} ({'set' if obj.gamma is not None else 'by block size'})"
    soft = (
        f"soft labels on (KL T={obj.kl_temperature:g}, weight {obj.kl_weight:g})"
        if obj.use_soft_labels
        else "soft labels off"
    )
    streak = "streak weighting off"
    if obj.position_weighting == "dpace":
        streak = f"D-PACE α {alpha:g} (per scored block)"
    elif alpha is not None:
        streak = f"streak α {alpha:g} (per weight sum)"
    noise = NoiseSchedule.parse(obj.noise_schedule, cfg.run.steps).describe()
    return (
        f"loss: block size {cfg.drafter.block_size}, {decay}, {soft}, "
        f"{streak}, up to {obj.num_anchors} anchors/sequence, noise: {noise}"
    )


def format_run_config(
    cfg: TrainConfig, target_desc: str, device: str, rows_in_cache: bool = False
) -> str:
    """Which model, data and budget the run uses, on one line. `rows_in_cache`: the
    feature source holds the rows itself (per-sample files), so --data is never read;
    a batch cache's rows are still --data's."""
    cache = cfg.data.hidden_cache
    data = f"hidden cache {cache}" if rows_in_cache else f"data {cfg.data.source}"
    return (
        f"run: target {target_desc}, drafter {cfg.drafter.num_layers} layer(s), "
        f"{data}, {cfg.run.steps} steps × {cfg.data.batch_size} × "
        f"{cfg.data.seq_len} tokens, lr {cfg.optim.lr:g}, device {device}, "
        f"output {cfg.run.output_dir}"
    )


def _loss_text(summary: JSON) -> str:
    loss = summary.get("final_loss")
    return f"{loss:.4f}" if isinstance(loss, float) else "n/a (no finished step)"


def format_summary(summary: JSON) -> str:
    """Human summary of summary.json's figures."""
    tau = summary.get("tau")
    tau_txt = f"{tau:.3f}" if isinstance(tau, float) else "n/a"
    lines = [
        f"summary: {summary['steps']} steps, {summary['wall_s']:.1f} s in all, "
        f"{summary['tokens_per_s']:,.0f} tokens/s training, final loss {_loss_text(summary)}",
        f"summary: τ on held-out {tau_txt} (block size {summary.get('block_size', '?')})",
    ]
    if isinstance(summary.get("tau_pooled"), float):
        lines[-1] += f", pooled {summary['tau_pooled']:.3f}"
    if isinstance(summary.get("speedup"), float):
        lines[-1] += f"; speedup {summary['speedup']:.2f}x vs greedy decoding"
    if summary.get("acceptance_per_position"):
        rates = " ".join(f"{r:.2f}" for r in summary["acceptance_per_position"])
        lines.append(f"summary: acceptance per block position {rates}")
    lines += [f"summary: {note}" for note in tau_notes(summary)]
    return "\n".join(lines)


def _format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _tau_figures(figures: JSON) -> str:
    """The per-block chain τ of the training anchors and, on an evaluated step, the held-out
    τ (the figure the engine will measure), after the independent-positions estimate."""
    text = ""
    if figures.get("tau_chain") is not None:
        text += f" (chain {figures['tau_chain']:.2f})"
    if figures.get("eval_tau") is not None:
        text += f"  held-out τ {figures['eval_tau']:.3f}"
    return text


class Progress:
    """Step, loss, τ estimate, tokens/s and ETA: a bar on a terminal, lines elsewhere.

    The figures come from the logged steps (every --log-every; dflash.train.step_metrics); lines
    are printed on logged steps only, at most every tenth of the run or `interval_s`.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        stream: IO[str] | None = None,
        interval_s: float = 10.0,
        log: Log | None = None,
    ) -> None:
        self.total_steps, self.start_step = total_steps, start_step
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        # One lock for every line on the stream: its own and the interval tables (through
        # `write`, from the reporter thread); a line is one write, never split by another.
        self._lock = threading.Lock()
        self.log = log or self._print
        self.every_steps = max(1, (total_steps - start_step) // 10)
        self.start_time_s = time.perf_counter()
        self.last_print_s = self.start_time_s
        self.last_print_done = 0
        self.tokens = 0
        self.bar = None
        if self._is_tty():
            from tqdm import tqdm

            options = {"file": self.stream, "unit": "step", "dynamic_ncols": True, "desc": "train"}
            self.bar = tqdm(total=total_steps, initial=start_step, **options)

    def _is_tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty())

    def update(self, step: int, num_tokens: int, figures: JSON | None = None) -> None:
        """Record that `step` (1-based, global) trained `num_tokens`; `figures` (loss,
        tau_estimate) are given on logged steps."""
        self.tokens += num_tokens
        now_s = time.perf_counter()
        tokens_per_s = self.tokens / max(now_s - self.start_time_s, 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            if figures is not None:
                postfix = {
                    "loss": f"{figures['loss']:.4f}",
                    "tau": f"{figures['tau_estimate']:.2f}",
                    "tok_s": f"{tokens_per_s:,.0f}",
                }
                if figures.get("eval_tau") is not None:
                    postfix["eval_tau"] = f"{figures['eval_tau']:.2f}"
                if figures.get("bad_steps"):
                    postfix["bad"] = figures["bad_steps"]
                self.bar.set_postfix(**postfix, refresh=False)
            return
        if figures is None:
            return
        done = step - self.start_step
        by_time = now_s - self.last_print_s >= self.interval_s
        due = by_time or done - self.last_print_done >= self.every_steps
        evaluated = figures.get("eval_tau") is not None
        if due or step == self.total_steps or done == 1 or evaluated:
            eta_s = (now_s - self.start_time_s) / done * (self.total_steps - step)
            bad = figures.get("bad_steps")
            self.log(
                f"step {step}/{self.total_steps}  loss {figures['loss']:.4f}  "
                f"τ≈{figures['tau_estimate']:.2f}{_tau_figures(figures)}  "
                f"{tokens_per_s:,.0f} tokens/s  "
                f"eta {_format_eta(eta_s)}" + (f"  skipped {bad} non-finite" if bad else "")
            )
            self.last_print_s, self.last_print_done = now_s, done

    def _print(self, text: str) -> None:
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()

    def write(self, text: str) -> None:
        """Prints `text` (one or more lines) above the bar, or plainly without one."""
        bar = self.bar
        if bar is not None:
            with self._lock:
                bar.write(text, file=self.stream)
        else:
            self._print(text)

    def line_stream(self) -> LineStream:
        """A text stream whose complete lines go through `write` (for the Reporter)."""
        return LineStream(self.write)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class LineStream:
    """A write-only text stream that hands text to `emit` once a write ends a line, all
    lines so far in one call (print's text and its newline arrive as two writes)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            if not self._pending.endswith("\n"):
                return len(text)
            done, self._pending = self._pending[:-1], ""
        self._emit(done)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False
