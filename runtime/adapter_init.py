"""peft's LoRA adapters initialized as peft does it, for a model wrapped under deferred_init().

peft initializes an adapter as it wraps the model. On the meta device there is nothing to compute
from, so the engine runs the same initialization, with peft's own methods, as each unit is
materialized (runtime/materialize.py), for the adapters that are still without values:

- A and B as `init_lora_weights` says: True (A like a linear layer, B zero, so the adapted model
  starts as the base model), "gaussian", or False (both as the linear layers they are).
- From the weight W they adapt: PiSSA (A and B from W's principal singular vectors, exact or
  `pissa_niter_N`), OLoRA (from W's QR). Both subtract B·A from W, so that W + B·A starts as W: the
  frozen base the engine then holds is that residual, as peft's would be. DoRA's magnitude (the norm
  of each of W's rows, with the adapter's update) is computed from W too, after A and B.
  For these, W is read (from `weights=`) into its module first; its unit takes it from there
  (`read_base`), so it is read once. A tied W (one parameter under two names) is refused by name.
- "orthogonal": A and B drawn from one random orthogonal matrix.

Initializations that need data, gradients or a quantized model (EVA, CorDA, LoRA-GA, LoftQ, MiCA)
are refused by name: build the model with its weights and let peft run them.
peft's layers other than Linear (Embedding, convolutions) take the plain initialization for every
`init_lora_weights` that is not theirs, as peft's own `update_layer` for them does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ReadBase = Callable[[nn.Module, str], "torch.Tensor | None"]
"""A base weight's stored value (`weights=`), read once; None where the module's own value stands."""
REFUSED = ("eva", "corda", "lora_ga", "loftq", "mica")  # peft computes these from data or a quantized model


def adapter_inits(model: nn.Module) -> dict[str, object]:
    """Each adapter's `init_lora_weights`, by adapter name ({} for a model peft does not wrap)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return {}
    return {name: getattr(config, "init_lora_weights", True) for name, config in configs.items()}


def is_lora_layer(m: nn.Module) -> bool:
    return callable(getattr(m, "reset_lora_parameters", None)) and isinstance(getattr(m, "lora_A", None),
                                                                              nn.ModuleDict)


def lora_parts(layer: nn.Module) -> dict[str, list[nn.Module]]:
    """A peft LoRA layer's adapters and the modules that hold their factors: `lora_A[adapter]` of a
    linear layer, the `lora_embedding_A/B` parameter dicts of an embedding."""
    parts: dict[str, list[nn.Module]] = {}
    for name in ("lora_A", "lora_embedding_A", "lora_embedding_B"):
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


def initialize_adapters(layer: nn.Module, name: str, fresh: set[nn.Module], inits: dict[str, object],
                        read_base: ReadBase) -> None:
    """Initialize `layer`'s adapters whose factors or DoRA magnitude are in `fresh` (just given
    memory), as peft's `update_layer` does. `name` is the layer's, for errors; `read_base(module,
    "weight")` gives a base weight's stored value before an initialization computes from it."""
    for adapter, parts in lora_parts(layer).items():
        init = inits.get(adapter, True)
        if any(c in fresh for part in parts for c in part.modules()):
            _factors(layer, name, adapter, init, read_base)
        magnitude = magnitudes(layer).get(adapter)
        if magnitude is not None and magnitude in fresh:
            _base_weight(layer, read_base)
            a, b = _factor_weights(layer, adapter)
            update = getattr(magnitude, "update_layer")  # noqa: B009 - a method mypy sees as a Tensor
            update(base_layer=getattr(layer, "get_base_layer")(), lora_A=a, lora_B=b,  # noqa: B009
                   scaling=_scaling(layer, adapter))


def check_adapter_inits(model: nn.Module) -> None:
    """Refuse, before anything is read or written, an adapter still on the meta device whose
    initialization needs what the engine does not have (data, gradients, a quantized model)."""
    inits = adapter_inits(model)
    for name, layer in model.named_modules():
        if is_lora_layer(layer):
            for adapter, parts in lora_parts(layer).items():
                if any(p.is_meta for part in parts for p in part.parameters()):
                    _check(name, inits.get(adapter, True))


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
        _base_weight(layer, read_base)
        getattr(layer, "pissa_init")(adapter, init)  # noqa: B009
    elif method == "olora":
        _base_weight(layer, read_base)
        getattr(layer, "olora_init")(adapter)  # noqa: B009
    elif method == "orthogonal":
        getattr(layer, "orthogonal_init")(adapter)  # noqa: B009
    else:
        raise ValueError(f"{name!r}: init_lora_weights={init!r} is not an initialization the engine knows; choose "
                         "True, False, 'gaussian', 'pissa', 'pissa_niter_N', 'olora' or 'orthogonal'.")


def _is_linear(layer: nn.Module) -> bool:
    """peft's Linear LoRA layer (on nn.Linear and GPT-2's Conv1D), the one whose initialization
    can be computed from the base weight."""
    from peft.tuners.lora.layer import Linear  # peft is there: `layer` is one of its modules

    return isinstance(layer, Linear)


def _base_weight(layer: nn.Module, read_base: ReadBase) -> None:
    base = getattr(layer, "get_base_layer")()  # noqa: B009
    weight = base._parameters["weight"]
    assert weight is not None
    value = read_base(base, "weight")
    if value is not None:
        base._parameters["weight"] = nn.Parameter(value.to(weight.dtype), requires_grad=weight.requires_grad)


def _factor_weights(layer: nn.Module, adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
    lora_a = getattr(layer, "lora_A")  # noqa: B009
    if adapter in lora_a:
        return lora_a[adapter].weight, getattr(layer, "lora_B")[adapter].weight  # noqa: B009
    return getattr(layer, "lora_embedding_A")[adapter], getattr(layer, "lora_embedding_B")[adapter]  # noqa: B009


def _scaling(layer: nn.Module, adapter: str) -> float:
    return float(getattr(layer, "scaling")[adapter])  # noqa: B009
