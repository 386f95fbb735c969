"""`outcore train --model DIR`: fine-tuning a Hugging Face model from the command line, fully or with
LoRA, on JSONL or text, with the model's own tokenizer; `estimate --model DIR`; `export CKPT DIR`;
and the mistakes a user makes, each one line and exit 2."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from hf_models import STORY, save_model, save_tokenizer, token_batches  # noqa: E402

from outcore.tools.cli import main  # noqa: E402

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402


@pytest.fixture
def model_dir(tmp_path):
    directory = save_model("llama", str(tmp_path / "llama"))
    save_tokenizer(directory)
    return directory


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"text": STORY * 3}) + "\n" for _ in range(40)))
    return str(path)


def train_args(tmp_path, model_dir, data, *extra):
    return ["train", "--model", model_dir, "--data", data, "--seq", "16", "--batch", "4", "--out",
            str(tmp_path / "run"), "--offload-params", "nvme", "--offload-optimizer", "nvme", "--dtype", "fp32",
            "--eval-batches", "2", "--json", str(tmp_path / "summary.json"), *extra]


def test_lora_from_the_command_line_lowers_the_loss_and_its_export_loads_in_peft(tmp_path, model_dir, jsonl, capsys):
    # (at 3e-2 this LoRA plateaus near 4.4 by step 10, where the loss's rounding, a chunk at a time or
    # whole, decides whether the last five steps' mean is 0.2 below the first; at 1e-2 it reaches 4.17)
    assert main(train_args(tmp_path, model_dir, jsonl, "--lora", "8", "--steps", "20", "--lr", "1e-2")) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert len(s["losses"]) == 20 and s["trainable_params"] < s["params"] / 2
    assert sum(s["losses"][-5:]) / 5 < s["losses"][0] - 0.2
    vals = [v for _, v in s["val_losses"]]
    assert vals[-1] < vals[0]
    adapters = s["exported"]
    assert sorted(os.listdir(adapters)) == ["adapter_config.json", "adapter_model.safetensors"]
    tuned = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapters).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = token_batches(1)[0]
    with torch.no_grad():
        assert not torch.allclose(tuned(x).logits, base(x).logits)  # the adapters changed the model
    assert "LoRA r=8" in capsys.readouterr().out
    # Resume continues from the last checkpoint; this time the adapters are also merged into the model,
    # which loads alone and equals peft's merge of the adapters written beside it.
    assert main(train_args(tmp_path, model_dir, jsonl, "--lora", "8", "--steps", "22", "--lr", "1e-2", "--resume",
                           "--merge-adapters")) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["start_step"] == 20 and s["exported"] == str(tmp_path / "run" / "model")
    assert "tokenizer.json" in os.listdir(s["exported"])
    merged = AutoModelForCausalLM.from_pretrained(s["exported"]).eval()
    by_peft = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapters)
    with torch.no_grad():
        assert torch.equal(merged(x).logits, by_peft.merge_and_unload().eval()(x).logits)
    # The checkpoint exports offline.
    checkpoints = str(tmp_path / "run" / "checkpoints")
    capsys.readouterr()
    assert main(["export", checkpoints, str(tmp_path / "merged")]) == 2  # peft names transformers cannot load
    assert "Add --merge-adapters" in capsys.readouterr().err and not (tmp_path / "merged").exists()
    assert main(["export", checkpoints, str(tmp_path / "merged"), "--merge-adapters"]) == 0
    offline = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert torch.equal(offline(x).logits, merged(x).logits)
    assert main(["export", checkpoints, str(tmp_path / "all.safetensors")]) == 0
    assert any(".lora_A." in k for k in load_file(str(tmp_path / "all.safetensors")))


CHAT = {"messages": [{"role": "user", "content": "the quick brown fox"},
                     {"role": "assistant", "content": "jumps over the lazy dog"}]}
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"


def test_conversations_train_on_their_assistant_turns_and_a_mixed_file_is_refused_naming_its_line(tmp_path, model_dir,
                                                                                                 capsys):
    template = tmp_path / "chat.jinja"  # --chat-template: the tokenizer in model_dir has none
    template.write_text(TEMPLATE)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(CHAT) + "\n" for _ in range(30)))
    assert main(train_args(tmp_path, model_dir, str(path), "--steps", "2", "--chat-template", str(template))) == 0
    out = capsys.readouterr().out
    assert "30 samples" not in out and "% of tokens carry the loss" in out  # 28 train, 2 held out
    assert main(train_args(tmp_path, model_dir, str(path), "--steps", "2")) == 2
    assert "no chat template" in capsys.readouterr().err
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps({"text": STORY}) + "\n")
    assert main(train_args(tmp_path, model_dir, str(path), "--steps", "2", "--chat-template", str(template))) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "one format" in err and len(err.strip().splitlines()) == 1


def test_lora_alpha_and_targets_are_peft_s_and_the_count_of_what_trains_is_too(tmp_path, model_dir, jsonl):
    args = train_args(tmp_path, model_dir, jsonl, "--lora", "4", "--lora-alpha", "16", "--lora-targets",
                      "q_proj,v_proj", "--steps", "2")
    assert main(args) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    written = json.loads((tmp_path / "run" / "adapters" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], sorted(written["target_modules"])) == (4, 16, ["q_proj", "v_proj"])
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    plain = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)
    assert s["trainable_params"] == sum(p.numel() for p in plain.parameters() if p.requires_grad)
    assert main(["estimate", "--model", model_dir, "--lora", "4", "--lora-targets", "q_proj,v_proj", "--json",
                 str(tmp_path / "estimate.json")]) == 0
    estimated = json.loads((tmp_path / "estimate.json").read_text())["model"]
    assert estimated.endswith(f", {s['trainable_params']} trained)"), estimated  # (under 1,000: written out)
    assert main(["estimate", "--model", model_dir, "--lora-targets", "q_proj"]) == 2


def test_pissa_and_dora_from_the_command_line_export_adapters_peft_loads_as_the_merged_model(tmp_path, model_dir,
                                                                                            jsonl):
    """--lora-init pissa: the engine computes PiSSA from the weights it reads; the adapters, loaded
    by peft onto the original model (peft computes the same residual), give the merged model. The
    same for --dora, whose merge rescales each row."""
    args = train_args(tmp_path, model_dir, jsonl, "--lora", "4", "--lora-init", "pissa", "--lora-targets",
                      "q_proj,down_proj", "--steps", "3", "--lr", "1e-2", "--merge-adapters")
    assert main(args) == 0
    run = tmp_path / "run"
    assert json.loads((run / "adapters" / "adapter_config.json").read_text())["init_lora_weights"] == "pissa"
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(run / "adapters"))
    merged = AutoModelForCausalLM.from_pretrained(str(run / "model")).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, merged(x).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(x).logits, base(x).logits)  # three steps changed the model

    dora = tmp_path / "dora"
    assert main(train_args(tmp_path, model_dir, jsonl, "--lora", "2", "--dora", "--lora-targets", "v_proj", "--steps",
                           "2", "--out", str(dora), "--merge-adapters")) == 0
    assert json.loads((dora / "adapters" / "adapter_config.json").read_text())["use_dora"] is True
    assert any("lora_magnitude_vector" in k for k in load_file(str(dora / "adapters" / "adapter_model.safetensors")))
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(dora / "adapters"))
    merged = AutoModelForCausalLM.from_pretrained(str(dora / "model")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, merged(x).logits, rtol=1e-5, atol=1e-5)


def test_tokens_added_to_the_tokenizer_grow_the_vocabulary_of_a_full_fine_tune(tmp_path, model_dir, caplog):
    """As transformers' run_clm does: a tokenizer with tokens added beyond the model's vocabulary (and
    data that uses them) resizes the model, whose new rows start at the stored rows' mean; the
    export is a model of the new vocabulary with its tokenizer. Under --lora, the new tokens' rows
    train too (peft's trainable_token_indices)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    added = [f"<extra{i}>" for i in range(vocab + 4 - len(tokenizer))]
    tokenizer.add_tokens(added)
    tokenizer.save_pretrained(model_dir)
    assert len(tokenizer) == vocab + 4
    data = tmp_path / "added.jsonl"  # the last ones added: ids beyond the model's vocabulary
    data.write_text("".join(json.dumps({"text": f"{STORY} {added[-1 - i % 4]} " * 3}) + "\n" for i in range(40)))
    with caplog.at_level("WARNING"):
        assert main(train_args(tmp_path, model_dir, str(data), "--steps", "2")) == 0
    assert any(f"the model's vocabulary is resized to {vocab + 4}" in r.getMessage() for r in caplog.records)
    out = json.loads((tmp_path / "summary.json").read_text())["exported"]
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.config.vocab_size == vocab + 4 and back.get_input_embeddings().weight.shape[0] == vocab + 4
    assert len(AutoTokenizer.from_pretrained(out)) == vocab + 4

    # Under LoRA the new tokens' rows train beside the adapters (peft's trainable_token_indices).
    args = train_args(tmp_path, model_dir, str(data), "--steps", "2", "--lora", "2", "--out", str(tmp_path / "lora"),
                      "--merge-adapters")
    assert main(args) == 0
    adapters = tmp_path / "lora" / "adapters"
    written = json.loads((adapters / "adapter_config.json").read_text())["trainable_token_indices"]
    assert written == {"embed_tokens": list(range(vocab, vocab + 4)), "lm_head": list(range(vocab, vocab + 4))}
    resized = AutoModelForCausalLM.from_pretrained(model_dir)
    resized.resize_token_embeddings(vocab + 4)
    tuned = peft.PeftModel.from_pretrained(resized, str(adapters))
    trained = tuned.base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta["default"]
    assert trained.shape == (4, resized.config.hidden_size)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "lora" / "model")).eval()
    x = torch.tensor([tokenizer(f"{STORY} {added[-1]}")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, tuned.eval()(x).logits, rtol=1e-5, atol=1e-5)


def test_lora_on_a_mixture_of_experts_puts_adapters_on_its_linear_modules_and_says_so(tmp_path, jsonl, caplog):
    """peft's "all-linear" also wraps Mixtral's fused experts and router, bare parameters the engine
    refuses; the command line makes the adapters again on the linear modules, and says so once."""
    directory = save_model("mixtral", str(tmp_path / "mixtral"))
    save_tokenizer(directory)
    with caplog.at_level("WARNING"):
        assert main(train_args(tmp_path, directory, jsonl, "--lora", "4", "--steps", "3")) == 0
    said = [r.message for r in caplog.records if r.message.startswith("--lora: adapters on")]
    assert said == [f"--lora: adapters on k_proj, o_proj, q_proj, v_proj; the fused experts and router of "
                    f"{directory} are parameters, not linear modules, and get none"]
    adapters = json.loads((tmp_path / "summary.json").read_text())["exported"]
    names = load_file(os.path.join(adapters, "adapter_model.safetensors"))
    assert names and all(any(f".{m}." in k for m in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in names)
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), adapters)


def test_lora_on_gpt2_conv1d_is_configured_for_its_transposed_weights_without_a_warning(tmp_path, recwarn):
    from outcore.hf.source import HFModel

    model = HFModel(save_model("gpt2", str(tmp_path / "gpt2")), lora_rank=2).build()
    assert model.peft_config["default"].fan_in_fan_out
    assert not [w for w in recwarn if "fan_in_fan_out" in str(w.message)]
    assert HFModel(save_model("llama", str(tmp_path / "llama")), lora_rank=2).build().peft_config[
        "default"].fan_in_fan_out is False


def test_a_full_fine_tune_exports_a_directory_transformers_loads(tmp_path, model_dir):
    text = tmp_path / "story.txt"
    text.write_text(STORY * 60)
    stored = GenerationConfig(bos_token_id=1, eos_token_id=[1, 3], max_new_tokens=9, do_sample=True, top_k=20)
    stored.save_pretrained(model_dir)
    assert main(train_args(tmp_path, model_dir, str(text), "--steps", "4", "--lr", "1e-3")) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    exported = s["exported"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(exported))
    ours = AutoModelForCausalLM.from_pretrained(exported).eval()
    offline = tmp_path / "offline"
    assert main(["export", str(tmp_path / "run" / "checkpoints"), str(offline), "--dtype", "fp32"]) == 0
    again = AutoModelForCausalLM.from_pretrained(str(offline)).eval()
    for model in (ours, again):  # the model directory's generation settings, online and offline
        assert model.generation_config.to_diff_dict() == stored.to_diff_dict()
    x = token_batches(1)[0]
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ours(x).logits)


def test_estimate_sizes_a_model_directory_from_its_config(tmp_path, model_dir, capsys):
    out = tmp_path / "est.json"
    assert main(["estimate", "--model", model_dir, "--dtype", "fp32", "--device", "cpu", "--stage", "3",
                 "--offload-params", "nvme", "--offload-optimizer", "nvme", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    # fp32 weights + [m|v]; the default host budget keeps the entry units' [m|v] in HOST
    assert rows[0]["nvme"]["states"] + rows[0]["host"]["states"] >= 12 * params
    assert main(["estimate", "--model", model_dir, "--lora", "4", "--dtype", "fp32", "--device", "cpu", "--stage",
                 "3", "--offload-params", "nvme", "--offload-optimizer", "nvme", "--json", str(out)]) == 0
    lora = json.loads(out.read_text())["rows"][0]
    full = rows[0]["nvme"]["states"] + rows[0]["host"]["states"]
    # The base is read where its weights files hold it: the states are the adapters' alone.
    assert 0 < lora["nvme"]["states"] + lora["host"]["states"] < min(4 * params, full / 2)


@pytest.mark.parametrize(("damage", "message"), [
    ("no-config", "no config.json"),
    ("unknown-model-type", "its config.json does not load"),
    ("custom-code", "custom code"),
    ("no-tokenizer", "no tokenizer found"),
    ("no-data", "--data"),
    ("bad-jsonl", "line 2"),
    ("lora-without-model", "--model DIR"),
    ("merge-without-lora", "--merge-adapters is a setting of LoRA adapters: give --model DIR and --lora R too."),
    ("alpha-without-lora", "--lora-alpha is a setting of LoRA adapters"),
    ("unknown-lora-target", "--lora-targets q_proj,nope: no module of"),
    ("init-without-lora", "--lora-init is a setting of LoRA adapters"),
    ("unknown-lora-init", "argument --lora-init: 'svd' is not one of gaussian, pissa, pissa_niter_N, olora"),
    ("chat-without-template", "holds conversational rows (messages), and the tokenizer has no chat template"),
    ("chat-on-a-preset", "line 1 is a conversation (\"messages\"): conversations are rendered by a model's chat"),
    ("chat-malformed", "line 2 is a messages row, but line 1 is a text row: a file holds rows of one format"),
    ("chat-missing-field", "line 2 has the fields ['prompt'], which are none of the formats"),
    ("seq-beyond-positions", "--seq 128 is longer than the 64 positions"),
    ("foreign-tokenizer", "but the model's vocabulary is 5 tokens (vocab_size in its config.json)"),
])
def test_mistakes_exit_2_with_one_line_and_nothing_written(tmp_path, model_dir, jsonl, capsys, monkeypatch, damage,
                                                           message):
    args = train_args(tmp_path, model_dir, jsonl, "--steps", "2")
    # transformers asks at the terminal whether to run a model's own code unless told not to
    monkeypatch.setattr("builtins.input", lambda *_: pytest.fail("the command waited for an answer"))
    if damage == "no-config":
        os.unlink(os.path.join(model_dir, "config.json"))
    elif damage == "no-tokenizer":
        for f in os.listdir(model_dir):
            if f.startswith("tokenizer") or f == "special_tokens_map.json":
                os.unlink(os.path.join(model_dir, f))
    elif damage == "no-data":
        args.remove("--data")
        args.remove(jsonl)
    elif damage in ("unknown-model-type", "foreign-tokenizer", "custom-code"):
        path = os.path.join(model_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        changed = {"unknown-model-type": {"model_type": "no-such-architecture"},  # explained over several lines
                   "foreign-tokenizer": {"vocab_size": 5},
                   "custom-code": {"model_type": "its-own", "auto_map": {"AutoConfig": "its_own.Config"}}}
        with open(path, "w") as f:
            json.dump({**cfg, **changed[damage]}, f)
    elif damage == "seq-beyond-positions":
        args[args.index("--seq") + 1] = "128"
    elif damage == "merge-without-lora":
        args.append("--merge-adapters")
    elif damage == "alpha-without-lora":
        args += ["--lora-alpha", "16"]
    elif damage == "unknown-lora-target":
        args += ["--lora", "4", "--lora-targets", "q_proj,nope"]
    elif damage == "init-without-lora":
        args += ["--lora-init", "pissa"]
    elif damage == "unknown-lora-init":
        args += ["--lora", "4", "--lora-init", "svd"]
    elif damage.startswith("chat"):
        rows = {"chat-malformed": [{"text": STORY}, {"messages": [{"role": "user"}]}],
                "chat-missing-field": [{"prompt": "the", "completion": "fox"}, {"prompt": "the"}]}.get(damage, [CHAT])
        with open(jsonl, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        if damage == "chat-on-a-preset":
            args = ["train", "--data", jsonl, "--steps", "1", "--out", str(tmp_path / "run")]
    elif damage == "bad-jsonl":
        with open(jsonl, "w") as f:
            f.write(json.dumps({"text": STORY}) + "\nnot json\n")
    else:
        args = ["train", "--lora", "4", "--steps", "1", "--out", str(tmp_path / "run")]
    try:
        code = main(args)
    except SystemExit as e:  # a flag's value argparse refuses
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_outputs_say_where_they_are_and_load_from_anywhere(tmp_path, model_dir, jsonl, monkeypatch, capsys):
    """Adapters name their base model by an absolute path, so they load from another working directory
    (nothing is looked up on a hub); `outcore export` writes the tokenizer of the model the run came
    from; the last line of a run names what it wrote where."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(os.path.dirname(model_dir))
    relative = os.path.basename(model_dir)
    assert main(train_args(tmp_path, relative, jsonl, "--lora", "4", "--steps", "1")) == 0
    adapters = json.loads((tmp_path / "summary.json").read_text())["exported"]
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(
        f"; wrote the model in {adapters} and checkpoints in {tmp_path / 'run' / 'checkpoints'}")
    config = json.loads(open(os.path.join(adapters, "adapter_config.json")).read())
    assert config["base_model_name_or_path"] == model_dir
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert type(peft.AutoPeftModelForCausalLM.from_pretrained(adapters)).__name__.startswith("Peft")
    full = tmp_path / "full"
    assert main(["train", "--model", model_dir, "--data", jsonl, "--seq", "16", "--batch", "4", "--out", str(full),
                 "--steps", "1", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    assert main(["export", str(full / "checkpoints"), str(tmp_path / "exported")]) == 0
    assert f"with the tokenizer of {model_dir}" in capsys.readouterr().out
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path / "exported")).get_vocab() == AutoTokenizer.from_pretrained(
        model_dir).get_vocab()
