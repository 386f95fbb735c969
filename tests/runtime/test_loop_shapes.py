"""The shapes of training loop users write, each trained against plain PyTorch: `loss.backward()`
in place of `engine.backward(loss)`, reentrant checkpointing, a module run twice in one forward,
two forwards before one backward, a forward whose output never has a backward."""

import logging

import pytest
import torch
from helpers import HP, assert_losses_match, train_engine, train_plain, twins
from models import TinyGPT, batches
from torch.utils.checkpoint import checkpoint

import outcore


class ReentrantCheckpoints(TinyGPT):
    """Blocks under torch's reentrant checkpoint: forward without grad, and in backward a nested
    autograd pass per block over its recomputed forward."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True) if self.checkpointing else b(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@pytest.mark.parametrize("plain_backward", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_reentrant_checkpointing_trains_as_plain_pytorch(tmp_path, plain_backward, clip):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip)
    ours_model, ref_model = twins(lambda: ReentrantCheckpoints(checkpointing=True))
    ref_model.checkpointing = False
    data = batches(4)
    ours, engine = train_engine(ours_model, cfg, data, plain_backward=plain_backward)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.parametrize("stage, offload, clip, accum, checkpointing", [(3, "nvme", None, 1, False),
                                                                      (3, "nvme", 1.0, 2, True),
                                                                      (2, "cpu", 1.0, 1, False)])
def test_a_plain_loss_backward_trains_as_engine_backward_does(tmp_path, stage, offload, clip, accum, checkpointing):
    cfg = outcore.Config(stage=stage, offload_params=offload if stage == 3 else "none", offload_optimizer=offload,
                         nvme_dir=str(tmp_path), grad_clip=clip, grad_accumulation=accum)
    ours_model, ref_model = twins(lambda: TinyGPT(checkpointing=checkpointing))
    ref_model.checkpointing = False
    data = batches(6)
    ours, engine = train_engine(ours_model, cfg, data, accum=accum, plain_backward=True)
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip, accum=accum))
    assert engine.global_step == 6 // accum
    engine.close()


class RunsBlockZeroTwice(TinyGPT):
    """Block 0 runs again after the last block: its gradient comes in two parts."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in [*self.blocks, self.blocks[0]]:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


SEVERAL_USES = [dict(stage=3, offload_params="nvme", offload_optimizer="nvme"),  # updates behind backward
                dict(stage=3, offload_params="nvme", offload_optimizer="nvme", grad_clip=1.0),
                dict(stage=3),  # one fused update from gradients kept in memory
                dict(stage=2, offload_optimizer="cpu", grad_clip=1.0)]


@pytest.mark.parametrize("cfg", SEVERAL_USES)
def test_a_module_run_twice_in_one_forward_gets_both_parts_of_its_gradient(tmp_path, cfg):
    ours_model, ref_model = twins(lambda: RunsBlockZeroTwice(tied=False))
    data = batches(4)
    ours, engine = train_engine(ours_model, outcore.Config(nvme_dir=str(tmp_path), **cfg), data)
    assert_losses_match(ours, train_plain(ref_model, data, clip=cfg.get("grad_clip")))
    engine.close()


def train_two_forwards(step, model_or_engine, data):
    """Each step: two forwards, one backward of their sum (a contrastive or preference loss)."""
    losses = []
    for (x1, y1), (x2, y2) in zip(data[::2], data[1::2], strict=True):
        loss = model_or_engine(x1, y1) + model_or_engine(x2, y2)
        step(loss)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SEVERAL_USES)
def test_two_forwards_before_one_backward_train_as_plain_pytorch(tmp_path, cfg):
    ours_model, ref_model = twins(lambda: TinyGPT(tied=False))
    data = batches(8)
    engine = outcore.Engine(ours_model, outcore.Config(nvme_dir=str(tmp_path), **cfg), outcore.AdamW(**HP))
    ours = train_two_forwards(lambda loss: (engine.backward(loss), engine.step()), engine, data)
    opt = torch.optim.AdamW(ref_model.parameters(), **HP)

    def plain_step(loss):
        opt.zero_grad()
        loss.backward()
        if cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), cfg["grad_clip"])
        opt.step()

    assert_losses_match(ours, train_two_forwards(plain_step, ref_model, data))
    engine.close()


def test_a_forward_whose_output_has_no_backward_leaves_the_next_step_exact(tmp_path, caplog):
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path))
    ours_model, ref_model = twins(lambda: TinyGPT(tied=False))
    data = batches(4)
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    ours = []
    with caplog.at_level(logging.INFO, logger="outcore.runtime.gradient_path"):
        for x, y in data:
            engine(x, y)  # in grad mode, never backward: its units count one more run than they get gradients
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            ours.append(loss.item())
    assert_losses_match(ours, train_plain(ref_model, data))
    said = [r.message for r in caplog.records if "its update waited for the end of backward" in r.message]
    assert len(said) == 1 and "ran 2 times in forward and got 1 gradients" in said[0]
    engine.close()


@pytest.mark.parametrize("plain_backward", [False, True])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_backward_beyond_the_accumulation_window_is_refused_and_the_step_stays_exact(tmp_path, clip,
                                                                                       plain_backward):
    """Two backward passes before step() with grad_accumulation=1: the second was summed into a
    gradient whose norm was already taken (clipping by the first pass's norm), or, with updates in
    backward, crashed on a gradient the update had spent. It is refused before any of it lands, and
    step() then applies the first pass's gradient as a plain loop of one backward per step would."""
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path),
                         grad_clip=clip)
    ours_model, ref_model = twins(lambda: TinyGPT(tied=False))
    data = batches(3)
    engine = outcore.Engine(ours_model, cfg, outcore.AdamW(**HP))
    ours = []
    for x, y in data:
        loss = engine(x, y)
        engine.backward(loss)
        extra = engine(y, x)
        with pytest.raises(RuntimeError, match=r"beyond grad_accumulation=1 before step\(\).*engine\.step\(\) first"):
            extra.backward() if plain_backward else engine.backward(extra)
        engine.step()
        ours.append(loss.item())
    assert_losses_match(ours, train_plain(ref_model, data, clip=clip))
    engine.close()


@pytest.mark.parametrize("cfg", SEVERAL_USES)
def test_a_second_backward_through_one_forward_is_refused_where_units_are_let_go(tmp_path, cfg):
    """`loss.backward(retain_graph=True)` twice: where parameters stay whole and updates wait for
    step(), the two passes sum as in plain PyTorch; where the engine lets units go after the first
    pass (ZeRO-3 offload) or updates them in it, the second was a bare setStorage error from deep in
    autograd, and is now refused by name before it runs. Either way the run goes on exactly."""
    ours_model, ref_model = twins(lambda: TinyGPT(tied=False))
    data = batches(3)
    engine = outcore.Engine(ours_model, outcore.Config(nvme_dir=str(tmp_path), **cfg), outcore.AdamW(**HP))
    refused = not engine.policy.resident or engine.policy.overlapped
    opt = torch.optim.AdamW(ref_model.parameters(), **HP)
    ours, ref = [], []
    for x, y in data:
        loss = engine(x, y)
        loss.backward(retain_graph=True)
        if refused:
            with pytest.raises(RuntimeError, match=r"second backward through the same forward.*Sum the losses"):
                loss.backward()
        else:
            loss.backward()
        engine.step()
        ours.append(loss.item())
        opt.zero_grad()
        plain = ref_model(x, y)
        plain.backward(retain_graph=True)
        if not refused:
            plain.backward()
        if cfg.get("grad_clip"):
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), cfg["grad_clip"])
        opt.step()
        ref.append(plain.item())
    assert_losses_match(ours, ref)
    assert refused == (cfg.get("offload_params") == "nvme")  # the configurations above: both kinds ran
    engine.close()


class SharesAnMLP(TinyGPT):
    """Layers 0 and 2 share one MLP module, registered in both blocks."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.blocks[2].mlp = self.blocks[0].mlp


@pytest.mark.parametrize("cfg", SEVERAL_USES[:2])
def test_blocks_sharing_a_submodule_train_as_plain_pytorch(tmp_path, cfg):
    """The shared module read its weight while its unit (the second block) was released: a
    ReleasedParameterError in the first forward. The root unit owns it now, as a tied weight."""
    ours_model, ref_model = twins(lambda: SharesAnMLP(tied=False))
    data = batches(4)
    losses, engine = train_engine(ours_model, outcore.Config(nvme_dir=str(tmp_path), **cfg), data)
    assert_losses_match(losses, train_plain(ref_model, data, clip=cfg.get("grad_clip")))
    state = engine.full_state_dict()
    assert torch.equal(state["blocks.0.mlp.0.weight"], state["blocks.2.mlp.0.weight"])
    torch.testing.assert_close(state["blocks.2.mlp.0.weight"], ref_model.blocks[2].mlp[0].weight, rtol=1e-4,
                               atol=1e-5)
    engine.close()
