"""A Hugging Face model with two towers and no single input embedding (CLIP) under the engine:
`get_input_embeddings()` raises there, and `logit_scale` is a parameter of no dimensions."""

import torch
import transformers
from helpers import assert_losses_match, engine_kwargs_steps, plain_kwargs_steps

import outcore

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def save_clip(directory):
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64),
        projection_dim=16)
    torch.manual_seed(0)
    transformers.CLIPModel(cfg).save_pretrained(directory)
    return directory


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(2, 64, (2, 8), generator=g),
             "pixel_values": torch.randn(2, 3, 16, 16, generator=g), "return_loss": True} for _ in range(n)]


def test_clip_loads_its_weights_and_trains_as_plain_adamw(tmp_path):
    directory = save_clip(str(tmp_path / "clip"))
    data = batches(4)
    ref = transformers.CLIPModel.from_pretrained(directory)
    expected = plain_kwargs_steps(ref, data, HP)

    with outcore.deferred_init():
        model = transformers.CLIPModel(transformers.AutoConfig.from_pretrained(directory))
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                         grad_clip=None)
    engine = outcore.Engine(model, cfg, outcore.AdamW(**HP), weights=directory)
    assert_losses_match(engine_kwargs_steps(engine, data), expected)
    trained = engine.full_state_dict()
    assert trained["logit_scale"].shape == ()
    torch.testing.assert_close(trained["logit_scale"], ref.logit_scale.detach(), rtol=1e-5, atol=1e-6)
    engine.close()
