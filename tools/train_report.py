"""What `outcore train` says and records: the lines as the run starts, each step's line and its row
in log.jsonl, and the summary with its closing line. The console's loss and the log's are one
quantity: the mean of the steps' losses since the previous row.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from outcore import runtime
from outcore.runtime.policy import DTYPES
from outcore.runtime.quantized import bytes_per_weight
from outcore.runtime.sizes import human_bytes, human_count
from outcore.tools.lr_schedules import Schedule
from outcore.tools.run_log import RunLog
from outcore.tools.train_job import Job
from outcore.tools.train_options import TrainOptions

WHERE = {"none": "device memory", "cpu": "host memory", "nvme": "NVMe"}


def state_bytes(job: Job, config: runtime.Config) -> int:
    """Weights (a frozen base quantized at its stored bytes), and for the trainable ones fp32
    gradients, master and moments (bf16 states: half)."""
    frozen = job.params - job.trainable
    base = (bytes_per_weight(config.quantize, config.quantize_double) if config.quantize is not None
            else DTYPES[config.dtype][1])
    return (int(frozen * base) + job.trainable * DTYPES[config.dtype][1]
            + job.trainable * (4 + 12 // (2 if config.state_dtype == "bf16" else 1)))


def stored_as(config: runtime.Config) -> str:
    """How the weights rest: the compute dtype, and a frozen base's quantization where it has one."""
    if config.quantize is None:
        return config.dtype
    return (f"{config.dtype}, the frozen base stored {config.quantize}"
            + (" with double quantization" if config.quantize_double else "")
            + f" ({bytes_per_weight(config.quantize, config.quantize_double):.2f} bytes a weight)")


def start_lines(job: Job, config: runtime.Config, opts: TrainOptions, world: int, schedule: Schedule,
                hyper: dict) -> list[str]:
    """What is trained, where its states live, the batch, and the schedule."""
    trainable = "" if job.trainable == job.params else f", {human_count(job.trainable)} of them trained"
    return [f"{job.name}, {human_count(job.params)} parameters{trainable} "
            f"({human_bytes(state_bytes(job, config))} of weights, gradients and Adam states), {stored_as(config)}, "
            f"parameters in {WHERE[config.offload_params]}, optimizer states in {WHERE[config.offload_optimizer]}; "
            f"batch {opts.batch} x {job.seq} {job.tokens}"
            + (f" on each of {world} ranks, each its own rows" if world > 1 else ""),
            f"{schedule.describe()}, weight decay {hyper['weight_decay']:g}, betas "
            f"{hyper['betas'][0]:g}, {hyper['betas'][1]:g}"] + (
        [f"the warm-up of {schedule.warmup} steps is the whole run of {schedule.steps}: the rate never reaches its "
         f"peak {hyper['lr']:g} (--warmup-steps or --warmup-ratio to shorten it)"]
        if 0 < schedule.steps <= schedule.warmup else [])


@dataclass
class RunProgress:
    """What the run's steps did so far: their losses and norms, and their time and bytes summed."""

    history: list[float] = field(default_factory=list)
    val_history: list[tuple[int, float]] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    unlogged: list[float] = field(default_factory=list)  # losses since the log's last row
    seconds: float = 0.0
    wait: float = 0.0
    opt: float = 0.0
    read: int = 0
    written: int = 0
    activations_paged: int = 0  # saved activations put in the store, and of them read back from NVMe
    activations_read: int = 0
    tokens: int = 0
    stopped: tuple[int, int] | None = None  # (the signal, the step the run stopped after)

    def add(self, loss: float, grad_norm: float | None, dt: float, before: dict, now: dict, tokens: int) -> None:
        """One step: its loss, its norm, its seconds and tokens, and the engine's counters' growth
        from `before` to `now` (two `engine.stats()`)."""
        self.history.append(loss)
        self.unlogged.append(loss)
        self.grad_norms.append(grad_norm)
        self.seconds += dt
        self.wait += now["unit_wait_seconds"] - before["unit_wait_seconds"]
        self.opt += now["optimizer_seconds"] - before["optimizer_seconds"]
        self.read += now["bytes_read"] - before["bytes_read"]
        self.written += now["bytes_written"] - before["bytes_written"]
        self.activations_paged += now["activations"]["bytes_paged"]  # the engine's counts are the step's own
        self.activations_read += now["activations"]["bytes_from_nvme"]
        self.tokens += tokens

    @property
    def loss(self) -> float:
        """The loss the console and the log say: the mean since the log's last row."""
        return sum(self.unlogged) / len(self.unlogged)

    def step_line(self, step: int, steps: int, result: dict, tokens: int, dt: float, now: dict, eta: str) -> str:
        line = (f"step {step}/{steps} loss {self.loss:.4f} lr {result['lr']:.3g} {tokens / dt:,.0f} tok/s "
                f"{dt:.2f} s (I/O wait {self.wait:.1f} s) host {human_bytes(now['host']['in_use'])} "
                f"nvme {human_bytes(now['nvme']['bytes'])} {eta}")
        return line + (" (step skipped: fp16 overflow)" if result["skipped"] else "")

    def log_row(self, log: RunLog, step: int, result: dict, tokens: int, dt: float, now: dict,
                val: float | None) -> None:
        """log.jsonl's row for `step` (its fields unchanged since the first release); the loss is
        the mean since the last row, which it then clears."""
        log.row(step=step, loss=self.loss, lr=result["lr"], grad_norm=result["grad_norm"],
                tokens_per_second=tokens / dt, tokens=self.tokens, io_wait_seconds=self.wait,
                bytes={"device": now["device"]["in_use"], "host": now["host"]["in_use"], "nvme": now["nvme"]["bytes"]},
                **({"eval_loss": val} if val is not None else {}))
        self.unlogged.clear()


def summary_of(run: RunProgress, job: Job, config: runtime.Config, *, steps: int, start: int, hyper: dict,
               memory: dict, stats: dict, exported: str | None, ckpt_dir: str | None, init_seconds: float,
               peak_rss: int, resume: str) -> dict[str, Any]:
    """The run's summary: what `train` returns and `--json` writes."""
    ran = max(1, len(run.history))
    stopped = None if run.stopped is None else {"signal": signal.Signals(run.stopped[0]).name,
                                                "after_step": run.stopped[1], "exit_code": 128 + run.stopped[0],
                                                "resume": resume}
    return {
        "preset": job.name, "params": job.params, "trainable_params": job.trainable,
        "state_bytes": state_bytes(job, config), "dtype": config.dtype, "exported": exported,
        "offload_params": config.offload_params, "offload_optimizer": config.offload_optimizer,
        "steps": steps, "start_step": start, "losses": run.history, "val_losses": run.val_history,
        "grad_norms": run.grad_norms,
        "seconds_per_step": run.seconds / ran, "io_wait_seconds_per_step": run.wait / ran,
        "optimizer_seconds_per_step": run.opt / ran, "bytes_read_per_step": run.read / ran,
        "bytes_written_per_step": run.written / ran, "offload_activations": config.offload_activations,
        "activation_bytes_paged_per_step": run.activations_paged / ran,
        "activation_bytes_read_per_step": run.activations_read / ran,
        "tokens_per_second": run.tokens / max(run.seconds, 1e-9), "init_seconds": init_seconds,
        "peak_rss_bytes": peak_rss, "checkpoints": ckpt_dir,
        "prefetch_hit_rate": stats["prefetch_hit_rate"], "config": config.to_dict(), "optimizer": hyper,
        "memory": memory, "stopped": stopped,
    }


def done_line(summary: dict, job: Job) -> str:
    """The closing line of a run that was not stopped: what it trained, how fast, what it wrote."""
    history, val_history = summary["losses"], summary["val_losses"]
    steps, start = summary["steps"], summary["start_step"]
    losses = (f", loss {history[0]:.3f} -> {history[-1]:.3f}" if history
              else f" (the checkpoint is at step {start}, and --steps is {steps})")
    val_text = f", val {val_history[-1][1]:.3f}" if val_history else ""
    written = [what for what in (f"the model in {summary['exported']}" if summary["exported"] else None,
                                 f"checkpoints in {summary['checkpoints']}" if summary["checkpoints"] else None)
               if what]
    return (f"done. {job.name} ({human_count(job.params)} params, {human_bytes(summary['state_bytes'])} of "
            f"model states) trained {max(0, steps - start)} steps{losses}{val_text}; parameters in "
            f"{WHERE[summary['offload_params']]}, optimizer states in {WHERE[summary['offload_optimizer']]}; "
            f"{summary['seconds_per_step']:.2f} s/step;{paged_text(summary)} "
            f"peak RSS {human_bytes(summary['peak_rss_bytes'])}; "
            + (f"wrote {' and '.join(written)}" if written else "wrote nothing (--no-save)"))


def paged_text(summary: dict) -> str:
    """The done line's words for the activations a step paged, where it paged any."""
    paged, read = summary["activation_bytes_paged_per_step"], summary["activation_bytes_read_per_step"]
    if not paged:
        return ""
    return f" activations {human_bytes(paged)} paged and {human_bytes(read)} read back from NVMe a step;"
