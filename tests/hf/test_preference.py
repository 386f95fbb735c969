"""TRL's preference trainers through outcore against the plain ones, fp32, one rank: DPO and KTO with peft
(the reference is the base with the adapters off) and without (a frozen reference read in place,
nothing of it in a swap file), DPO's reference log-probs computed ahead or at each step; ORPO and
CPO (trl.experimental), which need no reference."""

import random

import pytest
import torch
from trainer_setup import STORY, logged, nvme_config, trainer_args

from outcore.hf import outcore_trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def preferences(n: int = 24, seed: int = 0):
    words, rnd = STORY.split(), random.Random(seed)
    return datasets.Dataset.from_list([
        {"prompt": " ".join(rnd.choices(words, k=5)), "chosen": " " + " ".join(rnd.choices(words, k=3)),
         "rejected": " " + " ".join(rnd.choices(words, k=4))} for _ in range(n)])


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def dpo(cls, model_path, directory, *, with_peft, positional=False, **extra):
    args = trainer_args(str(directory), cls=trl.DPOConfig, learning_rate=1e-2, max_length=32,
                        precompute_ref_log_probs=extra.pop("precompute", False))
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    given = dict(train_dataset=preferences(), processing_class=tok, **extra,
                 **({"peft_config": lora()} if with_peft else {}))
    # DPOTrainer(model, ref_model, args, ...): its second positional parameter is the reference
    trainer = cls(model_path, None, args, **given) if positional else cls(model=model_path, args=args, **given)
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("with_peft, precompute", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["peft", "full", "peft-precomputed", "full-precomputed"])
def test_dpo_equals_plain_dpo(tmp_path, model_path, with_peft, precompute):
    plain = dpo(trl.DPOTrainer, model_path, tmp_path / "plain", with_peft=with_peft, precompute=precompute)
    ours = dpo(outcore_trainer(trl.DPOTrainer), model_path, tmp_path / "ours", with_peft=with_peft,
               positional=True, precompute=precompute, outcore_config=nvme_config(str(tmp_path / "nvme")))
    for key in ("loss", "rewards/chosen", "rewards/rejected", "grad_norm"):
        want, got = logged(plain, key), logged(ours, key)
        assert len(got) == len(want) == 6
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    assert any(abs(r) > 1e-4 for r in logged(ours, "rewards/chosen"))  # the policy moved from its reference
    if with_peft:
        assert "ref" not in ours.model.peft_config and ours.reference is None
    elif precompute:
        assert ours.reference is None  # the policy itself before its first step
    else:
        assert ours.reference is not None
        assert all(u.frozen and u.in_place is not None for u in ours.reference.units)
        assert ours.reference.stats()["nvme"]["file_bytes"] == 0  # no second copy of the weights
        ours.reference.close()
    ours.engine.close()


def test_a_peft_model_given_to_dpo_is_refused_in_one_line(tmp_path, model_path):
    import outcore

    with outcore.deferred_init():
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_path))
    wrapped = peft.get_peft_model(base, lora())
    args = trainer_args(str(tmp_path / "run"), cls=trl.DPOConfig, max_length=32)
    with pytest.raises(ValueError, match="peft_config=") as e:
        outcore_trainer(trl.DPOTrainer)(model=wrapped, args=args, train_dataset=preferences(),
                                        processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                                        outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert "\n" not in str(e.value)


def kto_rows(n: int = 24, seed: int = 0):
    words, rnd = STORY.split(), random.Random(seed)
    return datasets.Dataset.from_list([
        {"prompt": " ".join(rnd.choices(words, k=5)), "completion": " " + " ".join(rnd.choices(words, k=3)),
         "label": i % 2 == 0} for i in range(n)])


@pytest.mark.slow
@pytest.mark.parametrize("with_peft", [True, False], ids=["peft", "full"])
def test_kto_equals_plain_kto(tmp_path, model_path, with_peft):
    def run(cls, name, **extra):
        args = trainer_args(str(tmp_path / name), cls=trl.KTOConfig, learning_rate=1e-2, max_length=32)
        trainer = cls(model=model_path, args=args, train_dataset=kto_rows(),
                      processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                      **({"peft_config": lora()} if with_peft else {}), **extra)
        trainer.train()
        return trainer

    plain = run(trl.KTOTrainer, "plain")
    ours = run(outcore_trainer(trl.KTOTrainer), "ours", outcore_config=nvme_config(str(tmp_path / "nvme")))
    for key in ("loss", "grad_norm"):
        want, got = logged(plain, key), logged(ours, key)
        assert len(got) == len(want) == 6
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    assert (ours.reference is None) == with_peft
    if ours.reference is not None:
        assert ours.reference.stats()["nvme"]["file_bytes"] == 0
        ours.reference.close()
    ours.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_orpo_and_cpo_equal_the_plain_trainers(tmp_path, model_path, name):
    import importlib

    module = importlib.import_module(f"trl.experimental.{name}")
    trainer_cls, config_cls = (getattr(module, f"{name.upper()}Trainer"), getattr(module, f"{name.upper()}Config"))

    def run(cls, directory, **extra):
        args = trainer_args(str(tmp_path / directory), cls=config_cls, learning_rate=1e-2, max_length=32)
        trainer = cls(model=model_path, args=args, train_dataset=preferences(),
                      processing_class=transformers.AutoTokenizer.from_pretrained(model_path), peft_config=lora(),
                      **extra)
        trainer.train()
        return trainer

    plain = run(trainer_cls, "plain")
    ours = run(outcore_trainer(trainer_cls), "ours", outcore_config=nvme_config(str(tmp_path / "nvme")))
    for key in ("loss", "grad_norm"):
        want, got = logged(plain, key), logged(ours, key)
        assert len(got) == len(want) == 6
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-7)
    ours.engine.close()
