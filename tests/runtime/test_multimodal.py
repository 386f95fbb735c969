"""A vision-language model (Llava: a CLIP vision tower, a projector, a Llama) under the engine. The
vision tower's buffers are computed by its own initialization (transformers runs the innermost
model's `_init_weights` on each module), and text-only fine-tuning leaves the tower as plain
AdamW leaves it: its parameters get no gradient, so they sit every update out."""

import pytest
import torch
import transformers
from helpers import assert_losses_match, engine_kwargs_steps, plain_kwargs_steps

import outcore

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def save_llava(directory):
    text = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    vision = transformers.CLIPVisionConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, intermediate_size=64)
    torch.manual_seed(0)
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=95)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_llava_builds_its_vision_buffers_and_text_only_training_equals_plain_adamw(tmp_path):
    directory = save_llava(str(tmp_path / "llava"))
    ref = transformers.LlavaForConditionalGeneration.from_pretrained(directory)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in (torch.randint(1, 90, (2, 10), generator=g) for _ in range(3))]
    expected = plain_kwargs_steps(ref, data, HP)

    with outcore.deferred_init():
        model = transformers.LlavaForConditionalGeneration(transformers.AutoConfig.from_pretrained(directory))
    cfg = outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                         grad_clip=None)
    engine = outcore.Engine(model, cfg, outcore.AdamW(**HP), weights=directory)
    tower = model.model.vision_tower.embeddings
    assert torch.equal(tower.position_ids, ref.model.vision_tower.embeddings.position_ids)
    assert_losses_match(engine_kwargs_steps(engine, data), expected)
    trained = engine.full_state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    engine.close()
