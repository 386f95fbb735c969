"""The lines a fine-tuning script ends with, on `trainer.model` after `trainer.train()`: the counts,
save_pretrained, merge_and_unload and generate answer as they do on the plain trainer's model."""

import os

import pytest
import torch
from trainer_setup import conversations, logged, nvme_config, trainer_args

from outcore.hf import outcore_trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")


def sft(cls, model_path, directory, with_peft, save_steps=None, **extra):
    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}
    args = trainer_args(str(directory), cls=trl.SFTConfig, learning_rate=1e-2, max_length=32, max_steps=3, **saving)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = cls(model=model_path, args=args, train_dataset=conversations(),
                  processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                  **({"peft_config": lora} if with_peft else {}), **extra)
    trainer.train()
    return trainer


@pytest.mark.parametrize("with_peft", [True, False], ids=["lora", "full"])
def test_the_script_ending_lines_answer_as_on_the_plain_model(tmp_path, model_path, capsys, with_peft):
    plain = sft(trl.SFTTrainer, model_path, tmp_path / "plain", with_peft)
    ours = sft(outcore_trainer(trl.SFTTrainer), model_path, tmp_path / "ours", with_peft,
               outcore_config=nvme_config(str(tmp_path / "nvme")))
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(plain)), rtol=1e-5, atol=0)
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        want = plain.model.generate(input_ids=x, max_new_tokens=6, do_sample=False)
        assert torch.equal(ours.model.generate(input_ids=x, max_new_tokens=6, do_sample=False), want)
    ours.model.save_pretrained(str(tmp_path / "saved"))
    ours.save_model(str(tmp_path / "by_save_model"))
    saved = sorted(f for f in os.listdir(tmp_path / "saved") if f != "training_args.bin")
    assert saved == sorted(f for f in os.listdir(tmp_path / "by_save_model") if f != "training_args.bin")
    if not with_peft:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
        with torch.no_grad():
            torch.testing.assert_close(loaded(x).logits, plain.model(x).logits, rtol=1e-5, atol=1e-5)
        ours.engine.close()
        return
    assert ours.model.get_nb_trainable_parameters() == plain.model.get_nb_trainable_parameters()
    capsys.readouterr()
    plain.model.print_trainable_parameters()
    theirs = capsys.readouterr().out
    ours.model.print_trainable_parameters()
    assert capsys.readouterr().out == theirs
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_path),
                                            str(tmp_path / "saved"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, plain.model(x).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="merge_adapters=True") as e:
        ours.model.merge_and_unload()
    assert "\n" not in str(e.value) and "outcore export" in str(e.value)
    with pytest.raises(ValueError, match="safe_serialization=False"):
        ours.model.save_pretrained(str(tmp_path / "other"), safe_serialization=False)
    ours.engine.close()


def test_a_lora_checkpoint_folder_holds_the_adapters_peft_loads(tmp_path, model_path):
    ours = sft(outcore_trainer(trl.SFTTrainer), model_path, tmp_path / "ours", True, save_steps=3,
               outcore_config=nvme_config(str(tmp_path / "nvme")))
    checkpoint = str(tmp_path / "ours" / "checkpoint-3")
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_path), checkpoint)
    x = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, ours.engine(input_ids=x).logits, rtol=1e-5, atol=1e-5)
    ours.engine.close()


def test_the_run_says_where_its_states_live_what_it_moved_and_that_dropout_differs(tmp_path, model_path, capfd):
    args = trainer_args(str(tmp_path / "ours"), cls=trl.SFTConfig, max_length=32, max_steps=2)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05,
                           task_type="CAUSAL_LM")
    ours = outcore_trainer(trl.SFTTrainer)(model=model_path, args=args, train_dataset=conversations(),
                                           processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                                           peft_config=lora, outcore_config=nvme_config(str(tmp_path / "nvme")))
    capfd.readouterr()
    ours.train()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("outcore:")]
    assert len(lines) == 3, lines
    assert "parameters on NVMe, optimizer states on NVMe; budgets" in lines[0]
    assert f"swap files in {tmp_path / 'nvme'}" in lines[0]
    assert "dropout masks (p=0.05)" in lines[1] and "not bit for bit" in lines[1]
    assert lines[2].startswith("outcore: 2 steps; in the tiers") and "written a step; peak RSS" in lines[2]
    ours.engine.close()
