"""peft's initializations computed from the base weights (PiSSA, OLoRA, DoRA's magnitude) for a
model wrapped under deferred_init(): the engine runs them as each unit's weights are read, and
starts where peft starts on the model loaded whole."""

import os
import warnings

import pytest
import torch
from hf_models import deferred, save_model, token_batches
from safetensors.torch import load_file
from test_merged_export import HP, merged_reference, nvme_config, train_beside_plain_peft
from transformers import AutoConfig, AutoModelForCausalLM

import outcore

peft = pytest.importorskip("peft")


def wrapped_deferred(directory: str, lora) -> torch.nn.Module:
    """get_peft_model inside the deferred_init() block: peft then builds its adapters on the meta device
    too, and records what to compute from the weights it has not got."""
    with outcore.deferred_init():
        return peft.get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)), lora)


def assert_adapters_load_as_trained(engine: outcore.Engine, directory: str, lora, out: str,
                                    x: torch.Tensor | None = None, tol: float = 0.0) -> None:
    """The engine's adapter export, loaded by peft onto the original model, gives the trained
    model's logits (peft initializes the adapters again as it loads them, then takes their values).
    Closes the engine."""
    engine.export(out, adapters_only=True)
    trained = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora)
    trained.load_state_dict(engine.full_state_dict(), strict=True)
    engine.close()
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), out)
    x = token_batches(1, seed=9)[0] if x is None else x
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x).logits, trained.eval()(x).logits, rtol=tol, atol=tol / 10)


def random_parts(lora) -> tuple[str, ...]:
    """The adapter tensors peft draws at random (the engine draws them from its own seed)."""
    if lora.init_lora_weights is True:
        return (".lora_A.", ".lora_embedding_B.")
    return ()


CASES = {
    "PiSSA, gpt2 Conv1D": ("gpt2", dict(r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                                        init_lora_weights="pissa")),
    "OLoRA, llama": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                   init_lora_weights="olora")),
    "DoRA, llama with an embedding": ("llama", dict(r=2, target_modules=["q_proj", "o_proj", "embed_tokens"],
                                                    use_dora=True)),
    "PiSSA with DoRA, rsLoRA": ("llama", dict(r=4, lora_alpha=4, use_rslora=True, use_dora=True,
                                              target_modules=["k_proj", "up_proj"], init_lora_weights="pissa")),
}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_starts_where_peft_starts_on_the_whole_model_and_trains_as_plain_peft(tmp_path, case, stage):
    kind, options = CASES[case]
    lora = peft.LoraConfig(lora_dropout=0.0, **options)
    directory = save_model(kind, str(tmp_path / "m"))
    cfg = nvme_config(tmp_path)
    if stage == 2:
        cfg = outcore.Config(stage=2, offload_optimizer="nvme", nvme_dir=cfg.nvme_dir, grad_clip=None)
    engine = outcore.Engine(wrapped_deferred(directory, lora), cfg, outcore.AdamW(**HP), weights=directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note that DoRA on an embedding is experimental
        expected = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora).state_dict()
    start = engine.full_state_dict()
    assert start.keys() == expected.keys()
    for name, value in start.items():
        if not any(part in name for part in random_parts(lora)):
            assert torch.equal(value, expected[name]), name
    base = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    if lora.init_lora_weights != True:  # noqa: E712 - PiSSA and OLoRA changed the frozen base: its residual
        changed = [n for n, v in start.items() if ".base_layer." in n and not torch.equal(v, base[_base(n)])]
        assert len(changed) == 2 * len(lora.target_modules), changed  # each of the two blocks' targets

    train_beside_plain_peft(engine, directory, lora)

    # merged: the residual plus the trained adapters, as peft's merge_and_unload gives it
    if not lora.use_dora:
        out = tmp_path / "merged"
        engine.export(str(out), merge_adapters=True)
        ref = merged_reference(engine, directory, lora)
        x = token_batches(1, seed=9)[0]
        back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(x).logits, ref(x).logits, rtol=0, atol=0)
    assert_adapters_load_as_trained(engine, directory, lora, str(tmp_path / "adapters"), tol=1e-5)


def _base(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_randomized_pissa_keeps_the_model_and_draws_from_the_engine_seed(tmp_path, caplog):
    """pissa_niter_N draws its random projections from each unit's seeded generator: W + B·A is W
    again, and two engines with the same seed start the same. Its adapters alone would not load as
    trained (peft draws the residual again), and the export says so."""
    directory = save_model("llama", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], init_lora_weights="pissa_niter_2")
    starts = []
    for run in range(2):
        cfg = nvme_config(tmp_path)
        cfg = outcore.Config(stage=3, offload_params="nvme", nvme_dir=f"{cfg.nvme_dir}{run}", grad_clip=None)
        engine = outcore.Engine(wrapped_deferred(directory, lora), cfg, outcore.AdamW(**HP), weights=directory)
        starts.append(engine.full_state_dict())
        if run == 0:
            engine.export(str(tmp_path / "adapters"), adapters_only=True)
            assert "draws again when it loads these adapters" in caplog.text
            assert "merge_adapters=True" in caplog.text
        engine.close()
    assert starts[0].keys() == starts[1].keys()
    assert all(torch.equal(starts[0][k], v) for k, v in starts[1].items())
    base = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    state, scale = starts[0], lora.lora_alpha / lora.r
    layers = [n.removesuffix(".base_layer.weight") for n in state if n.endswith(".base_layer.weight")]
    assert len(layers) == 4
    for layer in layers:
        residual = state[f"{layer}.base_layer.weight"]
        a, b = state[f"{layer}.lora_A.default.weight"], state[f"{layer}.lora_B.default.weight"]
        assert b.abs().sum() > 0
        original = base[_base(f"{layer}.base_layer.weight")]
        assert not torch.equal(residual, original)
        torch.testing.assert_close(residual + scale * b @ a, original, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("init", ["eva", "lora_ga", "mica"])
def test_an_initialization_that_needs_data_is_refused_by_name_and_nothing_is_left(tmp_path, init):
    directory = save_model("llama", str(tmp_path / "m"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft: no eva_config given
        model = wrapped_deferred(directory, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=init))
    with pytest.raises(ValueError, match=rf"self_attn\.q_proj'.*init_lora_weights='{init}'.*from_pretrained"):
        outcore.Engine(model, nvme_config(tmp_path), outcore.AdamW(**HP), weights=directory)
    assert not (tmp_path / "nvme").exists()  # refused before the store is made


@pytest.mark.parametrize("init", ["olora", "pissa"])
def test_an_initialization_that_changes_a_tied_weight_is_refused_by_name(tmp_path, init):
    directory = save_model("llama-tied", str(tmp_path / "m"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns of an adapter on a tied weight
        model = wrapped_deferred(directory, peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=init))
    with pytest.raises(ValueError, match=r"lm_head.*tied to .*model\.embed_tokens\.weight.*change only one"):
        outcore.Engine(model, nvme_config(tmp_path), outcore.AdamW(**HP), weights=directory)
    assert not os.path.exists(tmp_path / "nvme")  # a failed start leaves no swap file, nor the folder made for it


def test_dora_on_a_tied_head_reads_its_weight_and_trains_as_plain_peft(tmp_path):
    """DoRA only reads W: a tied one is read for the magnitude and again by its unit."""
    directory = save_model("llama-tied", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"], use_dora=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft warns of an adapter on a tied weight
        engine = outcore.Engine(wrapped_deferred(directory, lora), nvme_config(tmp_path), outcore.AdamW(**HP),
                                weights=directory)
        expected = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora).state_dict()
        start = engine.full_state_dict()
        assert start.keys() == expected.keys()
        for name, value in start.items():
            if ".lora_A." not in name:
                assert torch.equal(value, expected[name]), name
        train_beside_plain_peft(engine, directory, lora)
    engine.close()


def test_dora_wrapped_outside_deferred_init_computes_its_magnitude_from_the_weights(tmp_path):
    """README's order (wrap after the block): peft makes real adapters but a magnitude without values."""
    directory = save_model("llama", str(tmp_path / "m"))
    lora = peft.LoraConfig(r=2, target_modules=["v_proj"], use_dora=True)
    engine = outcore.Engine(peft.get_peft_model(deferred(directory), lora), nvme_config(tmp_path), outcore.AdamW(**HP),
                            weights=directory)
    expected = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora).state_dict()
    start = engine.full_state_dict()
    magnitudes = [n for n in start if "lora_magnitude_vector" in n]
    assert len(magnitudes) == 2
    for name in magnitudes:
        assert torch.equal(start[name], expected[name]), name
    train_beside_plain_peft(engine, directory, lora)
    engine.close()


OTHER_TYPES = {
    "IA3": lambda: peft.IA3Config(target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "IA3 as drawn": lambda: peft.IA3Config(target_modules=["k_proj", "up_proj"], feedforward_modules=["up_proj"],
                                           init_ia3_weights=False),
    "LoHa": lambda: peft.LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]),
    "LoKr": lambda: peft.LoKrConfig(r=4, alpha=8, target_modules=["o_proj", "gate_proj"]),
}


@pytest.mark.parametrize("kind", list(OTHER_TYPES))
def test_ia3_loha_and_lokr_under_deferred_init_start_as_peft_and_train_as_plain_peft(tmp_path, kind):
    directory = save_model("llama", str(tmp_path / "m"))
    engine = outcore.Engine(wrapped_deferred(directory, OTHER_TYPES[kind]()), nvme_config(tmp_path),
                            outcore.AdamW(**HP), weights=directory)
    x = token_batches(1, seed=9)[0]
    start = engine.full_state_dict()
    plain = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), OTHER_TYPES[kind]()).eval()
    with torch.no_grad():
        if kind == "IA3 as drawn":  # peft's randn: no longer the base model
            assert all(0.5 < float(v.std()) < 1.5 for n, v in start.items() if "ia3_l" in n)
        else:  # peft's initialization: the adapted model starts as the base model
            base = AutoModelForCausalLM.from_pretrained(directory).eval()
            torch.testing.assert_close(engine.module(input_ids=x).logits, base(x).logits, rtol=1e-5, atol=1e-6)
        plain.load_state_dict(start, strict=True)
        torch.testing.assert_close(engine.module(input_ids=x).logits, plain(x).logits, rtol=1e-5, atol=1e-6)
    train_beside_plain_peft(engine, directory, OTHER_TYPES[kind]())
    assert_adapters_load_as_trained(engine, directory, OTHER_TYPES[kind](), str(tmp_path / "adapters"), x)


@pytest.mark.parametrize("kind", ["llama", "llama-tied"])
def test_trainable_tokens_start_as_their_rows_of_the_embedding_and_train_as_plain_peft(tmp_path, kind):
    """LoRA's trainable_token_indices under deferred_init(): the tokens' rows are read from the
    embedding's stored weight (a tied head follows the embedding's adapter, as in peft)."""
    directory = save_model(kind, str(tmp_path / "m"))
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [3, 5, 7]})
    engine = outcore.Engine(wrapped_deferred(directory, lora), nvme_config(tmp_path), outcore.AdamW(**HP),
                            weights=directory)
    start = engine.full_state_dict()
    expected = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), lora).state_dict()
    assert start.keys() == expected.keys()
    for name, value in start.items():
        if ".lora_A." not in name:  # (drawn at random)
            assert torch.equal(value, expected[name]), name
    stored = load_file(os.path.join(directory, "model.safetensors"))["model.embed_tokens.weight"]
    delta = start["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"]
    assert torch.equal(delta, stored[[3, 5, 7]])
    train_beside_plain_peft(engine, directory, lora)
    x = token_batches(1, seed=9)[0]
    x[:, ::2] = 5  # a trained token
    assert_adapters_load_as_trained(engine, directory, lora, str(tmp_path / "adapters"), x)


REFUSED_TYPES = {
    "vera": lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj"]),
    "PREFIX_TUNING": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
}


@pytest.mark.parametrize("kind", list(REFUSED_TYPES))
def test_other_adapter_types_are_refused_under_deferred_init_and_train_when_built_with_weights(tmp_path, kind):
    directory = save_model("llama", str(tmp_path / "m"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with outcore.deferred_init():
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        model = peft.get_peft_model(model, REFUSED_TYPES[kind]())  # README's order: wrapped after the block
    with pytest.raises(ValueError, match=rf"peft's {kind}.*from_pretrained\) before get_peft_model"):
        outcore.Engine(model, nvme_config(tmp_path), outcore.AdamW(**HP), weights=directory)
    assert not (tmp_path / "nvme").exists()
    whole = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(directory), REFUSED_TYPES[kind]())
    engine = outcore.Engine(whole, nvme_config(tmp_path), outcore.AdamW(**HP))  # what the error says to do
    train_beside_plain_peft(engine, directory, REFUSED_TYPES[kind]())
    engine.close()
