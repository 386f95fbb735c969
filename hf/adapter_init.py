"""peft's adapters initialized as peft does it, for a model wrapped under deferred_init().

peft initializes an adapter as it wraps the model. On the meta device there is nothing to compute
from, so the engine runs the same initialization, with peft's own methods, as each unit is
materialized (runtime/materialize.py asks through hf/model_family.py), for the adapters that are still without values:

- A and B as `init_lora_weights` says: True (A like a linear layer, B zero, so the adapted model
  starts as the base model), "gaussian", or False (both as the linear layers they are).
- From the weight W they adapt: PiSSA (A and B from W's principal singular vectors, exact or
  `pissa_niter_N`), OLoRA (from W's QR). Both subtract B·A from W, so that W + B·A starts as W: the
  frozen base the engine then holds is that residual, as peft's would be. DoRA's magnitude (the norm
  of each of W's rows, with the adapter's update) is computed from W too, after A and B.
  For these, W is read (from `weights=`) into its module first; its unit takes it from there
  (`read_base`), so it is read once. PiSSA or OLoRA on a tied W (one parameter under two names)
  is refused by name: it would change both.
- "orthogonal": A and B drawn from one random orthogonal matrix.

Initializations that need data, gradients or a quantized model (EVA, CorDA, LoRA-GA, LoftQ, MiCA)
are refused by name: build the model with its weights and let peft run them.
peft's layers other than Linear (Embedding, convolutions) take the plain initialization for every
`init_lora_weights` that is not theirs, as peft's own `update_layer` for them does.

IA3's vectors (ones, or as drawn with `init_ia3_weights=False`) and LoHa's and LoKr's factors (by
`init_weights`) are initialized by their layers' own reset methods too. Trainable tokens (LoRA's
`trainable_token_indices`) start as their rows of the embedding, read as DoRA reads W, and keep a
copy of them, a buffer peft uses to unmerge, which the engine's buffer pass leaves to this
(`computed_buffers`). Other adapter types (VeRA's and BOFT's computed buffers, prompt learning)
are refused by name under deferred_init(): peft initializes them on a model built with its weights.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from outcore.runtime.model_family import ReadBase

log = logging.getLogger(__name__)

REFUSED = ("eva", "corda", "lora_ga", "loftq", "mica")  # peft computes these from data or a quantized model


def adapter_configs(model: nn.Module) -> dict[str, object]:
    """Each adapter's peft config, by adapter name ({} for a model peft does not wrap)."""
    configs = getattr(model, "peft_config", None)
    return dict(configs) if isinstance(configs, dict) else {}


def is_tuner_layer(m: nn.Module) -> bool:
    """A layer peft put adapters on (its BaseTunerLayer: LoRA, IA3, LoHa, ...)."""
    return isinstance(getattr(m, "adapter_layer_names", None), tuple) and callable(getattr(m, "get_base_layer", None))


def is_lora_layer(m: nn.Module) -> bool:
    return callable(getattr(m, "reset_lora_parameters", None)) and isinstance(getattr(m, "lora_A", None),
                                                                              nn.ModuleDict)


def adapter_parts(layer: nn.Module) -> dict[str, list[nn.Module]]:
    """A peft layer's adapters and the modules that hold their parts: for LoRA, `lora_A[adapter]` of
    a linear layer or the `lora_embedding_A/B` parameter dicts of an embedding (not DoRA's magnitude,
    initialized apart); for the other types, the parameter dicts their layer names."""
    lora = ("lora_A", "lora_embedding_A", "lora_embedding_B")
    names: tuple[str, ...] = lora if is_lora_layer(layer) else getattr(layer, "adapter_layer_names")  # noqa: B009
    parts: dict[str, list[nn.Module]] = {}
    for name in names:
        holder = getattr(layer, name, None)
        if isinstance(holder, nn.ModuleDict):
            for adapter, module in holder.items():
                parts.setdefault(adapter, []).append(module)
        elif isinstance(holder, nn.ParameterDict):
            for adapter in holder:
                parts.setdefault(adapter, []).append(holder)
    return parts


def magnitudes(layer: nn.Module) -> dict[str, nn.Module]:
    """A LoRA layer's DoRA magnitude modules, by adapter."""
    held = getattr(layer, "lora_magnitude_vector", None)
    return dict(held.items()) if isinstance(held, nn.ModuleDict) else {}


def initialize_adapters(layer: nn.Module, name: str, fresh: set[nn.Module], configs: dict[str, object],
                        read_base: ReadBase) -> None:
    """Initialize `layer`'s adapters whose parts or DoRA magnitude are in `fresh` (just given
    memory), as peft's `update_layer` does, by each adapter's config in `configs`. `name` is the
    layer's, for errors; `read_base` gives a base weight's stored value before an initialization
    computes from it."""
    for adapter, parts in adapter_parts(layer).items():
        config = configs.get(adapter)
        if any(c in fresh for part in parts for c in part.modules()):
            if is_lora_layer(layer):
                _factors(layer, name, adapter, getattr(config, "init_lora_weights", True), read_base)
            elif _is_trainable_tokens(layer):
                _trainable_tokens(layer, adapter, config, read_base)
            else:
                _reset_other(layer, name, adapter, config)
        magnitude = magnitudes(layer).get(adapter)
        if magnitude is not None and magnitude in fresh:
            _base_weight(layer, read_base, changes=False)
            a, b = _factor_weights(layer, adapter)
            update = getattr(magnitude, "update_layer")  # noqa: B009 - a method mypy sees as a Tensor
            update(base_layer=getattr(layer, "get_base_layer")(), lora_A=a, lora_B=b,  # noqa: B009
                   scaling=_scaling(layer, adapter))


def check_adapter_inits(model: nn.Module) -> None:
    """Refuse, before anything is read or written, an adapter still on the meta device whose
    initialization the engine cannot run: one that needs data, gradients or a quantized model, or
    an adapter type it does not know."""
    configs = adapter_configs(model)
    prompts = [c for c in configs.values() if getattr(c, "is_prompt_learning", False)]
    if prompts and any(p.is_meta for p in model.parameters()):
        raise ValueError(f"the engine does not build peft's {_kind(prompts[0])} under deferred_init(): build the "
                         "model with its weights (from_pretrained) before get_peft_model, and give the engine "
                         "that model without weights=.")
    for name, layer in model.named_modules():
        if not is_tuner_layer(layer) or _is_trainable_tokens(layer):
            continue
        for adapter, parts in adapter_parts(layer).items():
            if any(p.is_meta for part in parts for p in part.parameters()):
                if is_lora_layer(layer):
                    _check(name, getattr(configs.get(adapter), "init_lora_weights", True))
                else:
                    _reset_method(layer, name, configs.get(adapter))


def _check(name: str, init: object) -> None:
    if isinstance(init, str) and init.lower().startswith(REFUSED):
        raise ValueError(f"{name!r}: init_lora_weights={init!r} computes the adapter from data, gradients or a "
                         "quantized model as peft wraps it, which a model built under deferred_init() cannot give. "
                         "Build the model with its weights (from_pretrained) and run peft's initialization before "
                         "the engine, or choose True, 'gaussian', 'pissa', 'olora' or 'orthogonal'.")


def _factors(layer: nn.Module, name: str, adapter: str, init: object,
             read_base: ReadBase) -> None:
    _check(name, init)
    method = init.lower() if isinstance(init, str) else init
    if not _is_linear(layer) or method in (True, False, "gaussian"):
        getattr(layer, "reset_lora_parameters")(adapter, init)  # noqa: B009 - a method mypy sees as a Tensor
        return
    if isinstance(method, str) and method.startswith("pissa"):
        _base_weight(layer, read_base, changes=True)
        getattr(layer, "pissa_init")(adapter, init)  # noqa: B009
    elif method == "olora":
        _base_weight(layer, read_base, changes=True)
        getattr(layer, "olora_init")(adapter)  # noqa: B009
    elif method == "orthogonal":
        getattr(layer, "orthogonal_init")(adapter)  # noqa: B009
    else:
        raise ValueError(f"{name!r}: init_lora_weights={init!r} is not an initialization the engine knows; choose "
                         "True, False, 'gaussian', 'pissa', 'pissa_niter_N', 'olora' or 'orthogonal'.")


def computed_buffers(model: nn.Module) -> set[nn.Module]:
    """The modules whose buffers an adapter's initialization computes from the weights (trainable
    tokens' copy of their rows), which the engine's buffer pass leaves on the meta device."""
    return {getattr(m, "trainable_tokens_original") for m in model.modules()  # noqa: B009
            if _is_trainable_tokens(m) and getattr(m, "tied_adapter", None) is None}


def _is_trainable_tokens(layer: nn.Module) -> bool:
    return is_tuner_layer(layer) and isinstance(getattr(layer, "trainable_tokens_delta", None), nn.ParameterDict)


def _trainable_tokens(layer: nn.Module, adapter: str, config: object, read_base: ReadBase) -> None:
    """peft's TrainableTokensLayer.update_layer: the delta starts as the tokens' rows of the
    embedding (or as drawn, randn, with `init_weights=False`), and a copy of the rows is kept.
    A layer tied to another (an output head's) shares that one's, initialized there."""
    if getattr(layer, "tied_adapter", None) is not None:
        return
    _base_weight(layer, read_base, changes=False)
    base = getattr(layer, "get_base_layer")()  # noqa: B009
    rows = base.weight.detach()[getattr(layer, "token_indices")[adapter]]  # noqa: B009
    if getattr(config, "init_weights", True):  # (a LoraConfig's trainable_token_indices: peft's default, True)
        getattr(layer, "trainable_tokens_delta")[adapter].copy_(rows)  # noqa: B009
    getattr(layer, "trainable_tokens_original")[adapter] = rows.clone()  # noqa: B009


def _reset_other(layer: nn.Module, name: str, adapter: str, config: object) -> None:
    reset = _reset_method(layer, name, config)
    if reset is not None:
        getattr(layer, reset)(adapter)


def _reset_method(layer: nn.Module, name: str, config: object) -> str | None:
    """The method of an IA3, LoHa or LoKr layer that initializes an adapter as its config says
    (None: as drawn); ValueError for another adapter type."""
    if callable(getattr(layer, "reset_ia3_parameters", None)):
        return "reset_ia3_parameters" if getattr(config, "init_ia3_weights", True) else None
    if callable(getattr(layer, "reset_adapter_parameters", None)):  # LoHa, LoKr
        init = getattr(config, "init_weights", True)
        if init == "lycoris" and callable(getattr(layer, "reset_adapter_parameters_lycoris_way", None)):
            return "reset_adapter_parameters_lycoris_way"
        return "reset_adapter_parameters" if init else "reset_adapter_parameters_random"
    raise ValueError(f"{name!r}: the engine does not initialize peft's {_kind(config, layer)} adapters under "
                     "deferred_init() (it does LoRA, with DoRA, PiSSA or OLoRA, IA3, LoHa and LoKr). Build the "
                     "model with its weights (from_pretrained) before get_peft_model, which initializes them.")


def _kind(config: object, layer: nn.Module | None = None) -> str:
    """peft's name for an adapter type: its tuner's package for a layer (vera, boft,
    trainable_tokens, which a LoraConfig's `trainable_token_indices` adds), else the config's
    type (PREFIX_TUNING, ...)."""
    parts = type(layer).__module__.split(".") if layer is not None else []
    if "tuners" in parts[:-1]:
        return parts[parts.index("tuners") + 1]
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind or type(config).__name__))


def _is_linear(layer: nn.Module) -> bool:
    """peft's Linear LoRA layer (on nn.Linear and GPT-2's Conv1D), the one whose initialization
    can be computed from the base weight."""
    from peft.tuners.lora.layer import Linear  # peft is there: `layer` is one of its modules

    return isinstance(layer, Linear)


def _base_weight(layer: nn.Module, read_base: ReadBase, *, changes: bool) -> None:
    base = getattr(layer, "get_base_layer")()  # noqa: B009
    weight = base._parameters["weight"]
    assert weight is not None
    value = read_base(base, "weight", changes)
    if value is not None:
        base._parameters["weight"] = nn.Parameter(value.to(weight.dtype), requires_grad=weight.requires_grad)


def _factor_weights(layer: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    lora_a = getattr(layer, "lora_A")  # noqa: B009
    if adapter in lora_a:
        return lora_a[adapter].weight, getattr(layer, "lora_B")[adapter].weight  # noqa: B009
    return getattr(layer, "lora_embedding_A")[adapter], getattr(layer, "lora_embedding_B")[adapter]  # noqa: B009


def _scaling(layer: nn.Module, adapter: str) -> float:
    return float(getattr(layer, "scaling")[adapter])  # noqa: B009


def draw_as_peft(model: nn.Module, before: torch.Tensor) -> None:
    """Give a peft model's LoRA factors that are still on the meta device the values peft draws for
    them when the base weights are real, from the CPU generator state `before` (taken just before
    `get_peft_model`). peft, wrapping each targeted layer in module order, builds A and B as linear
    layers (a draw each) and then re-initializes them (`reset_lora_parameters`); on a meta base it
    makes the same draws and moves the results to the meta device. Replaying them here gives a
    model built under deferred_init() the adapters of a model built with its weights.

    Initializations computed from the base weight (PiSSA, OLoRA) and DoRA's magnitude are left to
    the engine, which reads the weights; a replay that does not end where peft's draws ended (a peft
    version that draws otherwise) is said once, and the generator is put back where peft left it."""
    after = torch.get_rng_state()
    configs = adapter_configs(model)
    drawn = 0
    torch.set_rng_state(before)
    with torch.no_grad():
        for layer in model.modules():
            if not (is_tuner_layer(layer) and is_lora_layer(layer)):
                continue
            for adapter, modules in getattr(layer, "lora_A").items():  # noqa: B009
                init = getattr(configs.get(adapter), "init_lora_weights", True)
                factors = [modules, getattr(layer, "lora_B")[adapter]]  # noqa: B009
                if not isinstance(modules, nn.Linear) or not (init in (True, False) or init == "gaussian"):
                    continue
                if not all(p.is_meta for f in factors for p in f.parameters()):
                    continue
                dtypes = [f.weight.dtype for f in factors]
                for f in factors:  # drawn in fp32 as peft's fresh layers are, then cast as peft moves them
                    f.weight = nn.Parameter(torch.empty(f.weight.shape, dtype=torch.float32),
                                            requires_grad=f.weight.requires_grad)
                    f.reset_parameters()
                getattr(layer, "reset_lora_parameters")(adapter, init)  # noqa: B009
                for f, dtype in zip(factors, dtypes, strict=True):
                    f.weight.data = f.weight.data.to(dtype)
                drawn += 1
    if drawn and not torch.equal(torch.get_rng_state(), after):
        log.warning("peft drew its LoRA adapters otherwise than outcore replays them: the %d adapters are "
                    "initialized as peft initializes them, but not with the values plain peft would draw "
                    "after the same seed", drawn)
    torch.set_rng_state(after)
