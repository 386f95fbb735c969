"""`outcore estimate` against the bytes a real engine reports on a small GPT."""

import json

import pytest
import torch

import outcore
from outcore.offload import Tier
from outcore.offload.io_config import round_up
from outcore.tools.cli import main
from outcore.tools.estimate import estimate, legal_settings
from outcore.tools.model_source import resolve_model, source_layout, unit_numels

SETTINGS = [(3, "nvme", "nvme", 1.0), (3, "nvme", "nvme", None), (3, "cpu", "cpu", 1.0), (3, "none", "none", 1.0),
            (3, "none", "nvme", None), (2, "none", "cpu", 1.0), (3, "cpu", "nvme", 1.0)]


def _within(measured: int, estimated: int, tol: float = 0.10) -> bool:
    return abs(measured - estimated) <= tol * max(measured, estimated)


@pytest.mark.parametrize(("stage", "params", "opt", "clip"), SETTINGS)
def test_estimate_matches_engine(tmp_path, stage, params, opt, clip):
    source = resolve_model("tiny")
    with outcore.deferred_init():
        model = source.build()
    config = outcore.Config(stage=stage, offload_params=params, offload_optimizer=opt, nvme_dir=str(tmp_path),
                            dtype="fp32", grad_clip=clip)
    engine = outcore.Engine(model, config, init_fn=source.init_fn)
    try:
        gen = torch.Generator().manual_seed(0)
        # Peaks of steady steps: the first records the trace, the second is the first to prefetch,
        # and which keys sit in HOST or DEVICE when it peaks depends on timing; by the third the
        # high-water mark the plan describes has been reached.
        for _ in range(3):
            x = torch.randint(0, 256, (4, source.gpt.seq), generator=gen)
            engine.backward(engine(x, x))
            engine.step()
        engine.synchronize()
        # Updated parameter shards wait in HOST until evicted; settle everything where it rests.
        # (Optimizer states the host budget keeps rest in HOST: runtime/memory_plan.py [Note: kept
        # optimizer states].)
        resting = {"param": params, "opt": opt}
        for key in engine.store.keys():
            unit, kind = key.split(".")[0], key.split(".")[1].rstrip("0123456789")
            kept = kind == "opt" and int(unit[1:]) in engine.place.kept
            if resting.get(kind) == "nvme" and not kept:
                engine.store.evict(key, Tier.NVME).wait()
        s = engine.stats()
    finally:
        engine.close()
    numels, layout = source_layout(source)
    plan = estimate(numels, world=1, dtype="fp32", device="cpu", stage=stage, offload_params=params,
                    offload_optimizer=opt, grad_clip=clip, **layout)
    device = s["device"]["peak"] + s["gathered"]["peak"]
    assert _within(device, plan.device.total), (device, plan.device)
    # The store's HOST (gradients handed straight to the optimizer are outside it). It may come in
    # under the plan by up to the updated parameter shards: the plan caches them all there, while
    # on a CPU a shard updated in place stays in DEVICE until pushed down, and how many are pushed
    # depends on timing (runtime/optimizer.py [Note: updated parameters stay put]). And by the
    # optimizer's read-ahead: the plan sizes each of its slots for the largest chunk, and the
    # chunks read ahead of a small one are small too. And, parameters resting in HOST, by the shards
    # in DEVICE's prefetch window: on a CPU a shard changes tier without a copy, so the plan counts
    # it in both, and how many sit in DEVICE as HOST peaks (backward's end) depends on timing.
    host, planned = s["host"]["peak"], plan.host.states + plan.host.runtime
    updated = sum(round_up(4 * n) for n in unit_numels(source)) if params == "nvme" else 0
    read_ahead = plan.read_ahead_ample * (round_up(8 * max(unit_numels(source))) + 4096) if opt == "nvme" else 0
    window = plan.device.runtime if params == "cpu" else 0
    assert host <= planned, (s["host"], plan.host)
    assert _within(host, planned) or host >= 0.9 * (planned - updated - read_ahead - window), (s["host"], plan.host)
    # At rest: the plan's NVMe runtime bytes are a speculative step's kept states (none between steps).
    assert _within(s["nvme"]["bytes"], plan.nvme.states), (s["nvme"], plan.nvme)


def test_legal_settings_follow_the_config_rules():
    all_ = legal_settings()
    assert len(all_) == 15 and (3, "nvme", "nvme") in all_ and (2, "cpu", "none") not in all_
    assert legal_settings(stage=3, offload_params="nvme") == [(3, "nvme", o) for o in ("none", "cpu", "nvme")]
    for st, op, oo in all_:
        outcore.Config(stage=st, offload_params=op, offload_optimizer=oo, nvme_dir="/tmp")  # accepted


def test_fp32_masters_are_the_parameter_shards_unless_a_gpu_keeps_its_parameters():
    units = [1 << 20] * 4
    per_param = {}
    for device, dtype in (("cpu", "fp32"), ("cuda", "fp32"), ("cpu", "bf16")):
        plan = estimate(units, dtype=dtype, device=device, offload_params="none", offload_optimizer="cpu")
        per_param[device, dtype] = plan.host.states / sum(units)
    # [m|v] in HOST where the update may fetch the parameters; [master|m|v] where they stay on a GPU
    # or are not fp32.
    assert per_param == {("cpu", "fp32"): 8, ("cuda", "fp32"): 12, ("cpu", "bf16"): 12}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_train_batch_activations_match_what_the_engine_pages(dtype):
    """`estimate --accumulate` against the bytes a real train_batch of the tiny preset pages."""
    from outcore.runtime.materialize import deferred_init
    from outcore.tools.estimate import train_batch_activations

    source = resolve_model("tiny")
    with deferred_init():
        model = source.build()
    engine = outcore.Engine(model, outcore.Config(stage=3, dtype=dtype, host_budget=64 << 20), init_fn=source.init_fn)
    g = torch.Generator().manual_seed(0)
    engine.train_batch([tuple(torch.randint(0, 256, (2, 128), generator=g) for _ in range(2)) for _ in range(4)])
    paged = engine.stats()["activations"]["bytes_paged"]
    engine.close()
    gpt = source.gpt
    assert paged == train_batch_activations(layers=gpt.layers, d_model=gpt.d_model, vocab=gpt.vocab, batch=2,
                                            seq=128, micro_batches=4, dtype=dtype)


def test_estimate_accumulate_prints_and_writes_the_activation_keys(tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["estimate", "--model", "tiny", "--accumulate", "4", "--batch", "2", "--json", str(out)]) == 0
    assert "train_batch of 4 micro-batches of 2 x 128" in capsys.readouterr().out
    assert json.loads(out.read_text())["train_batch_activation_bytes"] == 4 * 2 * 128 * (6 * 128 * 2 + 256 * 4)


@pytest.mark.parametrize("lora", [None, 4])
def test_estimate_of_an_encoder_decoder_is_the_plan_its_engine_makes(tmp_path, lora):
    """`estimate --model DIR` sizes any model transformers builds with an LM head, not causal LMs alone
    (T5 was refused with train's "no causal language model"), and with its LoRA adapters."""
    import peft
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=1,
                                num_heads=4)
    transformers.T5ForConditionalGeneration(cfg).save_pretrained(tmp_path / "t5")
    out = tmp_path / "e.json"
    argv = ["estimate", "--model", str(tmp_path / "t5"), "--stage", "3", "--offload-params", "cpu",
            "--offload-optimizer", "cpu", "--dtype", "fp32", "--device", "cpu", "--json", str(out)]
    assert main([*argv, *(["--lora", str(lora)] if lora else [])]) == 0
    row = json.loads(out.read_text())["rows"]
    assert len(row) == 1

    with outcore.deferred_init():
        model = transformers.T5ForConditionalGeneration(cfg)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear",
                                                           task_type="SEQ_2_SEQ_LM"))
    config = outcore.Config(stage=3, offload_params="cpu", offload_optimizer="cpu", dtype="fp32")
    engine = outcore.Engine(model, config, weights=tmp_path / "t5")
    try:
        plan = engine.memory_plan().as_dict()
    finally:
        engine.close()
    assert {tier: row[0][tier] for tier in ("device", "host", "nvme")} == plan


@pytest.mark.parametrize("command", [["estimate", "--params", "1B"], ["export", "ckpt", "out.safetensors"],
                                     ["tune", "--config", "run.json"], ["train", "--steps", "1"],
                                     ["bench-disk", "--dir", "d", "--size", "1M"]])
def test_every_commands_json_that_cannot_be_written_is_refused_before_its_work(tmp_path, monkeypatch, capsys,
                                                                               command):
    """estimate and export did their work and then failed on --json with an IsADirectoryError (exit 1)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").mkdir()
    assert main([*command, "--json", "taken"]) == 2
    assert "--json" in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_batch_and_seq_print_the_step_s_activations_by_part(capsys, tmp_path):
    from outcore.tools.activations import Shape, activation_rows

    assert main(["estimate", "--model", "tiny", "--batch", "4", "--seq", "64", "--dtype", "fp32",
                 "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert "activations of one micro-batch of 4 x 64, without activation checkpointing" in out
    assert "  logits, their fp32 loss and its gradient:" in out and "one block recomputed in backward" in out
    written = json.loads((tmp_path / "e.json").read_text())["activation_rows"]["plain"]
    assert written == activation_rows(Shape(4, 128, 256), batch=4, seq=64, dtype="fp32", checkpointed=False)


def test_where_offloaded_parameters_save_no_device_memory_the_estimate_says_why(capsys):
    assert main(["estimate", "--model", "tiny", "--stage", "3", "--dtype", "fp32", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "saves no device memory" in out and "prefetch window" in out
    assert main(["estimate", "--model", "gpt-1b", "--stage", "3", "--offload-params", "nvme"]) == 0
    assert "saves no device memory" not in capsys.readouterr().out
