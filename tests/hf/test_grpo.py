"""TRL's GRPOTrainer and RLOOTrainer through outcore against the plain ones, fp32, one rank: completions generated
through the engine (`generate` on the engine's model), seeded alike, give the same completions,
rewards, KL and loss; without peft the KL's reference is read in place, nothing of it in a swap file."""

import random

import pytest
import torch
from trainer_setup import STORY, logged, nvme_config, trainer_args

from outcore.hf import outcore_trainer
from outcore.hf.generation import kv_bytes, kv_width
from outcore.runtime.sizes import human_bytes

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def prompts(n: int = 16, seed: int = 0):
    words, rnd = STORY.split(), random.Random(seed)
    return datasets.Dataset.from_list([{"prompt": " ".join(rnd.choices(words, k=4))} for _ in range(n)])


def length(completions, **_):
    return [float(len(c)) for c in completions]


def grpo(cls, model_path, directory, *, with_peft, **extra):
    config = trl.RLOOConfig if "RLOO" in cls.__name__ else trl.GRPOConfig
    args = trainer_args(str(directory), cls=config, learning_rate=1e-2, max_steps=3, warmup_steps=0,
                        num_generations=2, max_completion_length=6, beta=0.04)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = cls(model_path, length, args, train_dataset=prompts(),
                  processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                  **({"peft_config": lora} if with_peft else {}), **extra)
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("with_peft", [True, False], ids=["peft", "full"])
@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
def test_grpo_and_rloo_equal_the_plain_trainers(tmp_path, model_path, name, with_peft, capfd):
    trainer = getattr(trl, f"{name}Trainer")
    plain = grpo(trainer, model_path, tmp_path / "plain", with_peft=with_peft)
    capfd.readouterr()
    ours = grpo(outcore_trainer(trainer), model_path, tmp_path / "ours", with_peft=with_peft,
                outcore_config=nvme_config(str(tmp_path / "nvme")))
    said = capfd.readouterr().err
    assert said.count("completions are generated through the engine") == 1
    for key in ("loss", "reward", "reward_std", "kl", "grad_norm", "completions/mean_length", "num_tokens"):
        want, got = logged(plain, key), logged(ours, key)
        assert len(got) == len(want) == 3
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    assert list(ours._logs["completion"]) == list(plain._logs["completion"])  # the last steps' completions
    assert any(k > 0 for k in logged(ours, "kl"))  # the policy moved away from its reference
    assert (ours.reference is None) == with_peft
    if ours.reference is not None:
        assert all(u.frozen and u.in_place is not None for u in ours.reference.units)
        assert ours.reference.stats()["nvme"]["file_bytes"] == 0  # no second copy of the weights
        ours.reference.close()
    ours.engine.close()


@pytest.mark.parametrize("setting", ["use_vllm", "sync_ref_model"])
def test_what_would_copy_the_weights_out_of_the_tiers_is_refused(tmp_path, model_path, setting):
    args = trainer_args(str(tmp_path / "run"), cls=trl.GRPOConfig, num_generations=2, beta=0.04,
                        **{setting: True})
    with pytest.raises(ValueError, match=setting) as e:
        outcore_trainer(trl.GRPOTrainer)(model=model_path, reward_funcs=length, args=args, train_dataset=prompts(),
                                         outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "nvme").exists()


def test_each_generation_batch_is_one_generate_call_through_a_cycle_of_passes(tmp_path, model_path, monkeypatch,
                                                                                capfd):
    """All the completions of a generation batch (prompts x num_generations) come from one `generate`
    call, whose decoding passes keep the units that fit gathered ([Note: forward cycles])."""
    calls = []
    generate = transformers.GenerationMixin.generate

    def counted(model, *args, **kwargs):
        out = generate(model, *args, **kwargs)
        cycle = trainer_box[0].engine.lifecycle.cycle if trainer_box else None
        calls.append((out.shape[0], cycle is not None and cycle.plan is not None and bool(cycle.held)))
        return out

    trainer_box = []
    monkeypatch.setattr(transformers.GenerationMixin, "generate", counted)
    args = trainer_args(str(tmp_path / "run"), cls=trl.GRPOConfig, learning_rate=1e-2, max_steps=2, warmup_steps=0,
                        num_generations=2, max_completion_length=6, beta=0.0, gradient_accumulation_steps=2)
    trainer = outcore_trainer(trl.GRPOTrainer)(model_path, length, args, train_dataset=prompts(),
                                               processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                                               outcore_config=nvme_config(str(tmp_path / "nvme")))
    trainer_box.append(trainer)
    trainer.train()
    batch = args.generation_batch_size
    config = trainer.engine.model.config
    cache = batch * kv_bytes(layers=config.num_hidden_layers, width=kv_width(config), tokens=6, dtype="fp32")
    said = capfd.readouterr().err
    assert "a new token reads nothing" in said  # the default budgets hold this model
    assert f"a generation batch of {batch} sequences keeps a KV cache of {human_bytes(cache)}" in said
    assert batch == args.per_device_train_batch_size * args.steps_per_generation
    assert calls == [(batch, True)] * 2  # one call a generation batch, each step's completions at once
    assert not trainer.engine.lifecycle.cycle.held  # training let them go
    trainer.engine.close()
