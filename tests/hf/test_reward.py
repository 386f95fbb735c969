"""TRL's RewardTrainer through outcore against the plain one, fp32, one rank: `model=` a causal LM's
directory builds the sequence classifier TRL builds (one label, its head drawn as from_pretrained
draws it), with LoRA (the head trained whole, as peft's SEQ_CLS task keeps it) and without."""

import random

import pytest
import torch
from trainer_setup import STORY, logged, nvme_config, trainer_args

from outcore.hf import outcore_trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def pairs(n: int = 24, seed: int = 0):
    words, rnd = STORY.split(), random.Random(seed)
    return datasets.Dataset.from_list([
        {"chosen": " ".join(rnd.choices(words, k=6)), "rejected": " ".join(rnd.choices(words, k=5))}
        for _ in range(n)])


def reward(cls, model_path, directory, *, with_peft, **extra):
    args = trainer_args(str(directory), cls=trl.RewardConfig, learning_rate=1e-2, max_length=32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    trainer = cls(model=model_path, args=args, train_dataset=pairs(),
                  processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                  **({"peft_config": lora} if with_peft else {}), **extra)
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("with_peft", [True, False], ids=["peft", "full"])
def test_reward_equals_plain_reward(tmp_path, model_path, with_peft):
    plain = reward(trl.RewardTrainer, model_path, tmp_path / "plain", with_peft=with_peft)
    ours = reward(outcore_trainer(trl.RewardTrainer), model_path, tmp_path / "ours", with_peft=with_peft,
                  outcore_config=nvme_config(str(tmp_path / "nvme")))
    for key in ("loss", "grad_norm", "accuracy", "margin"):
        want, got = logged(plain, key), logged(ours, key)
        assert len(got) == len(want) == 6
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert type(ours.model.get_base_model() if with_peft else ours.model).__name__ == "LlamaForSequenceClassification"
    # the trained model scores as plain's: the head and what was trained under it came out alike
    rows = transformers.AutoTokenizer.from_pretrained(model_path)(["a b c", "d e"], return_tensors="pt",
                                                                    padding=True)
    with torch.no_grad():
        want = plain.model(**rows).logits
        got = ours.model(**rows).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ours.save_model(str(tmp_path / "saved"))  # a reward model transformers loads, or its adapters and head for peft
    if with_peft:
        base = transformers.AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1)
        base.config.pad_token_id = plain.model.config.pad_token_id
        loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "saved"))
    else:
        loaded = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(**rows).logits, want, rtol=1e-5, atol=1e-6)
    ours.engine.close()
