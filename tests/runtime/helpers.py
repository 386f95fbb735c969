"""Train the same model with plain PyTorch and with the engine, for parity checks."""

from __future__ import annotations

import copy

import torch

import outcore

HP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def train_plain(model, data, *, clip=None, accum=1):
    opt = torch.optim.AdamW(model.parameters(), **HP)
    losses = []
    for i in range(0, len(data), accum):
        opt.zero_grad()
        total = 0.0
        for x, y in data[i : i + accum]:
            loss = model(x, y)
            (loss / accum).backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total / accum)
    return losses


def train_engine(model, config, data, *, accum=1, engine=None, plain_backward=False):
    """`plain_backward`: `loss.backward()`, as in a plain PyTorch loop, in place of `engine.backward(loss)`."""
    engine = engine or outcore.Engine(model, config, outcore.AdamW(**HP))
    losses = []
    for i in range(0, len(data), accum):
        total = 0.0
        for x, y in data[i : i + accum]:
            loss = engine(x, y)
            loss.backward() if plain_backward else engine.backward(loss)
            total += loss.item()
            stats = engine.step()
        assert not stats["accumulating"]
        losses.append(total / accum)
    return losses, engine


def twins(factory):
    torch.manual_seed(0)
    model = factory()
    return model, copy.deepcopy(model)


def assert_losses_match(ours, ref, rel=1e-5):
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert abs(a - b) <= rel * abs(b), f"step {i}: engine {a} vs PyTorch {b}"


def assert_same_weights(a, b, tol=1e-5):
    """The final weights of two engines, element by element. An absolute floor as large as the
    relative tolerance: gradients summed in another order differ in the last bit, and AdamW's second
    step magnifies that wherever two steps' gradients nearly cancel in the first moment."""
    sa, sb = a.full_state_dict(), b.full_state_dict()
    for k, v in sa.items():
        torch.testing.assert_close(sb[k], v, rtol=tol, atol=tol, msg=k)


def plain_kwargs_steps(model, batches, hp=HP):
    """Losses of plain torch.optim.AdamW steps (of the trainable parameters), one per batch of
    keyword arguments, for a model that returns an object with `.loss` (Hugging Face)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **hp)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def engine_kwargs_steps(engine, batches):
    """Losses of the engine's steps, one per batch of keyword arguments (see `plain_kwargs_steps`)."""
    losses = []
    for batch in batches:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


class InBackward(torch.autograd.Function):
    """The identity in forward; in backward, what `effect` makes of the gradient (it may raise)."""

    @staticmethod
    def forward(ctx, x, effect):
        ctx.effect = effect
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.effect(grad), None


def raising(error: BaseException):
    """An `InBackward` effect that raises `error`."""
    def effect(_grad):
        raise error
    return effect
