"""A torch LR scheduler driving the engine (`lr_scheduler=`), as DeepSpeed steps the one given to
`deepspeed.initialize`: the same rates and losses as plain AdamW under the same scheduler, stepped
once per update (not per micro-batch), kept in checkpoints, and refused when it cannot work."""

import json
import logging

import pytest
import torch
import transformers
from helpers import HP, assert_losses_match, twins
from models import TinyGPT, batches

import outcore

WARMUP, TOTAL = 2, 6


def cosine(optimizer):
    return transformers.get_cosine_schedule_with_warmup(optimizer, WARMUP, TOTAL)


def config(tmp_path, name="nvme", **kw):
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / name),
                          sub_group_size=4096, grad_clip=None, **kw)


def plain_run(model, data, accum):
    """Plain AdamW under the same scheduler, stepped after each update: losses and the rates used."""
    opt = torch.optim.AdamW(model.parameters(), **HP)
    scheduler = cosine(opt)
    losses, rates = [], []
    for i in range(0, len(data), accum):
        total = 0.0
        for x, y in data[i : i + accum]:
            loss = model(x, y)
            (loss / accum).backward()
            total += loss.item()
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        opt.zero_grad()
        scheduler.step()
        losses.append(total / accum)
    return losses, rates


def engine_run(engine, data, accum):
    """engine.step() after every micro-batch, as with DeepSpeed; the scheduler is the engine's."""
    losses, rates = [], []
    for i in range(0, len(data), accum):
        total = 0.0
        for x, y in data[i : i + accum]:
            loss = engine(x, y)
            engine.backward(loss)
            total += loss.item()
            stats = engine.step()
        rates.append(stats["lr"])
        losses.append(total / accum)
    return losses, rates


@pytest.mark.parametrize("accum", [1, 2])
def test_a_warmup_cosine_schedule_gives_plain_adamws_rates_and_losses(tmp_path, accum):
    ours_model, ref_model = twins(lambda: TinyGPT(tied=False))
    data = batches(TOTAL * accum)
    expected, expected_rates = plain_run(ref_model, data, accum)
    engine = outcore.Engine(ours_model, config(tmp_path, grad_accumulation=accum), outcore.AdamW(**HP),
                            lr_scheduler=cosine)
    assert engine.lr == 0.0  # the warm-up's first rate, before any step
    losses, rates = engine_run(engine, data, accum)
    assert rates == pytest.approx(expected_rates, rel=1e-12)
    assert rates[0] == 0.0 and rates[WARMUP] == HP["lr"]
    assert_losses_match(losses, expected)
    engine.close()


def test_train_batch_steps_the_scheduler_once_per_batch(tmp_path):
    engine = outcore.Engine(TinyGPT(), config(tmp_path, grad_accumulation=2), outcore.AdamW(**HP),
                            lr_scheduler=cosine)
    data = batches(4)
    first = engine.train_batch(data[:2], loss_fn=None)
    second = engine.train_batch(data[2:], loss_fn=None)
    assert (first["lr"], second["lr"]) == (0.0, HP["lr"] / WARMUP)
    engine.close()


def test_a_resumed_run_goes_on_with_the_schedule_where_it_was(tmp_path):
    data = batches(TOTAL)
    torch.manual_seed(0)
    whole = outcore.Engine(TinyGPT(), config(tmp_path, "a"), outcore.AdamW(**HP), lr_scheduler=cosine)
    expected, expected_rates = engine_run(whole, data, 1)
    whole.close()

    torch.manual_seed(0)
    first = outcore.Engine(TinyGPT(), config(tmp_path, "b"), outcore.AdamW(**HP), lr_scheduler=cosine)
    head, head_rates = engine_run(first, data[:3], 1)
    folder = first.save_checkpoint(str(tmp_path / "ckpt"))
    first.close()
    with open(f"{folder}/meta.json") as f:
        assert json.load(f)["lr_scheduler"]["last_epoch"] == 3

    torch.manual_seed(0)
    resumed = outcore.Engine(TinyGPT(), config(tmp_path, "c"), outcore.AdamW(**HP), lr_scheduler=cosine)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    tail, tail_rates = engine_run(resumed, data[3:], 1)
    assert head + tail == expected and head_rates + tail_rates == expected_rates
    resumed.close()


def test_engine_lr_set_by_hand_moves_the_optimizers_group(tmp_path):
    engine = outcore.Engine(TinyGPT(), config(tmp_path), outcore.AdamW(**HP))
    engine.lr = 1e-4
    assert engine.optimizer.param_groups[0]["lr"] == 1e-4
    engine.optimizer.param_groups[0]["lr"] = 2e-4
    assert engine.lr == 2e-4
    engine.optimizer.param_groups[0]["lr"] = float("nan")
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="a learning rate must be a finite number"):
        engine(x, y)  # before a backward that would start updates at it
    engine.lr = 1e-4
    engine.backward(engine(x, y))
    assert engine.step()["lr"] == 1e-4
    engine.close()


def test_a_scheduler_that_cycles_momentum_or_is_not_one_is_refused_before_anything_is_written(tmp_path):
    def one_cycle(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=10)

    with pytest.raises(ValueError, match="momentum"):  # torch's own words: our group has no betas to cycle
        outcore.Engine(TinyGPT(), config(tmp_path), lr_scheduler=one_cycle)
    with pytest.raises(TypeError, match="lr_scheduler=.*returned float"):
        outcore.Engine(TinyGPT(), config(tmp_path), lr_scheduler=lambda opt: 0.5)
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    with pytest.raises(TypeError, match="on another optimizer"):
        outcore.Engine(TinyGPT(), config(tmp_path), lr_scheduler=lambda opt: cosine(other))
    assert not (tmp_path / "nvme").exists()


def test_a_scheduler_state_json_cannot_hold_is_one_error_and_no_checkpoint(tmp_path):
    class Ramp:  # a callable object: LambdaLR keeps its __dict__, a tensor here, in its state
        def __init__(self):
            self.scale = torch.ones(1)

        def __call__(self, step):
            return float(self.scale) * (step + 1)

    engine = outcore.Engine(TinyGPT(), config(tmp_path), outcore.AdamW(**HP),
                            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, Ramp()))
    x, y = batches(1)[0]
    engine.backward(engine(x, y))
    engine.step()
    with pytest.raises(ValueError, match="LR scheduler's state_dict"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()
    engine.close()


def test_a_checkpoint_without_scheduler_state_resumes_at_its_lr_and_says_so(tmp_path, caplog):
    engine = outcore.Engine(TinyGPT(), config(tmp_path, "a"), outcore.AdamW(**HP))
    engine.lr = 5e-4
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    resumed = outcore.Engine(TinyGPT(), config(tmp_path, "b"), outcore.AdamW(**HP), lr_scheduler=cosine)
    with caplog.at_level(logging.WARNING, logger="outcore.runtime.lr_schedule"):
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.lr == 5e-4
    assert [r for r in caplog.records if "holds no LR scheduler state" in r.getMessage()]
    resumed.close()
