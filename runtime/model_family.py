"""What the engine asks of a model beyond `nn.Module`, answered per family of models.

The engine is model-agnostic: it pages any module's parameters. A few questions need knowledge of
the library a model comes from: the name its weight files give a parameter, how a module is
initialized again when built on the meta device, which parameters are adapters the files do not
hold, what an export writes beside the weights. `ModelFamily` asks them; this base class answers
for a plain PyTorch model, and `outcore.hf` answers for Hugging Face (transformers and peft) models.

Families are found by the finders given to `register_family` (outcore's own package registers the
Hugging Face one), so that runtime/ imports neither the Hugging Face libraries nor `outcore.hf`:
arrows point down only (tools → hf → runtime → offload).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

ReadBase = Callable[["nn.Module", str, bool], "torch.Tensor | None"]
"""`read_base(module, name, changes)`: a base weight's stored value (`weights=`), read once; None
where the module's own value stands. `changes`: the adapter's initialization will change it."""


class StoredPart(Protocol):
    """What is known of a stored tensor before it is read (runtime/pretrained.py's StoredTensor)."""

    @property
    def file(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> torch.dtype | None: ...


class ComposedTensor(StoredPart, Protocol):
    """A model tensor that a family builds from several stored ones (`ModelFamily.convert_names`)."""


class TensorMerge(Protocol):
    """An export's tensors computed from several of the model's (adapters merged into the weights
    they adapt): the names it writes, and each one's value from the gathered tensors it needs."""

    renamed: dict[str, str]

    def refuse_untying(self, tied: list[str]) -> None: ...
    def merged(self, name: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


class NewHead(Protocol):
    """Parameters a task model has outside the base model its weight files were saved from."""

    @property
    def model_class(self) -> str: ...
    @property
    def stored_class(self) -> str: ...

    def outside_base(self, name: str) -> bool: ...


AdapterFiles = tuple[dict[str, "torch.Tensor"], Callable[[str], None]]
"""An adapter export: its tensors by the names its library saves them under, and a call that writes
its config files into a directory."""


class ModelFamily:
    """The answers for a plain PyTorch model. Bound to one model (`self.model`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    # -- structure --------------------------------------------------------------------------------

    def inner(self) -> nn.Module:
        """The model whose names the weight files use and whose `generate()` runs (under an adapter
        wrapper, the model it wraps)."""
        return self.model

    def stored_name(self, name: str) -> str:
        """A state-dict name as the model's own weight files spell it."""
        return name

    def is_trained_copy(self, name: str) -> bool:
        """Whether `name` (a state-dict name) is a trained copy of a module the files hold once."""
        return False

    def has_adapters(self) -> bool:
        """Whether the model's trainable parameters are adapters the weight files do not hold."""
        return False

    def read_outside_forward(self) -> list[nn.Module]:
        """Modules whose parameters the model's code reads outside their own forward: they stay in the
        root unit, gathered while the root runs, never in a unit of their own."""
        return []

    def check(self) -> None:
        """Refuse, by name and before anything is read or written, what the engine cannot page or
        initialize in this model."""

    def split_sequence(self, loss_chunk: int | str | None, tile: int | str | None, free_memory: int) -> None:
        """Compute the loss over chunks of `loss_chunk` tokens and the MLPs over tiles of `tile`
        (`Config.loss_chunk_tokens`, `Config.tile_tokens`; "auto": chosen from the model's shape and
        `free_memory`). Only a family that knows the model's head and MLPs can."""
        if loss_chunk is not None or tile is not None:
            raise ValueError(f"{type(self.model).__name__}: loss_chunk_tokens and tile_tokens compute a Hugging Face "
                             "causal LM's loss and MLPs in pieces of the sequence; leave them None for this model.")

    # -- initialization ---------------------------------------------------------------------------

    def init_for(self, name: str) -> Callable[[nn.Module], None] | None:
        """The model's own initialization of module `name`, which recomputes its buffers; None where
        the module's `reset_parameters()` is all there is."""
        return None

    def adapter_layers(self, modules: Sequence[nn.Module]) -> list[nn.Module]:
        """Those of `modules` that carry adapters initialized from their base layer."""
        return []

    def drawn_adapter_parts(self, layers: Sequence[nn.Module]) -> tuple[set[nn.Module], set[nn.Module]]:
        """Of these adapter layers' modules: those first drawn from N(0, 1), and those computed only
        after their layer's other parts (`initialize_adapters`)."""
        return set(), set()

    def initialize_adapters(self, layer: nn.Module, name: str, fresh: set[nn.Module], read_base: ReadBase) -> None:
        """Initialize `layer`'s adapters whose parts are in `fresh` (just given memory)."""

    def computed_buffers(self) -> set[nn.Module]:
        """Modules whose buffers the adapters' initialization computes (left to it)."""
        return set()

    # -- weight files -----------------------------------------------------------------------------

    def convert_names(self, stored: dict[str, Any], wanted: set[str]) -> tuple[dict[str, Any], int]:
        """`stored` (by name) under the model's names where the family renames or merges stored
        tensors on load; returns them and how many were converted."""
        return dict(stored), 0

    def assemble(self, composed: ComposedTensor, read: Callable[[StoredPart], torch.Tensor]) -> torch.Tensor:
        raise AssertionError("only a family that composes tensors (convert_names) assembles them")

    def new_head(self, weights: str) -> NewHead | None:
        """The head this model puts on weight files saved from another architecture, if any."""
        return None

    def head_initializer(self, module: str, name: str, seed: int) -> Callable[[nn.Module], None]:
        raise ValueError(f"{module!r} is new to the weights, and a {type(self.model).__name__} has no initialization "
                         "for it; give the files of this model.")

    def vocabulary_names(self) -> set[str]:
        """State-dict names (as stored) of the parameters whose rows are the vocabulary."""
        return set()

    def kept_whole(self) -> set[nn.Module]:
        """Modules whose weights `Config.quantize` leaves in the compute dtype (an output head)."""
        return set()

    def read_settings(self, directory: str) -> None:
        """Take the settings stored beside the weights in `directory` (generation settings)."""

    # -- checkpoints and export -------------------------------------------------------------------

    def checkpoint_record(self, state_dict_keys: list[str]) -> dict[str, Any]:
        """What a checkpoint's meta.json keeps of the model, for an offline export to write again."""
        return {}

    def config_writer(self) -> Callable[[str], None] | None:
        """Writes the model's config files into an exported directory; None where there are none."""
        return None

    def adapter_merge(self, state_dict_keys: list[str]) -> TensorMerge:
        """How the adapters merge into the weights they adapt; asked only where `has_adapters()`."""
        raise AssertionError("a model without adapters has no merge: ask has_adapters() first")

    def adapter_tensors(self, adapters: dict[str, torch.Tensor]) -> AdapterFiles:
        """The adapters' tensors as the adapter library saves them, from the trainable parameters'
        gathered values by state-dict name, and a call that writes its config files; asked only where
        `has_adapters()`."""
        raise AssertionError("a model without adapters has none to export: ask has_adapters() first")


FamilyFinder = Callable[["nn.Module"], "ModelFamily | None"]
_finders: list[FamilyFinder] = []


def register_family(finder: FamilyFinder) -> None:
    """Add a finder: given a model, the family that answers for it, or None where it is not one."""
    if finder not in _finders:
        _finders.append(finder)


def family_of(model: nn.Module) -> ModelFamily:
    """The family of the first finder that knows `model`, else the plain PyTorch one."""
    for finder in _finders:
        family = finder(model)
        if family is not None:
            return family
    return ModelFamily(model)
