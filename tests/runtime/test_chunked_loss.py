"""runtime/chunked_loss.py against the loss computed on the whole logits: value and gradients equal
(1e-6 relative in fp32) with ignored labels, a given normalizer (`num_items_in_batch`), soft-capping
and a head tied to the embedding; per-token log-probabilities likewise; and the peak memory of a
chunked backward bounded by a chunk's logits, not the whole."""

import pytest
import torch
import torch.nn.functional as F

from outcore.runtime.chunked_loss import IGNORE, chunked_cross_entropy, chunked_log_probs


def _inputs(n=37, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = IGNORE
    return hidden, weight, labels


def _whole(hidden, weight, labels, cap=None, normalizer=None):
    logits = (hidden @ weight.t()).float()
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return total / (normalizer if normalizer is not None else (labels != IGNORE).sum())


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
@pytest.mark.parametrize("cap, normalizer", [(None, None), (30.0, None), (None, 123.0), (5.0, 7.0)],
                         ids=["plain", "softcap", "num_items", "both"])
def test_the_chunked_loss_equals_the_whole_one(chunk, cap, normalizer):
    hidden, weight, labels = _inputs()
    want = _whole(hidden, weight, labels, cap, normalizer)
    got = chunked_cross_entropy(hidden, weight, labels, chunk=chunk, cap=cap, normalizer=normalizer)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for g, w in zip(_grads(got, hidden, weight), _grads(want, hidden, weight), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_a_tied_head_gets_both_gradients():
    g = torch.Generator().manual_seed(1)
    embedding = torch.nn.Embedding(50, 16)
    ids = torch.randint(0, 50, (2, 10), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1).reshape(-1)

    def loss(chunked):
        hidden = torch.tanh(embedding(ids)).reshape(-1, 16)
        if chunked:
            return chunked_cross_entropy(hidden, embedding.weight, labels, chunk=3)
        return _whole(hidden, embedding.weight, labels)

    want = torch.autograd.grad(loss(False), embedding.weight)[0]
    got = torch.autograd.grad(loss(True), embedding.weight)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cap", [None, 20.0])
def test_per_token_log_probs_equal_the_whole_log_softmax(cap):
    hidden, weight, labels = _inputs(seed=2)
    logits = (hidden @ weight.t()).float()
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    want = logits.log_softmax(-1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * (labels != IGNORE)
    got = chunked_log_probs(hidden, weight, labels, chunk=6, cap=cap)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    weights = torch.linspace(-1, 1, labels.shape[0])  # a sequence sum of any shape
    for g, w in zip(_grads((got * weights).sum(), hidden, weight), _grads((want * weights).sum(), hidden, weight),
                    strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_bf16_hidden_states_compute_the_loss_in_fp32():
    hidden, weight, labels = _inputs(seed=3)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    got = chunked_cross_entropy(h16, w16, labels, chunk=5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _whole(h16, w16, labels), rtol=1e-6, atol=0)
    gh, gw = _grads(got, h16, w16)
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16


def test_no_tensor_of_the_whole_logits_is_made():
    """Every tensor the forward and backward make is at most a chunk of logits (or the inputs' size):
    a dispatch mode sees each operation's output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    hidden, weight, labels = _inputs(n=4096, h=16, v=1000)
    with Largest():
        loss = chunked_cross_entropy(hidden, weight, labels, chunk=64)
        loss.backward()
    assert Largest.numel <= 64 * 1000 + 4096 * 16 < 4096 * 1000 // 10  # the whole logits: 4,096,000


def test_a_chunk_below_one_token_is_refused():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk=0: a chunk is at least one token"):
        chunked_cross_entropy(hidden, weight, labels, chunk=0)
