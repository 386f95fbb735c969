import torch

import outcore
from outcore.tools.gpt import GPT, PRESETS, init_fn


def test_parameter_counts_match_the_formula():
    for name in ("tiny", "bench-134m"):
        cfg = PRESETS[name]
        with outcore.deferred_init():
            model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.params, name
    assert 130e6 < PRESETS["bench-134m"].params < 140e6


def test_tiny_gpt_learns_through_the_engine(tmp_path):
    cfg = PRESETS["tiny"]
    with outcore.deferred_init():
        model = GPT(cfg)
    engine = outcore.Engine(model, outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme",
                                                  nvme_dir=str(tmp_path)), outcore.AdamW(lr=3e-3),
                            init_fn=init_fn(cfg))
    tokens = torch.randint(0, 16, (4, 33), generator=torch.Generator().manual_seed(0))  # a small alphabet
    losses = []
    for _ in range(15):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.7
    engine.close()
