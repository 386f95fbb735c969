"""A TRL config's `model_init_kwargs` with `model=` a path: each key taken where plain TRL's
`from_pretrained` takes it, or refused or said in one line, never dropped."""

import logging

import pytest
import torch
from trainer_setup import conversations, logged, nvme_config, trainer_args

from outcore.hf import outcore_trainer

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")


def sft(cls, model_path, directory, init, **extra):
    args = trainer_args(str(directory), cls=trl.SFTConfig, learning_rate=1e-2, max_length=32, max_steps=3,
                        model_init_kwargs=init, **extra.pop("flags", {}))
    trainer = cls(model=model_path, args=args, train_dataset=conversations(),
                  processing_class=transformers.AutoTokenizer.from_pretrained(model_path), **extra)
    trainer.train()
    return trainer


def test_attn_implementation_and_config_settings_are_the_plain_trainer_s(tmp_path, model_path, caplog):
    init = {"attn_implementation": "eager", "dtype": "float32", "use_cache": False, "device_map": "auto",
            "revision": "main"}
    plain = sft(trl.SFTTrainer, model_path, tmp_path / "plain", dict(init, device_map=None))
    with caplog.at_level(logging.WARNING):
        ours = sft(outcore_trainer(trl.SFTTrainer), model_path, tmp_path / "ours", init,
                   outcore_config=nvme_config(str(tmp_path / "nvme")))
    for trainer in (plain, ours):
        assert trainer.model.config._attn_implementation == "eager"
        assert trainer.model.config.use_cache is False
    said = [r.getMessage() for r in caplog.records]
    assert sum("device_map='auto' is ignored" in m for m in said) == 1
    assert sum("revision='main'" in m and "ignored" in m for m in said) == 1
    assert not any("will be ignored" in m for m in said)  # TRL's own word that it dropped them: not said
    torch.testing.assert_close(torch.tensor(logged(ours)), torch.tensor(logged(plain)), rtol=1e-5, atol=0)
    ours.engine.close()


def test_a_half_dtype_is_the_compute_dtype(tmp_path, model_path):
    ours = sft(outcore_trainer(trl.SFTTrainer), model_path, tmp_path / "ours", {"dtype": torch.bfloat16},
               outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert ours.engine.config.dtype == "bf16"
    ours.engine.close()


@pytest.mark.parametrize("init, flags, said", [
    ({"dtype": "bfloat16"}, {"fp16": True}, "dtype is bf16 and the trainer's arguments set fp16=True"),
    ({"dtype": torch.int8}, {}, "outcore computes in float32, bfloat16 or float16"),
    ({"trust_remote_code": True}, {}, "trust_remote_code=True"),
    ({"no_such_setting": 3}, {}, "no_such_setting=3: not a setting of LlamaConfig"),
])
def test_what_outcore_cannot_take_is_refused_in_one_line(tmp_path, model_path, init, flags, said):
    args = trainer_args(str(tmp_path / "run"), cls=trl.SFTConfig, max_length=32, model_init_kwargs=init)
    for k, v in flags.items():
        object.__setattr__(args, k, v)  # fp16 needs a GPU to construct; the check reads the flag only
    with pytest.raises(ValueError, match=said) as e:
        outcore_trainer(trl.SFTTrainer)(model=model_path, args=args, train_dataset=conversations(),
                                        processing_class=transformers.AutoTokenizer.from_pretrained(model_path),
                                        outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert "\n" not in str(e.value)
