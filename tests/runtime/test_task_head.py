"""A task head over another architecture's files: a sequence classifier (a reward model) from a
causal LM's weights, as `AutoModelForSequenceClassification.from_pretrained` makes it. The head the
files lack starts as transformers initializes it and the stored head it has no place for is left
out, each said once; inside the base model a missing or unexpected tensor is still an error."""

import logging
import os
import subprocess

import peft
import pytest
import torch
import transformers
from hf_models import VOCAB, save_model
from launch import torchrun
from safetensors.torch import load_file, save_file
from test_multirank import HERE

import outcore

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LABELS = 3
LORA = dict(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])  # peft trains `score` whole


def classifier(directory: str, lora: bool = False) -> torch.nn.Module:
    """The causal LM of `directory` as a sequence classifier, built under deferred_init()."""
    cfg = transformers.AutoConfig.from_pretrained(directory, num_labels=LABELS, pad_token_id=0)
    with outcore.deferred_init():
        model = transformers.AutoModelForSequenceClassification.from_config(cfg)
        return peft.get_peft_model(model, peft.LoraConfig(**LORA)) if lora else model


def nvme_config(tmp_path) -> outcore.Config:
    return outcore.Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir=str(tmp_path / "nvme"),
                          grad_clip=None)


def labelled(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, VOCAB, (2, 10), generator=g),
             "labels": torch.randint(0, LABELS, (2,), generator=g)} for _ in range(n)]


def train_beside(engine: outcore.Engine, plain: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], **HP)
    for batch in labelled(4):
        ref = plain(**batch).loss
        ref.backward()
        opt.step()
        opt.zero_grad()
        ours = engine(**batch).loss
        engine.backward(ours)
        engine.step()
        assert abs(ours.item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_a_classifier_on_causal_lm_files_starts_as_from_pretrained_trains_alike_and_exports_itself(tmp_path, caplog):
    directory = save_model("llama", str(tmp_path / "lm"))
    with caplog.at_level(logging.WARNING, logger="outcore.runtime.pretrained"):
        engine = outcore.Engine(classifier(directory), nvme_config(tmp_path), outcore.AdamW(**HP), weights=directory)
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "score.weight is not in it" in m]) == 1
    assert len([m for m in said if "lm_head.weight of the stored LlamaForCausalLM" in m]) == 1
    start = engine.full_state_dict()
    # transformers' normal(0, initializer_range), not nn.Linear's own uniform (std 0.10 at 32 inputs)
    assert 0.012 < float(start["score.weight"].std()) < 0.03

    plain = transformers.AutoModelForSequenceClassification.from_pretrained(directory, num_labels=LABELS,
                                                                            pad_token_id=0)
    with torch.no_grad():
        plain.score.weight.copy_(start["score.weight"])
    assert start.keys() == plain.state_dict().keys()
    for name, value in plain.state_dict().items():
        assert torch.equal(start[name], value), name  # the base model is the files' own
    train_beside(engine, plain)

    engine.export(str(tmp_path / "out"))
    back = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out"))
    assert back.config.architectures == ["LlamaForSequenceClassification"]
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(back.state_dict()[name], value, rtol=1e-6, atol=1e-7, msg=name)
    engine.close()


def test_peft_trains_the_new_head_whole_from_one_start_and_its_adapter_loads_in_peft(tmp_path):
    directory = save_model("llama", str(tmp_path / "lm"))
    engine = outcore.Engine(classifier(directory, lora=True), nvme_config(tmp_path), outcore.AdamW(**HP),
                            weights=directory)
    start = engine.full_state_dict()
    head = start["base_model.model.score.original_module.weight"]
    assert torch.equal(start["base_model.model.score.modules_to_save.default.weight"], head)  # peft's copy

    base = transformers.AutoModelForSequenceClassification.from_pretrained(directory, num_labels=LABELS, pad_token_id=0)
    with torch.no_grad():
        base.score.weight.copy_(head)
    plain = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    plain.load_state_dict(start)  # the factors A peft drew at random
    train_beside(engine, plain)

    engine.export(str(tmp_path / "adapter"), adapters_only=True)
    fresh = transformers.AutoModelForSequenceClassification.from_pretrained(directory, num_labels=LABELS,
                                                                            pad_token_id=0)
    back = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    x = labelled(1)[0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=x).logits, plain.eval()(input_ids=x).logits, rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize(("damage", "message"), [
    ("body tensor missing", "have no tensor 'model.layers.0.mlp.up_proj.weight'"),
    ("unknown tensor in the body", "holds 'model.extra.weight', which is not in the model"),
])
def test_inside_the_base_model_the_files_must_still_match(tmp_path, damage, message):
    directory = save_model("llama", str(tmp_path / "lm"))
    weights = os.path.join(directory, "model.safetensors")
    state = load_file(weights)
    if damage == "body tensor missing":
        del state["model.layers.0.mlp.up_proj.weight"]
    else:
        state["model.extra.weight"] = torch.zeros(3)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        outcore.Engine(classifier(directory), nvme_config(tmp_path), weights=directory)
    assert not (tmp_path / "nvme").exists()


def test_the_same_architecture_missing_its_head_is_still_an_error(tmp_path):
    directory = save_model("llama", str(tmp_path / "lm"))
    weights = os.path.join(directory, "model.safetensors")
    state = load_file(weights)
    del state["lm_head.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with outcore.deferred_init():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    with pytest.raises(ValueError, match="have no tensor 'lm_head.weight'"):
        outcore.Engine(model, nvme_config(tmp_path), weights=directory)


@pytest.mark.slow
def test_two_ranks_draw_the_same_new_head_as_one(tmp_path):
    directory = save_model("llama", str(tmp_path / "lm"))
    out = str(tmp_path / "two.pt")
    cmd = [*torchrun(2, tmp_path), os.path.join(HERE, "dist_task_head.py"), directory, out, str(tmp_path / "nvme2")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    two = torch.load(out, weights_only=True)
    one = outcore.Engine(classifier(directory), nvme_config(tmp_path), weights=directory)
    expected = one.full_state_dict()
    assert two.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(two[name], value), name
    one.close()


def test_a_head_built_with_values_keeps_them_and_is_not_called_new(tmp_path, caplog):
    directory = save_model("llama", str(tmp_path / "lm"))
    model = classifier(directory)
    torch.manual_seed(7)
    model.score = torch.nn.Linear(model.config.hidden_size, LABELS, bias=False)  # the caller's own start
    mine = model.score.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="outcore.runtime.pretrained"):
        engine = outcore.Engine(model, nvme_config(tmp_path), weights=directory)
    assert torch.equal(engine.full_state_dict()["score.weight"], mine)
    assert not [r for r in caplog.records if "is not in it" in r.getMessage()]
    engine.close()
