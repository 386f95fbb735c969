"""Round 4, item 5 (a DPO reference of another vocabulary) and the small ones on TRL's inputs: a
dataset without a column its trainer reads is refused as the trainer is built, naming the dataset,
the column and what its first row holds; a GRPO step whose reward functions gave no completion a
reward is refused naming them, and one function that gave none is said once."""

import logging

import pytest
import torch
from trainer_setup import STORY, model_dir, nvme_config, trainer_args

from outcore.hf import outcore_trainer

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

WORDS = STORY.split()


def rows(**columns):
    return datasets.Dataset.from_list([{k: " ".join(WORDS[i : i + 3]) for k in columns} for i in range(8)])


@pytest.mark.parametrize("name, dataset, said", [
    ("DPO", rows(prompt=1, chosen=1), "DPOTrainer: train_dataset has no 'rejected' column (its first row holds "
     "prompt, chosen); DPOTrainer reads 'chosen', 'rejected'"),
    ("Reward", rows(text=1), "RewardTrainer: train_dataset has no 'chosen' column (its first row holds text)"),
    ("KTO", rows(prompt=1, completion=1), "KTOTrainer: train_dataset has no 'label' column"),
    ("GRPO", rows(question=1), "GRPOTrainer: train_dataset has no 'prompt' column (its first row holds question)"),
])
def test_a_dataset_without_a_column_its_trainer_reads_is_refused_naming_it(tmp_path, model_path, name, dataset, said):
    trainer = getattr(trl, f"{name}Trainer")
    config = getattr(trl, f"{name}Config")
    extra = {"reward_funcs": length} if name == "GRPO" else {}
    settings = {"num_generations": 2} if name == "GRPO" else {}
    with pytest.raises(ValueError) as e:
        outcore_trainer(trainer)(model=model_path, args=trainer_args(str(tmp_path / "run"), cls=config, **settings),
                                 train_dataset=dataset, outcore_config=nvme_config(str(tmp_path / "nvme")), **extra)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_eval_dataset_is_checked_too(tmp_path, model_path):
    good = rows(prompt=1, chosen=1, rejected=1)
    with pytest.raises(ValueError, match="eval_dataset\\['b'\\] has no 'rejected' column"):
        outcore_trainer(trl.DPOTrainer)(model=model_path, args=trainer_args(str(tmp_path / "run"), cls=trl.DPOConfig),
                                        train_dataset=good, eval_dataset={"a": good, "b": rows(chosen=1)},
                                        outcore_config=nvme_config(str(tmp_path / "nvme")))


def test_a_reference_of_another_vocabulary_is_refused(tmp_path, model_path, tmp_path_factory):
    other = model_dir(str(tmp_path_factory.mktemp("wide")), vocab=128)
    ref = transformers.AutoModelForCausalLM.from_pretrained(other)
    with pytest.raises(ValueError, match="ref_model= has a vocabulary of 128 tokens and the model 96"):
        outcore_trainer(trl.DPOTrainer)(model=model_path, ref_model=ref,
                                        args=trainer_args(str(tmp_path / "run"), cls=trl.DPOConfig),
                                        train_dataset=rows(prompt=1, chosen=1, rejected=1),
                                        outcore_config=nvme_config(str(tmp_path / "nvme")))


def _grpo(tmp_path, model_path, reward_funcs):
    args = trainer_args(str(tmp_path / "run"), cls=trl.GRPOConfig, max_steps=1, num_generations=2,
                        max_completion_length=4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    return outcore_trainer(trl.GRPOTrainer)(model=model_path, reward_funcs=reward_funcs, args=args,
                                            train_dataset=rows(prompt=1), processing_class=tokenizer,
                                            outcore_config=nvme_config(str(tmp_path / "n")))


def no_reward(completions, **_):
    return [None] * len(completions)


def nan_reward(completions, **_):
    return [float("nan")] * len(completions)


def length(completions, **_):
    return [float(len(c)) for c in completions]


@pytest.mark.slow
def test_a_grpo_step_whose_rewards_are_all_nan_is_refused_naming_the_functions(tmp_path, model_path):
    trainer = _grpo(tmp_path, model_path, [no_reward, nan_reward])
    with pytest.raises(ValueError, match="every reward function \\(no_reward, nan_reward\\) returned None or NaN for "
                                         "each of the \\d+ completions of this step"):
        trainer.train()
    trainer.engine.close()


@pytest.mark.slow
def test_one_function_that_rewards_nothing_is_said_once(tmp_path, model_path, caplog):
    trainer = _grpo(tmp_path, model_path, [length, nan_reward])
    with caplog.at_level(logging.WARNING):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "reward function nan_reward" in r.getMessage()]
    assert len(said) == 1 and "the other functions' rewards were used" in said[0]
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
    trainer.engine.close()
