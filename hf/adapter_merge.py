"""A peft LoRA model's tensors as its base model's, with the adapters merged into the weights they
adapt: what `peft`'s `merge_and_unload()` followed by `save_pretrained` writes, computed one unit at
a time so that the model is never whole in memory.

[Note: merged export] peft wraps each adapted module in a tuner layer: the base module moves to
`<module>.base_layer`, the adapter's factors sit beside it (`lora_A`, `lora_B`, or
`lora_embedding_A/B`), and a module trained whole (`modules_to_save`) keeps its original and a copy
per adapter. Merging reads, from the peft model's structure alone (it may be on the meta device),
which tensor each base name comes from, which tensors are dropped, and what adds to a weight:
`transpose(B @ A, fan_in_fan_out) * scaling` for each active adapter, and with `lora_bias` also
`B.bias * scaling` to the bias, in the order peft's merge adds them. Each is computed in fp32
(peft keeps adapters in fp32 under a bf16 or fp16 base) and rounded into the base tensor's dtype as
peft does it: once with the sum for a Linear layer, first on its own for an Embedding. A module and
its adapter sit in the same unit (the adapter is the module's child), so a unit and its frozen
sibling hold all that a merged tensor needs. DoRA on a Linear layer (one adapter) rescales the sum
instead: each output row of W + delta is multiplied by its magnitude over its norm, in fp32, then
rounded once, as peft's merge does. Trainable tokens (`trainable_token_indices`) replace their rows
of the embedding (or head) they wrap, as peft's `index_copy` does. Variants whose merge is none of
these (DoRA on other layers, the other `lora_variant`s, convolutions, attention) are refused by
module name before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from outcore.hf.model_info import is_peft, wrapped_model


@dataclass(frozen=True, slots=True)
class Contribution:
    """One adapter's addition to a base tensor: `transpose(b @ a) * scaling` (a weight), or
    `b * scaling` (a bias, `a` then None). Names are the peft model's state-dict names."""

    a: str | None
    b: str
    scaling: float
    transpose: bool = False
    rounded: bool = False  # rounded to the base's dtype before it is added, as peft merges an Embedding's


@dataclass(slots=True)
class AdapterMerge:
    """How each of a peft model's state-dict names becomes a base model name (`renamed`; absent when
    the tensor is an adapter's and is dropped), and what adds to each merged base tensor."""

    renamed: dict[str, str] = field(default_factory=dict)
    added: dict[str, list[Contribution]] = field(default_factory=dict)
    rescaled: dict[str, str] = field(default_factory=dict)  # a DoRA weight -> its magnitude's name
    replaced: dict[str, list[tuple[str, list[int]]]] = field(default_factory=dict)  # -> (rows' values, row indices)

    def refuse_untying(self, tied: list[str]) -> None:
        """A ValueError where an adapter adapts one of the `tied` names (one parameter's): merging
        it would untie them. A parameter of one name is tied to nothing."""
        for name in tied if len(tied) > 1 else ():
            if name in self.added:
                other = next(n for n in tied if n != name)
                raise ValueError(f"merging adapters: {self.renamed[name]!r} is tied to "
                                 f"{self.renamed.get(other, other)!r}, and merging the adapters on it would untie "
                                 "them; export the adapters instead (adapters_only=True).")

    def to_dict(self) -> dict:
        """For a checkpoint's meta.json, from which `outcore export --merge-adapters` merges offline."""
        return {"renamed": self.renamed,
                "added": {k: [[c.a, c.b, c.scaling, c.transpose, c.rounded] for c in cs]
                          for k, cs in self.added.items()},
                "rescaled": self.rescaled,
                "replaced": {k: [[delta, rows] for delta, rows in rs] for k, rs in self.replaced.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> AdapterMerge:
        return cls(dict(d["renamed"]), {k: [Contribution(a, b, float(s), bool(t), bool(r)) for a, b, s, t, r in cs]
                                        for k, cs in d["added"].items()},
                   dict(d.get("rescaled", {})),  # (checkpoints before DoRA merged have none)
                   {k: [(delta, list(rows)) for delta, rows in rs] for k, rs in d.get("replaced", {}).items()})

    def changes(self, name: str) -> bool:
        """Whether the merge changes the peft tensor `name` (else it is written as it is)."""
        return name in self.added or name in self.replaced

    def inputs(self, name: str) -> list[str]:
        """The tensors besides `name` that its merged value reads: its adapters' factors, a DoRA magnitude."""
        factors = [n for c in self.added.get(name, ()) for n in (c.a, c.b) if n is not None]
        rows = [delta for delta, _ in self.replaced.get(name, ())]
        return factors + ([self.rescaled[name]] if name in self.rescaled else []) + rows

    def merged(self, name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The value of the peft tensor `name` after the merge, from `tensors`, which holds it and
        its adapters' factors (CPU tensors, left as they are: a merged tensor is a new one)."""
        value = tensors[name]
        if name in self.replaced:
            value = value.clone()
            for values, rows in self.replaced[name]:
                value[rows] = tensors[values].to(value.dtype)
            return value
        if name not in self.added:
            return value
        if name in self.rescaled:
            return _dora(value, self.added[name][0], tensors[self.rescaled[name]], tensors)
        value = value.clone()
        for c in self.added[name]:
            delta = _delta(c, tensors)
            value.add_(delta.to(value.dtype) if c.rounded else delta)
        return value


def _delta(c: Contribution, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """In fp32 whatever the factors' dtype, as peft computes it from the fp32 adapters it keeps under
    a bf16 or fp16 base (`autocast_adapter_dtype`); `AdapterMerge.merged` rounds it."""
    b = tensors[c.b].float()
    if c.a is None:
        return b * c.scaling
    product = b @ tensors[c.a].float()
    return (product.T if c.transpose else product) * c.scaling


def _dora(weight: torch.Tensor, c: Contribution, magnitude: torch.Tensor,
          tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """peft's DoRA merge: W + delta with each output row scaled to its magnitude, in fp32 (the
    factors' dtype) and rounded once to W's."""
    total = weight + _delta(c, tensors)  # promoted to fp32, as peft adds an fp32 delta to a bf16 weight
    norm = torch.linalg.norm(total.T if c.transpose else total, dim=1)
    factor = (magnitude.float() / norm).view(-1, 1)
    return ((factor.T if c.transpose else factor) * total).to(weight.dtype)


def adapter_merge(peft_model: nn.Module, names: list[str]) -> AdapterMerge:
    """The merge of `peft_model`'s active adapters into its base model, for its state-dict `names`;
    a ValueError naming the module where an adapter's merge is not a plain LoRA sum."""
    from peft.tuners.lora import Embedding, Linear, LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import other

    ModulesToSaveWrapper = other.ModulesToSaveWrapper
    TrainableTokensWrapper = getattr(other, "TrainableTokensWrapper", ())  # (peft >= 0.15)
    wrappers = (getattr(other, "AuxiliaryTrainingWrapper", ModulesToSaveWrapper), BaseTunerLayer)  # (peft < 0.15)

    base = wrapped_model(peft_model)
    prefix = next(name for name, m in peft_model.named_modules() if m is base)
    prefix = prefix + "." if prefix else ""
    merge = AdapterMerge()
    moved: dict[str, str] = {}  # module path in the peft model -> the path its tensors take
    dropped: set[str] = set()  # module paths whose tensors are adapters'
    for path, module in peft_model.named_modules():
        if not path.startswith(prefix) or path in dropped or any(a in dropped for a in _ancestors(path)):
            continue
        if isinstance(module, TrainableTokensWrapper):
            tokens = getattr(module, "token_adapter")  # noqa: B009
            if isinstance(tokens.get_base_layer(), BaseTunerLayer):
                raise _refused(path, prefix, f"TrainableTokens (over {type(tokens.get_base_layer()).__name__})")
            moved[f"{path}.token_adapter.base_layer"] = path
            dropped.add(f"{path}.token_adapter")
            merge.replaced[f"{path}.token_adapter.base_layer.weight"] = [
                (f"{path}.token_adapter.trainable_tokens_delta.{a}", list(tokens.token_indices[a]))
                for a in tokens.active_adapters if a in tokens.token_indices]
        elif isinstance(module, ModulesToSaveWrapper):
            _refuse_tuner_inside(module, path[len(prefix):], BaseTunerLayer)
            active = list(module.active_adapters)
            moved[f"{path}.modules_to_save.{active[0]}" if active else f"{path}.original_module"] = path
            dropped.update(f"{path}.{n}" for n, _ in module.named_children())
        elif isinstance(module, wrappers) and not isinstance(module, LoraLayer):
            raise _refused(path, prefix, type(module).__name__)
        elif isinstance(module, LoraLayer):
            variants = _variants(module)
            if type(module) not in (Linear, Embedding) or (variants and not _merged_dora(module, variants)):
                raise _refused(path, prefix, ", ".join(variants) or type(module).__name__)
            moved[f"{path}.base_layer"] = path
            dropped.update(f"{path}.{n}" for n in _children(module) if n != "base_layer")
            _plan_contributions(merge, module, path, prefix, embedding=isinstance(module, Embedding))
    for name in names:
        new: str | None = name
        for ancestor in _ancestors(name):  # the innermost first: a kept copy sits inside a dropped wrapper part
            if ancestor in moved:
                new = moved[ancestor] + name[len(ancestor):]
                break
            if ancestor in dropped:
                new = None
                break
        if new is None:
            continue
        if not new.startswith(prefix):
            raise ValueError(f"merging adapters: {name!r} is not in the base model peft wraps ({prefix[:-1]!r}); "
                             "only a LoRA model's tensors can be merged into its base model.")
        merge.renamed[name] = new[len(prefix):]
    if len(set(merge.renamed.values())) != len(merge.renamed):
        raise ValueError("merging adapters: two of the peft model's tensors would take one base-model name; "
                         "export the adapters instead (adapters_only=True).")
    return merge


def merge_record(model: nn.Module, names: list[str]) -> dict[str, dict]:
    """A checkpoint's record of how a peft model's adapters merge (`AdapterMerge.to_dict`), or of
    why they cannot (`{"refused": the error}`); nothing for any other model."""
    if not is_peft(model):
        return {}
    try:
        return {"adapter_merge": adapter_merge(model, names).to_dict()}
    except ValueError as e:
        return {"adapter_merge": {"refused": str(e)}}


def _ancestors(path: str) -> list[str]:
    """The module paths that hold `path`, the innermost first ("a.b.c" -> "a.b", "a")."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _plan_contributions(merge: AdapterMerge, layer: Any, path: str, prefix: str, *, embedding: bool) -> None:
    """What `layer` (a peft LoRA Linear or Embedding at `path`) adds to its base tensors."""
    weight, bias = f"{path}.base_layer.weight", f"{path}.base_layer.bias"
    for adapter in layer.active_adapters:
        factors = layer.lora_embedding_A if embedding else layer.lora_A
        if adapter not in factors:
            continue
        scaling = float(layer.scaling[adapter])
        if embedding:
            a, b = f"{path}.lora_embedding_A.{adapter}", f"{path}.lora_embedding_B.{adapter}"
            merge.added.setdefault(weight, []).append(Contribution(a, b, scaling, transpose=True, rounded=True))
            continue
        a, b = f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight"
        transpose = bool(layer.fan_in_fan_out)
        merge.added.setdefault(weight, []).append(Contribution(a, b, scaling, transpose))
        if adapter in getattr(layer, "lora_magnitude_vector", {}):
            merge.rescaled[weight] = f"{path}.lora_magnitude_vector.{adapter}.weight"
        if getattr(layer, "lora_bias", {}).get(adapter, False):  # (peft >= 0.14)
            if getattr(layer.base_layer, "bias", None) is None:
                raise ValueError(f"merging adapters: {path[len(prefix):]!r} has lora_bias but its base layer has no "
                                 "bias to merge it into; export the adapters instead (adapters_only=True).")
            merge.added.setdefault(bias, []).append(Contribution(None, f"{path}.lora_B.{adapter}.bias", scaling))


def _variants(layer: Any) -> list[str]:
    """The LoRA variants (DoRA, ...) `layer`'s adapters use: peft's `lora_variant`, or `use_dora` before it."""
    variants = [type(v).__name__ for v in getattr(layer, "lora_variant", {}).values()]
    return variants or ["DoRA" for used in getattr(layer, "use_dora", {}).values() if used][:1]


def _merged_dora(layer: Any, variants: list[str]) -> bool:
    """Whether `layer` is a Linear layer with one adapter, DoRA's, whose merge `_dora` computes."""
    from peft.tuners.lora import Linear

    return (type(layer) is Linear and variants in (["DoraLinearVariant"], ["DoRA"]) and len(layer.lora_A) == 1
            and len(layer.active_adapters) == 1)


def _children(module: Any) -> list[str]:
    return [name for name, _ in module.named_children()]  # (peft's layers are modules its types do not say are)


def _refuse_tuner_inside(wrapper: nn.Module, path: str, tuner: type) -> None:
    for name, m in wrapper.named_modules():
        if isinstance(m, tuner):
            raise ValueError(f"merging adapters: {path}.{name} is an adapter inside a module trained whole "
                             "(modules_to_save); export the adapters instead (adapters_only=True).")


def _refused(path: str, prefix: str, kind: str) -> ValueError:
    return ValueError(f"merging adapters: {path[len(prefix):]!r} is a {kind} adapter, whose merge outcore does "
                      "not compute (it merges LoRA on Linear, Conv1D and Embedding layers, and DoRA with one "
                      "adapter on Linear and Conv1D); export the adapters "
                      "instead (adapters_only=True) and merge them with peft's merge_and_unload.")
