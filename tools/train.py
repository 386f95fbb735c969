"""`outcore train`: a GPT preset trained by the engine on a text file or the stdlib corpus, or a
Hugging Face model fine-tuned (fully, or with LoRA) on text its own tokenizer packs (train_job.py).

Defaults are chosen for the machine at hand: the least offloading whose bytes (by the memory plan)
fit in half of the free memory, or within --max-memory beside the process and the activations
(tools/memory_bound.py), bf16 where the hardware computes it natively, and an NVMe directory under
the working directory that is removed afterwards. Each choice is printed once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shlex
import time
from collections.abc import Iterator

import torch

from outcore import runtime
from outcore.hf.data_mix import data_file
from outcore.hf.model_info import hf_checkpointing
from outcore.offload import StorageError
from outcore.offload.scratch_dir import DirectoryLock
from outcore.runtime.checkpoint.folder import find_checkpoint
from outcore.runtime.collectives import all_reduce_sum
from outcore.tools.activations import activation_rows, preflight
from outcore.tools.arg_types import MOST_STEPS
from outcore.tools.interrupts import requested_stop, step_boundaries
from outcore.tools.lr_schedules import DEFAULT as DEFAULT_SCHEDULE
from outcore.tools.lr_schedules import Schedule, warmup_steps
from outcore.tools.memory_bound import RunDoesNotFit, address_space_note
from outcore.tools.progress_lines import ProgressLines
from outcore.tools.report import peak_rss
from outcore.tools.run_log import RunLog
from outcore.tools.run_outputs import check_outputs
from outcore.tools.run_record import record
from outcore.tools.sequence_pieces import WHOLE, Pieces, install_pieces, sequence_plan
from outcore.tools.train_config import build_config
from outcore.tools.train_flags import check_flags
from outcore.tools.train_job import Data, DataOptions, Job, hf_job, job_loss, preset_job
from outcore.tools.train_options import TrainOptions as TrainOptions
from outcore.tools.train_report import RunProgress, done_line, start_lines, summary_of

log = logging.getLogger("outcore.train")


def make_job(opts: TrainOptions) -> Job:
    """What the run trains: a preset on text, or a Hugging Face model on fine-tuning data."""
    if not opts.model:
        return preset_job(opts.preset, data=opts.data, batch=opts.batch, seq=opts.seq, seed=opts.seed)
    data = DataOptions(tuple(data_file(spec) for spec in opts.data), opts.chat_template, not opts.train_on_prompt,
                       opts.packing, opts.eval_data, opts.eval_split) if opts.data else None
    return hf_job(opts.model, lora=opts.lora, merge=opts.merge_adapters, data=data, batch=opts.batch, seq=opts.seq,
                  seed=opts.seed, lora_alpha=opts.lora_alpha, lora_targets=opts.lora_targets,
                  lora_init=opts.lora_init, dora=opts.dora)


def optimizer_settings(opts: TrainOptions, job: Job, config: runtime.Config) -> dict:
    """AdamW's settings: the job's defaults, then the config's optimizer section, then the flags
    (--lr: the schedule's peak)."""
    hyper = {"lr": job.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1 if job.trainable == job.params
             else 0.0, **config.optimizer}
    hyper["betas"] = (opts.adam_beta1 if opts.adam_beta1 is not None else hyper["betas"][0],
                      opts.adam_beta2 if opts.adam_beta2 is not None else hyper["betas"][1])
    for key, value in (("lr", opts.lr), ("weight_decay", opts.weight_decay)):
        if value is not None:
            hyper[key] = value
    return hyper


def built_model(job: Job, checkpointing: bool, pieces: Pieces = WHOLE) -> torch.nn.Module:
    """The job's model (parameters on the meta device), its activation checkpointing as asked, and
    its loss over chunks and MLPs over tiles where `pieces` has them (tools/sequence_pieces.py)."""
    model = job.build()
    enable = hf_checkpointing(model)
    for flag, given, what in (("--loss-chunk-tokens", pieces.loss_chunk, "causal LM's loss over chunks"),
                              ("--tile-tokens", pieces.tile, "decoder's MLPs over tiles")):
        if given is not None and enable is None:
            raise ValueError(f"{flag} computes a Hugging Face {what}: give --model.")
    if enable is not None:
        install_pieces(model, pieces)
    if enable is not None:  # a Hugging Face model: its own
        if checkpointing:
            enable()
    else:  # read by outcore's GPT (and by any model of one's own that honours it)
        setattr(model, "checkpoint_activations", checkpointing)  # noqa: B010
    return model


def one_step(engine: runtime.Engine, job: Job, step: int, accum: int, *, vertical: bool, shard: tuple[int, int],
             device: torch.device) -> tuple[dict, float]:
    """Optimizer step `step` over `accum` micro-batches: one train_batch (`vertical`: each unit read
    once for all of them) or a backward each; its stats and the micro-batches' summed loss."""
    batches = [job.train.at(step * accum + micro, shard) for micro in range(accum)]
    if vertical:
        result = engine.train_batch([job.inputs(b, device) for b in batches])
        return result, sum(result["losses"])
    loss_sum = 0.0
    for b in batches:
        loss = job_loss(engine, job, b, device)
        engine.backward(loss)
        loss_sum += float(loss.detach())
    return engine.step(), loss_sum


def run_steps(opts: TrainOptions, job: Job) -> int:
    """The run's optimizer steps: --epochs' passes over the training rows (capped by --steps), or
    --steps, or the job's default."""
    if opts.epochs is None:
        return opts.steps or job.steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = opts.batch * (opts.accumulate or 1) * world
    rows = job.train.corpus.row_count(job.seq)
    steps = max(1, math.ceil(opts.epochs * rows / per_step))
    if opts.steps:
        return min(steps, opts.steps)
    if steps > MOST_STEPS:
        raise ValueError(f"--epochs {opts.epochs:g} is {steps:,} steps of {per_step} rows over {rows:,} rows: more "
                         f"than {MOST_STEPS:,}; give fewer epochs, or --steps.")
    return steps


def evaluate(engine: runtime.Engine, job: Job, held_out: Data, batches: int, device: torch.device) -> float:
    """Mean loss on fixed held-out batches (the same ones at every evaluation), over all ranks."""
    shard = (engine.group.rank, engine.group.world)
    with torch.no_grad():
        losses = [float(job_loss(engine, job, held_out.at(i, shard), device)) for i in range(batches)]
    return mean_over_ranks(engine, sum(losses) / len(losses))


def mean_over_ranks(engine: runtime.Engine, value: float) -> float:
    """What the report says under several ranks: the mean of their values, each on its own rows."""
    if engine.group.world == 1:
        return value
    total = all_reduce_sum(torch.tensor([value], dtype=torch.float64, device=engine.device), engine.group)
    return float(total) / engine.group.world


def _kept(ckpt_dir: str, out: str) -> str:
    """What a run stopped early leaves to resume from, and the command that goes on with it."""
    try:
        return f"{find_checkpoint(ckpt_dir)} is saved; go on with: outcore train --out {shlex.quote(out)} --resume"
    except (ValueError, StorageError):
        return "no checkpoint was saved (--save-every N saves along the way)"


@contextlib.contextmanager
def _run_directory(out: str) -> Iterator[None]:
    """`--out`, made if missing and held by this run: two live runs on one would write the same
    checkpoints folder and its `latest` in turn (each rank holds its own lock file there). Folders
    made here that the run leaves empty (it failed before writing) are removed again."""
    made = []
    path = os.path.abspath(out)
    while not os.path.exists(path):
        made.append(path)
        path = os.path.dirname(path)
    try:  # the CLI checked that it can be written, but some folders (/proc) say so and then refuse
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be created: {e.strerror}; name another.") from None
    lock = DirectoryLock(out, int(os.environ.get("RANK", "0")), what="--out", prefix="run.")
    try:
        yield
    finally:
        lock.release(remove=True)
        for folder in made:  # innermost first
            try:
                os.rmdir(folder)
            except OSError:  # not empty: what the run wrote stays
                break


def train(opts: TrainOptions, *, report=print) -> dict:
    """Train; returns a summary (also what `--json` writes). `report` receives progress lines."""
    with _run_directory(opts.out):
        return _train(opts, report)


def _train(opts: TrainOptions, report) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    limited = address_space_note()
    if limited is not None:
        report(f"outcore train: {limited}")
    check_flags(opts)
    check_outputs(opts.out, opts.report_to)
    job = make_job(opts)
    checkpointing = (opts.checkpoint_activations if opts.checkpoint_activations is not None
                     else job.checkpoint_activations)
    opts, pieces, how = sequence_plan(opts, job, checkpointing, report)  # what the step holds, and where

    def activations(dtype: str) -> int:
        return 0 if job.shape is None else sum(activation_rows(job.shape, batch=opts.batch, seq=job.seq, dtype=dtype,
                                                               checkpointed=checkpointing, **how).values())

    try:
        config, notes, owned_nvme, memory = build_config(opts, job.unit_numels, device, activations, job.layout)
    except RunDoesNotFit as e:
        one_row = e.smallest + activations(e.dtype) // opts.batch
        if job.shape is not None and opts.max_memory is not None and one_row <= opts.max_memory:
            # a smaller batch would fit: the preflight names the largest that does
            preflight(job.shape, batch=opts.batch, seq=job.seq, dtype=e.dtype, checkpointed=checkpointing,
                      budgets=e.smallest, max_memory=opts.max_memory, **how)
        raise
    steps = run_steps(opts, job)
    hyper = optimizer_settings(opts, job, config)
    schedule = Schedule(opts.lr_scheduler or DEFAULT_SCHEDULE, steps,
                        warmup_steps(steps, opts.warmup_steps, opts.warmup_ratio), hyper["lr"], opts.min_lr_rate)
    for line in notes + [f"data {line}" for line in job.data_lines]:
        report(f"outcore train: {line}")
    ckpt_dir = os.path.join(opts.out, "checkpoints")
    if job.shape is not None:  # a batch whose activations cannot fit is refused before anything starts
        preflight(job.shape, batch=opts.batch, seq=job.seq, dtype=config.dtype, checkpointed=checkpointing,
                  budgets=memory["process"] + memory["device_budget_in_ram"] + memory["host_budget"],
                  max_memory=opts.max_memory, **how)
    engine = None
    log = RunLog(opts.out, report_to=opts.report_to, enabled=False)  # opened once the run starts
    try:
        t_init = time.perf_counter()
        engine = runtime.Engine(built_model(job, checkpointing, pieces), config,
                                runtime.AdamW(**hyper), seed=opts.seed, **job.engine_kw)
        init_seconds = time.perf_counter() - t_init
        if opts.resume:
            meta = engine.load_checkpoint(ckpt_dir, opts.resume_tag)
            report(f"outcore train: resumed from {os.path.join(ckpt_dir, meta['tag'])} at step {meta['step']}")
        start = engine.global_step
        for line in start_lines(job, engine.config, opts, engine.group.world, schedule, hyper):  # as the files hold it
            report(f"outcore train: {line}")
        if opts.arguments is not None and engine.group.rank == 0:
            record(opts.out, {**opts.arguments, "world": engine.group.world})
        log = RunLog(opts.out, report_to=opts.report_to, enabled=engine.group.rank == 0, resume=opts.resume,
                     config={"model": job.name, "steps": steps, "batch": opts.batch, "seq": job.seq})
        run, saved_last = _steps(engine, job, opts, schedule, steps, ckpt_dir, device, log, report)
        last = run.stopped[1] if run.stopped is not None else steps
        if opts.save_final and last > start and not saved_last:
            engine.save_checkpoint(ckpt_dir, f"step{last}")
        exported = (job.export(engine, opts.out) if job.export is not None and opts.save_final
                    and run.stopped is None else None)
        stats = engine.stats()
    finally:
        log.close()
        try:
            if engine is not None:
                engine.close()
        finally:
            if owned_nvme is not None:
                owned_nvme.remove()
    summary = summary_of(run, job, config, steps=steps, start=start, hyper=hyper, memory=memory, stats=stats,
                         exported=exported, ckpt_dir=ckpt_dir if opts.save_final else None,
                         init_seconds=init_seconds, peak_rss=peak_rss(),
                         resume=_kept(ckpt_dir, opts.out) if run.stopped is not None else "")
    if run.stopped is None:  # else the command says it in one line, after writing the summary
        report(f"outcore train: {done_line(summary, job)}")
    return summary


def _steps(engine: runtime.Engine, job: Job, opts: TrainOptions, schedule: Schedule, steps: int, ckpt_dir: str,
           device: torch.device, log: RunLog, report) -> tuple[RunProgress, bool]:
    """The steps from the engine's to `steps`, each said and logged (a line at least a minute apart),
    evaluated and saved as the flags ask, until the last or a signal. Returns what they did, and
    whether the step the run stopped after was saved already."""
    from outcore.tools.report import progress

    run = RunProgress()
    start, accum = engine.global_step, opts.accumulate or engine.config.grad_accumulation
    eval_every, save_every = opts.eval_every or max(1, steps // 5), opts.save_every or 0
    step_tokens = opts.batch * job.seq * accum * engine.group.world
    lines = ProgressLines(start, steps, opts.log_every)
    before = engine.stats()
    saving = False
    with step_boundaries(), progress(steps - start, "train") as bar:
        for step in range(start + 1, steps + 1):
            engine.lr = schedule.rate(step - 1)
            t0 = time.perf_counter()
            result, loss_sum = one_step(engine, job, step - 1, accum, vertical=bool(opts.accumulate),
                                        shard=(engine.group.rank, engine.group.world), device=device)
            evaluating = step % eval_every == 0 or step == steps
            saving = save_every > 0 and step % save_every == 0 and step != steps
            if evaluating or saving:
                # step() returns before its streamed updates land and the next forward waits for
                # them; what comes next is not a training step, so this step's time includes them.
                engine.synchronize()
            dt = time.perf_counter() - t0
            now = engine.stats()
            loss = mean_over_ranks(engine, loss_sum / accum)
            if not math.isfinite(loss) and engine.config.dtype != "fp16":  # fp16 scaling skips such steps
                raise FloatingPointError(f"the loss is {loss} at step {step}: training diverged; "
                                         "lower --lr, keep --grad-clip, or resume from an earlier checkpoint.")
            run.add(loss, result["grad_norm"], dt, before, now, step_tokens)
            before = now
            line = run.step_line(step, steps, result, step_tokens, dt, now, lines.eta(step))
            if bar is not None:
                bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
                bar.update(1)
            val = None
            if evaluating:
                val = evaluate(engine, job, job.held_out, opts.eval_batches, device)
                run.val_history.append((step, val))
                line += f" | val loss {val:.4f}"
            if evaluating or lines.due(step):
                (bar.write if bar is not None else report)(line)
                lines.said()
            if evaluating or step % opts.log_every == 0 or step == steps:
                run.log_row(log, step, result, step_tokens, dt, now, val)
            if saving:
                engine.save_checkpoint(ckpt_dir, f"step{step}")
            signum = requested_stop()  # SIGINT or SIGTERM during the step: save it, then stop
            if signum is not None:
                run.stopped = (signum, step)
                break
    return run, run.stopped is not None and saving
