"""runtime/tiled.py: a module over tiles of the sequence equals the untiled module in output and in
every gradient (1e-6 relative in fp32), with frozen parameters among them, and holds one tile's
intermediates at a time."""

import pytest
import torch
from torch import nn

from outcore.runtime.tiled import tiled


class GatedMLP(nn.Module):
    """A Llama block's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int = 16, inner: int = 40) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(width, inner, bias=False), nn.Linear(width, inner, bias=False), \
            nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def _compare(mlp, tile, frozen=()):
    torch.manual_seed(0)
    for name in frozen:
        getattr(mlp, name).weight.requires_grad_(False)
    x = torch.randn(2, 23, 16, requires_grad=True)
    weights = torch.randn(2, 23, 16)
    trained = [p for p in mlp.parameters() if p.requires_grad]
    want = mlp(x)
    got = tiled(mlp, x, tile)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    w = torch.autograd.grad((want * weights).sum(), [x, *trained])
    g = torch.autograd.grad((got * weights).sum(), [x, *trained])
    for a, b in zip(g, w, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tile", [1, 5, 22, 23, 64])
def test_a_tiled_mlp_equals_the_untiled_one(tile):
    _compare(GatedMLP(), tile)


def test_frozen_parameters_get_no_gradient_and_the_rest_theirs():
    _compare(GatedMLP(), 4, frozen=("gate", "down"))


def test_a_tile_holds_one_tile_s_intermediates():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 3:  # activations; the weights' gradients are 2-D
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    mlp = GatedMLP(width=8, inner=400)
    x = torch.randn(1, 1000, 8, requires_grad=True)
    with Largest():
        tiled(mlp, x, 50).sum().backward()
    assert Largest.numel <= 50 * 400 < 1000 * 400  # the whole sequence's intermediates: 400,000


class Block(nn.Module):
    def __init__(self, tile: int | None) -> None:
        super().__init__()
        self.norm, self.mlp, self.tile = nn.LayerNorm(16), GatedMLP(), tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.mlp(h) if self.tile is None else tiled(self.mlp, h, self.tile))


class Stack(nn.Module):
    def __init__(self, tile: int | None, checkpointed: bool) -> None:
        super().__init__()
        self.blocks, self.checkpointed = nn.ModuleList(Block(tile) for _ in range(3)), checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x


@pytest.mark.parametrize("offload, checkpointed", [("none", False), ("nvme", False), ("nvme", True)])
def test_tiled_blocks_train_under_the_engine_as_untiled_ones_in_plain_pytorch(tmp_path, offload, checkpointed):
    import outcore

    def model(tile):
        torch.manual_seed(0)
        return Stack(tile, checkpointed and tile is not None)

    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    plain = model(None)
    opt = torch.optim.AdamW(plain.parameters(), **hp)
    config = outcore.Config(stage=3, offload_params=offload, offload_optimizer=offload, nvme_dir=str(tmp_path / "n"),
                            grad_clip=None)
    engine = outcore.Engine(model(5), config, outcore.AdamW(**hp))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 17, 16, generator=g)
        want = plain(x).pow(2).mean()
        opt.zero_grad()
        want.backward()
        opt.step()
        got = engine(x).pow(2).mean()
        engine.backward(got)
        engine.step()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    engine.close()


def test_a_tile_below_one_position_is_refused():
    with pytest.raises(ValueError, match="tile=0"):
        tiled(GatedMLP(), torch.randn(1, 4, 16), 0)
