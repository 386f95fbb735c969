"""`outcore tune`: the fastest prefetch and I/O settings for this model on this machine, measured.

Each candidate runs the real model for a few steps in a fresh process (so its peak RSS is its
own and no page cache or allocator state carries over). The sweep is coordinate descent: one knob
at a time, keeping the best value before moving on — prefetch_depth, then block_size x
queue_depth, then threads, then the background threads' priority (`io.nice`), then the host budget
(the I/O knobs only when something rests on NVMe). Priority is a trade: yielding to compute wins
when compute is the bottleneck, and loses when the optimizer's stream through NVMe is.
Budgets never go above the ones the config allows.

[Note: a winner that holds] A few timed steps of one candidate after another measure the
machine's swings more than the settings (a winner at 0.81x in the sweep ran 0.99x through `outcore
train`: docs/benchmarks.md). So each phase runs its candidates (the best so far among them) in
interleaved rounds, a different one first each round, and compares their medians. At the end the
winner and the config as given run against each other in as many interleaved rounds again, and the
winner is written (with `Config.to_file`) only where its median beats the given config's by more
than the given config's own spread in those rounds (at least 2%); otherwise nothing is written,
and the command says so.

Models: a GPT preset; a Hugging Face causal LM's directory, its weights loaded as `outcore train
--model` loads them and fed random token ids below its vocabulary size; or `module:factory` whose
model takes a (batch, seq) tensor of token ids below 256 and returns either the loss (a scalar) or
logits (then cross-entropy on the next token).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from outcore import runtime
from outcore.hf.source import HFModel
from outcore.runtime.sizes import human_bytes
from outcore.tools.sweep_pruning import SweepPruner

DEFAULT_SWEEP = {"prefetch_depth": [1, 2, 4], "block_size": [1 << 20, 8 << 20], "queue_depth": [8, 32],
                 "threads": [2, 4, 8], "nice": [0, 15], "host_budget_fraction": [0.25, 0.5, 1.0]}


@dataclass
class Candidate:
    config: runtime.Config
    label: str
    samples: list[dict] = dataclasses.field(default_factory=list)  # one measurement a round

    @property
    def ok(self) -> bool:
        return bool(self.samples) and all("error" not in r for r in self.samples)

    @property
    def result(self) -> dict:
        """The medians of its rounds (peak RSS: the largest); a failed round's error, if any."""
        failed = [r for r in self.samples if "error" in r]
        if failed or not self.samples:
            return failed[0] if failed else {}
        out = {k: statistics.median(r[k] for r in self.samples) for k in self.samples[0]
               if isinstance(self.samples[0][k], (int, float)) and k != "peak_rss_bytes"}
        out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in self.samples)
        out["rounds"] = len(self.samples)
        return out


@dataclass
class Confirmation:
    """The winner against the config as given, in interleaved rounds of their own."""

    given: list[float]  # step seconds, a round each
    winner: list[float]

    @property
    def spread(self) -> float:
        """The given config's own spread in these rounds, relative to its median (at least 2%)."""
        mid = statistics.median(self.given)
        return max(0.02, (max(self.given) - min(self.given)) / mid)

    @property
    def ratio(self) -> float:
        return statistics.median(self.winner) / statistics.median(self.given)

    @property
    def holds(self) -> bool:
        return self.ratio < 1.0 - self.spread

    def as_dict(self) -> dict:
        return {"given_s": self.given, "winner_s": self.winner, "ratio": self.ratio, "spread": self.spread,
                "holds": self.holds}


@dataclass
class Tuned:
    """What a sweep found: the config to write (None where nothing beat the given one beyond its
    spread), every candidate, and the final confirmation (None where the given config won the sweep)."""

    best: runtime.Config | None
    candidates: list[Candidate]
    confirmation: Confirmation | None
    pruned: list[str] = dataclasses.field(default_factory=list)  # what the prediction left out, and why


def measure(config: runtime.Config, model_spec: str, *, steps: int, batch: int, seq: int | None) -> dict:
    """Run one warm-up step and `steps` timed steps in this process; step time is their median."""
    from outcore.tools.model_source import resolve_model
    from outcore.tools.report import peak_rss

    source = resolve_model(model_spec, seq=seq)
    vocab = 256
    if source.gpt is not None:
        seq = seq or source.gpt.seq
    elif source.weights is not None:
        vocab, seq = _hf_shape(source.weights, seq)
    else:
        seq = seq or 128
    with runtime.deferred_init():
        model = source.build()
    engine = runtime.Engine(model, config, init_fn=source.init_fn, weights=source.weights)
    try:
        gen = torch.Generator().manual_seed(0)
        times, waits = [], []
        before = engine.stats()
        first = dict(before)
        for step in range(steps + 1):
            x = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(engine.device)
            t0 = time.perf_counter()
            if source.weights is not None:  # a causal LM shifts its labels itself
                loss = engine(input_ids=x[:, :-1], labels=x[:, :-1], use_cache=False).loss
            else:
                out = engine(x[:, :-1], x[:, 1:]) if source.gpt else engine(x[:, :-1])
                loss = out if out.dim() == 0 else F.cross_entropy(out.flatten(0, -2).float(), x[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            now = engine.stats()
            if step == 0:
                first = now  # the warm-up step records the trace; it is not timed
            else:
                times.append(time.perf_counter() - t0)
                waits.append(now["unit_wait_seconds"] - before["unit_wait_seconds"])
            before = now
        return {"step_seconds": statistics.median(times), "io_wait_seconds": statistics.median(waits),
                "bytes_read_per_step": (before["bytes_read"] - first["bytes_read"]) / steps,
                "bytes_written_per_step": (before["bytes_written"] - first["bytes_written"]) / steps,
                "peak_rss_bytes": peak_rss(), "loss": float(loss.detach())}
    finally:
        engine.close()


def _hf_shape(directory: str, seq: int | None) -> tuple[int, int]:
    """The vocabulary size of the model in `directory`, and the sequence length to measure it at
    (128, or its positions if fewer)."""
    config = HFModel(directory).config()
    positions = getattr(config, "max_position_embeddings", None)
    if seq is not None and isinstance(positions, int) and seq > positions:
        raise ValueError(f"--seq {seq} is longer than the {positions} positions {directory!r} has; give --seq "
                         f"{positions} or less.")
    return int(config.vocab_size), seq or min(128, positions or 128)


def run_candidate(config: runtime.Config, model_spec: str, *, steps: int, batch: int, seq: int | None,
                  timeout: float) -> dict:
    """`measure` in a fresh interpreter; a failure comes back as {"error": ...}, never raised."""
    with tempfile.TemporaryDirectory(prefix="outcore-tune-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "result.json")
        config.to_file(cfg_path)
        cmd = [sys.executable, "-m", "outcore.tools.tune", cfg_path, model_spec, str(steps), str(batch), str(seq or 0),
               out_path]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return {"error": lines[-1] if lines else f"exit status {proc.returncode}"}
        with open(out_path) as f:
            return json.load(f)


def _variants(best: runtime.Config, knob: str, values: list,
              host_limit: int | None) -> list[tuple[runtime.Config, str]]:
    out = []
    for v in values:
        if knob == "prefetch_depth":
            cfg, label = dataclasses.replace(best, prefetch_depth=v), f"prefetch_depth={v}"
        elif knob == "io":
            bs, qd = v
            cfg = dataclasses.replace(best, io=dataclasses.replace(best.io, block_size=bs, queue_depth=qd))
            label = f"block_size={human_bytes(bs)} queue_depth={qd}"
        elif knob == "threads":
            cfg, label = dataclasses.replace(best, io=dataclasses.replace(best.io, threads=v)), f"threads={v}"
        elif knob == "nice":
            cfg, label = dataclasses.replace(best, io=dataclasses.replace(best.io, nice=v)), f"nice={v}"
        else:  # host budget, as a fraction of what the config allows
            budget = int(host_limit * v) // 4096 * 4096
            cfg, label = dataclasses.replace(best, host_budget=budget), f"host_budget={human_bytes(budget)}"
        out.append((cfg, label))
    return out


def tune(base: runtime.Config, model_spec: str, *, steps: int = 3, batch: int = 1, seq: int | None = None,
         sweep: dict | None = None, max_rss: int | None = None, timeout: float = 1800, rounds: int = 3,
         on_result=None, pruner: SweepPruner | None = None) -> Tuned:
    """Coordinate descent over the sweep, each phase's candidates measured in `rounds` interleaved
    rounds, and the winner confirmed against the given config ([Note: a winner that holds]). With a
    `pruner`, candidates the step prediction shows cannot win are not run (tools/sweep_pruning.py)."""
    sweep = {**DEFAULT_SWEEP, **(sweep or {})}
    uses_nvme = "nvme" in (base.offload_params, base.offload_optimizer)
    tried: dict[str, Candidate] = {}
    pruned: list[str] = []

    def can_matter(knob: str, cfg: runtime.Config, label: str) -> bool:
        why = None
        if pruner is not None and knob in ("io", "threads"):
            why = pruner.skip_io(best.config)
        elif pruner is not None and knob == "host":
            why = pruner.skip_host_budget(best.config, cfg)
        if why and (knob == "host" or not any(p.startswith(f"{knob}:") for p in pruned)):
            pruned.append(f"{knob}: {why}" if knob != "host" else f"{label}: {why}")
        return why is None

    def candidate(cfg: runtime.Config, label: str) -> Candidate:
        return tried.setdefault(json.dumps(cfg.to_dict(), sort_keys=True), Candidate(cfg, label))

    def measure_once(cand: Candidate) -> dict:
        result = run_candidate(cand.config, model_spec, steps=steps, batch=batch, seq=seq, timeout=timeout)
        if "error" not in result and max_rss and result["peak_rss_bytes"] > max_rss:
            result["error"] = f"peak RSS {human_bytes(result['peak_rss_bytes'])} over --max-rss"
        return result

    def interleave(cands: list[Candidate], n: int) -> None:
        """`n` rounds, each candidate once a round, a different one first each time; a candidate
        that fails drops out."""
        for r in range(n):
            for cand in cands[r % len(cands):] + cands[: r % len(cands)]:
                if cand.samples and not cand.ok:
                    continue
                cand.samples.append(measure_once(cand))
                if on_result:
                    on_result(cand)

    given = candidate(base, "the config as given")
    interleave([given], 1)
    if not given.ok:  # refused up front (a ValueError) is the config's fault; anything else, the run's
        failure = ValueError if given.result.get("refused") else RuntimeError
        raise failure(f"the config as given does not run: {given.result['error']}")
    best = given
    phases = [("prefetch_depth", sweep["prefetch_depth"])]
    if uses_nvme:
        phases += [("io", [(b, q) for b in sweep["block_size"] for q in sweep["queue_depth"]]),
                   ("threads", sweep["threads"]), ("nice", sweep["nice"])]
        if base.host_budget:  # shrink the host budget only below what the config allows
            phases.append(("host", sweep["host_budget_fraction"]))
    for knob, values in phases:
        phase = [best] + [c for c in (candidate(cfg, label) for cfg, label in
                                      _variants(best.config, knob, values, base.host_budget)
                                      if can_matter(knob, cfg, label)) if c is not best]
        if len(phase) == 1:
            continue
        start = {id(c): len(c.samples) for c in phase}
        interleave(phase, rounds)
        # this phase's rounds only, of the candidates that ran (a failed one drops out)
        now = {id(c): _summary(c.samples[start[id(c)]:]) for c in phase if c.ok}
        if id(best) not in now:
            raise RuntimeError(f"the best config so far ({best.label}) failed when run again: {best.result['error']}")
        for cand in phase[1:]:
            if cand.ok and _better(now[id(cand)], now[id(best)]):
                best = cand
    if best is given:
        return Tuned(None, list(tried.values()), None, pruned)
    final = [Candidate(given.config, given.label), Candidate(best.config, best.label)]
    interleave(final, rounds)
    if not all(c.ok for c in final):
        return Tuned(None, list(tried.values()), None, pruned)
    confirmation = Confirmation([r["step_seconds"] for r in final[0].samples],
                                [r["step_seconds"] for r in final[1].samples])
    return Tuned(best.config if confirmation.holds else None, list(tried.values()), confirmation, pruned)


def _summary(samples: list[dict]) -> dict:
    """Median step seconds and the largest peak RSS of these rounds."""
    return {"step_seconds": statistics.median(r["step_seconds"] for r in samples),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in samples)}


def _better(a: dict, b: dict) -> bool:
    """Faster by more than 2% (noise), or as fast with less memory."""
    ta, tb = a["step_seconds"], b["step_seconds"]
    if ta < 0.98 * tb:
        return True
    return ta <= 1.02 * tb and a["peak_rss_bytes"] < 0.95 * b["peak_rss_bytes"]


def _worker(argv: list[str]) -> None:
    cfg_path, model_spec, steps, batch, seq, out_path = argv
    try:
        result = measure(runtime.Config.from_file(cfg_path), model_spec, steps=int(steps), batch=int(batch),
                         seq=int(seq) or None)
    except ValueError as e:  # the engine refused the config or the model before running it
        result = {"error": f"ValueError: {e}", "refused": True}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _worker(sys.argv[1:])
