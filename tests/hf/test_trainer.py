"""`outcore.hf.Trainer` and `outcore_trainer(trl.SFTTrainer)` against the plain trainers on the same
tiny Llama, data and arguments (fp32, one rank unless said): equal losses, weights and adapters."""

import json
import os
import subprocess
import sys

import pytest
import torch
from trainer_setup import TokenRows, conversations, logged, model_dir, nvme_config, trainer_args

import outcore
from outcore.hf import outcore_trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
HERE = os.path.dirname(__file__)


def assert_close_rel(got, want, rel=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= rel * abs(w), (got, want)


def assert_same_weights(state: dict, reference: dict, rel=1e-5):
    assert set(state) == set(reference)
    for k, ref in reference.items():
        scale = ref.abs().max().clamp_min(1e-12)
        assert float((state[k].float() - ref.float()).abs().max() / scale) <= rel, k


@pytest.mark.slow
def test_the_trainer_equals_the_plain_trainer(tmp_path, model_path):
    """Losses, gradient norms, learning rates, evaluation and final weights, with params and optimizer
    states on NVMe and `model=` a path."""
    data, held_out = TokenRows(), TokenRows(n=4, seed=9)
    extra = dict(eval_strategy="steps", eval_steps=3)
    plain = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_path),
                                 args=trainer_args(str(tmp_path / "plain"), **extra), train_dataset=data,
                                 eval_dataset=held_out)
    plain.train()
    ours = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "ours"), **extra), train_dataset=data,
                              eval_dataset=held_out, outcore_config=nvme_config(str(tmp_path / "nvme")))
    ours.train()
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        assert_close_rel(logged(ours, key), logged(plain, key))
    assert len(logged(ours, "eval_loss")) == 2
    assert_same_weights(ours.engine.full_state_dict(), plain.model.state_dict())
    ours.engine.close()


@pytest.mark.slow
def test_bf16_trains_in_the_engine_s_bf16_close_to_the_plain_trainer_s_autocast(tmp_path, model_path):
    """`bf16=True` is outcore's bf16 (bf16 parameters and compute, fp32 masters and moments), not autocast
    over fp32 weights: close to the plain trainer, not equal."""
    data = TokenRows()
    plain = transformers.Trainer(model=transformers.AutoModelForCausalLM.from_pretrained(model_path),
                                 args=trainer_args(str(tmp_path / "plain"), bf16=True), train_dataset=data)
    plain.train()
    ours = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "ours"), bf16=True),
                              train_dataset=data, outcore_config=nvme_config(str(tmp_path / "nvme")))
    ours.train()
    assert ours.engine.config.dtype == "bf16"
    assert_close_rel(logged(ours), logged(plain), rel=2e-3)
    ours.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [96, 512])
def test_the_sft_trainer_with_lora_equals_plain_sft_and_its_adapters_load_in_peft(tmp_path, vocab):
    """Conversational data, loss on the assistant's turns only. The adapters start as plain peft draws them
    after `set_seed(args.seed)`, so every logged loss is equal; the saved adapters load in peft (their base
    named by an absolute path) and give the plainly trained model's logits. TRL's fused LM head reads the
    head's weight outside the head's forward: with a vocabulary of 512 the head is larger than a block,
    which the engine would otherwise page as a unit of its own."""
    model_path = model_dir(str(tmp_path / "model"), vocab)
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    data = conversations()

    def args(name):
        return trainer_args(str(tmp_path / name), cls=trl.SFTConfig, learning_rate=1e-2, assistant_only_loss=True,
                            max_length=32)

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")

    plain = trl.SFTTrainer(model=model_path, args=args("plain"), train_dataset=data, processing_class=tok,
                           peft_config=lora())
    plain.train()
    ours = outcore_trainer(trl.SFTTrainer)(model=model_path, args=args("ours"), train_dataset=data,
                                           processing_class=tok, peft_config=lora(),
                                           outcore_config=nvme_config(str(tmp_path / "nvme")))
    ours.train()
    assert_close_rel(logged(ours, "loss"), logged(plain, "loss"))
    # TRL's own tiled head computes them, never the whole logits (issue 71): the same under the engine
    for metric in ("mean_token_accuracy", "entropy"):
        assert_close_rel(logged(ours, metric), logged(plain, metric), rel=1e-4)
    ours.save_model(str(tmp_path / "adapters"))
    saved = sorted(os.listdir(tmp_path / "adapters"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(saved)
    base_path = json.load(open(tmp_path / "adapters" / "adapter_config.json"))["base_model_name_or_path"]
    assert os.path.isabs(base_path) and os.path.samefile(base_path, model_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_path)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapters"))
    x = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, plain.model(x).logits, rtol=1e-5, atol=1e-5)
    ours.engine.close()


@pytest.mark.slow
def test_a_run_resumed_from_its_step_3_checkpoint_ends_as_the_uninterrupted_run(tmp_path, model_path):
    """checkpoint-N folders hold outcore's sharded checkpoint with the trainer's state and RNG files;
    save_total_limit keeps the newest; resume_from_checkpoint continues exactly."""
    data = TokenRows()
    whole = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "run"), save_strategy="steps",
                                                                   save_steps=1, save_total_limit=4),
                               train_dataset=data, outcore_config=nvme_config(str(tmp_path / "nvme1")))
    whole.train()
    assert sorted(os.listdir(tmp_path / "run")) == [f"checkpoint-{n}" for n in (3, 4, 5, 6)]
    saved = set(os.listdir(tmp_path / "run" / "checkpoint-3"))
    assert {"outcore", "trainer_state.json", "rng_state.pth", "training_args.bin"} <= saved
    assert not {"model.safetensors", "optimizer.pt", "scheduler.pt"} & saved  # the engine's checkpoint holds those
    assert {"config.json", "README.md"} <= saved  # what the folder is, and the command that exports the model
    readme = (tmp_path / "run" / "checkpoint-3" / "README.md").read_text()
    assert "outcore export checkpoint-3/outcore DIR" in readme
    from outcore.tools.cli import main

    assert main(["export", str(tmp_path / "run" / "checkpoint-6" / "outcore"), str(tmp_path / "exported")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    assert_same_weights(exported.state_dict(), whole.engine.full_state_dict(), rel=1e-6)
    resumed = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "again")), train_dataset=data,
                                 outcore_config=nvme_config(str(tmp_path / "nvme2")))
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert resumed.state.global_step == 6

    def after_step_3(trainer, key):  # a resumed trainer's history starts with the checkpoint's
        return [h[key] for h in trainer.state.log_history if key in h and h["step"] > 3]

    for key in ("loss", "learning_rate", "grad_norm"):
        assert len(after_step_3(resumed, key)) == 3
        assert_close_rel(after_step_3(resumed, key), after_step_3(whole, key))
    assert_same_weights(resumed.engine.full_state_dict(), whole.engine.full_state_dict(), rel=1e-6)
    for t in (whole, resumed):
        t.engine.close()


def test_save_model_writes_a_directory_from_pretrained_loads_to_the_same_logits(tmp_path, model_path):
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    ours = outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "run"), max_steps=2),
                              train_dataset=TokenRows(), processing_class=tok,
                              outcore_config=nvme_config(str(tmp_path / "nvme")))
    ours.train()
    ours.save_model()
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_args.bin"} <= set(
        os.listdir(tmp_path / "run"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"))
    x = torch.randint(0, 40, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(x).logits, loaded(x).logits)
    ours.engine.close()


@pytest.mark.parametrize("setting, named", [({"optim": "adafactor"}, "optim='adafactor'"),
                                            ({"torch_compile": True}, "torch_compile=True"),
                                            ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "deepspeed=")])
def test_what_the_engine_cannot_honour_is_refused_in_one_line_before_anything_is_written(tmp_path, model_path,
                                                                                         setting, named):
    args = trainer_args(str(tmp_path / "run"))
    for key, value in setting.items():  # (TrainingArguments itself refuses deepspeed= where DeepSpeed is missing)
        setattr(args, key, value)
    with pytest.raises(ValueError) as e:
        outcore.hf.Trainer(model=model_path, args=args, train_dataset=TokenRows(),
                           outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert named in str(e.value) and "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []


def test_outcore_trainer_takes_only_a_trainer_class():
    with pytest.raises(TypeError, match="transformers.Trainer or a subclass"):
        outcore_trainer(torch.nn.Module)
    assert outcore_trainer(trl.SFTTrainer) is outcore_trainer(trl.SFTTrainer)
    assert issubclass(outcore.hf.Trainer, transformers.Trainer)


def run_ranks(launcher: list[str], model_path: str, directory, per_rank_batch: int) -> dict:
    out = os.path.join(directory, "result.json")
    script = [os.path.join(HERE, "dist_trainer.py"), model_path, str(directory), out, str(per_rank_batch)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([*launcher, *script], capture_output=True, text=True, timeout=300,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.load(open(out))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, model_path):
    """The reference: one process on the global batch of 4."""

    return run_ranks([sys.executable], model_path, tmp_path_factory.mktemp("one"), 4)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_gloo_ranks_equal_one_rank_on_the_global_batch(tmp_path, model_path, one_rank, launcher):
    """Two ranks of batch 2 under `torchrun` or `accelerate launch` (whose --multi_gpu launcher starts
    gloo ranks where there is no GPU) against one rank of batch 4."""

    from launch import free_port, torchrun

    start = torchrun(2, tmp_path) if launcher == "torchrun" else [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2", "--num_machines=1",
        "--mixed_precision=no", "--dynamo_backend=no", f"--main_process_port={free_port()}"]
    two = run_ranks(start, model_path, tmp_path, 2)
    assert two["world"] == 2 and one_rank["world"] == 1
    assert_close_rel(two["losses"], one_rank["losses"])
    two_sd, one_sd = (torch.load(r["weights"], weights_only=True) for r in (two, one_rank))
    assert_same_weights(two_sd, one_sd)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["model_init_kwargs", "trainer", "pre-quantized", "8-bit"])
def test_qlora_through_the_sft_trainer_equals_plain_trl_peft_and_bitsandbytes(tmp_path, where):
    """`quantization_config` (a BitsAndBytesConfig) in `args.model_init_kwargs` or given to the trainer,
    or `model=` a directory saved 4-bit: the base rests NF4 in outcore's tiers as bitsandbytes stores
    it (the saved one read in place), and the losses are plain QLoRA's; so for 8-bit."""
    pytest.importorskip("bitsandbytes")
    model_path = model_dir(str(tmp_path / "model"))
    tok = transformers.AutoTokenizer.from_pretrained(model_path)
    data = conversations()
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.float32)
    if where == "8-bit":
        q = transformers.BitsAndBytesConfig(load_in_8bit=True)
    if where == "pre-quantized":
        transformers.AutoModelForCausalLM.from_pretrained(model_path, quantization_config=q, dtype=torch.float32,
                                                          device_map="cpu").save_pretrained(str(tmp_path / "q"))
        tok.save_pretrained(str(tmp_path / "q"))
        model_path = str(tmp_path / "q")

    def run(cls, name, **extra):
        given_in_args = where in ("model_init_kwargs", "8-bit")
        init = {"dtype": torch.float32, **({"quantization_config": q} if given_in_args else {})}
        args = trainer_args(str(tmp_path / name), cls=trl.SFTConfig, learning_rate=1e-2, assistant_only_loss=True,
                            max_length=32, model_init_kwargs=init)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        given = {"quantization_config": q} if where == "trainer" else {}
        trainer = cls(model=model_path, args=args, train_dataset=data, processing_class=tok, peft_config=lora,
                      **given, **extra)
        trainer.train()
        return trainer

    plain = run(trl.SFTTrainer, "plain")
    layer = "Linear8bitLt" if where == "8-bit" else "Linear4bit"
    assert any(type(m).__name__ == layer for m in plain.model.modules())
    ours = run(outcore_trainer(trl.SFTTrainer), "ours", outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert [u for u in ours.engine.units if u.quantized is not None]
    assert (ours.engine.config.quantize, ours.engine.config.quantize_double) == (
        ("int8", False) if where == "8-bit" else ("nf4", True))
    if where == "pre-quantized":
        assert all(u.in_place is not None for u in ours.engine.units if u.quantized is not None)
    assert_close_rel(logged(ours, "loss"), logged(plain, "loss"), rel=1e-4)
    ours.engine.close()


def test_a_quantization_the_engine_cannot_honour_is_refused_in_one_line(tmp_path, model_path):
    pytest.importorskip("bitsandbytes")
    q = transformers.BitsAndBytesConfig(load_in_8bit=True, llm_int8_has_fp16_weight=True)
    with pytest.raises(ValueError, match="llm_int8_has_fp16_weight=True") as e:
        outcore.hf.Trainer(model=model_path, args=trainer_args(str(tmp_path / "run")), train_dataset=TokenRows(),
                           quantization_config=q, outcore_config=nvme_config(str(tmp_path / "nvme")))
    assert "\n" not in str(e.value)
