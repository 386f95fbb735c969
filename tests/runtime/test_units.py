"""The unit planner: which modules move together and which unit owns each parameter (no engine)."""

from collections import OrderedDict

import pytest
import torch
from models import TinyGPT
from torch import nn

from outcore.runtime.units import plan_units


def names(plans):
    return [p.name for p in plans]


def test_the_repeated_blocks_are_units_and_the_root_unit_comes_last():
    plans = plan_units(TinyGPT(layers=3))  # tied head: the embedding is shared, so it stays in the root
    assert names(plans) == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert [p.index for p in plans] == [0, 1, 2, 3]
    root = plans[-1]
    owned = {n for s in root.slots for n in s.state_dict_names}
    assert owned == {"tok.weight", "head.weight", "pos.weight", "ln_f.weight", "ln_f.bias"}


def test_a_tied_weight_is_owned_once_with_every_place_it_is_registered():
    model = TinyGPT()
    root = plan_units(model)[-1]
    tied = [s for s in root.slots if "tok.weight" in s.state_dict_names]
    assert len(tied) == 1
    assert tied[0].state_dict_names == ["tok.weight", "head.weight"]
    assert {(type(m).__name__, n) for m, n in tied[0].places} == {("Embedding", "weight"), ("Linear", "weight")}


def test_a_module_outside_the_blocks_as_large_as_one_is_a_unit_of_its_own():
    model = TinyGPT(vocab=4096, tied=False)  # untied: the head and the embedding each outweigh a block
    plans = plan_units(model)
    assert names(plans) == ["tok", "blocks.0", "blocks.1", "blocks.2", "head", ""]
    assert [p.outer for p in plans] == [True, False, False, False, True, False]
    assert not any(p.outer for p in plan_units(model, ("MultiheadAttention",)))  # named classes: no such units


def test_every_parameter_is_owned_by_exactly_one_unit():
    model = TinyGPT(vocab=4096, tied=False)
    owned = [n for p in plan_units(model) for s in p.slots for n in s.state_dict_names]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())


def test_unit_classes_name_the_units_and_the_rest_is_the_root():
    model = TinyGPT(vocab=4096, tied=False)
    assert names(plan_units(model, ("MultiheadAttention",))) == [f"blocks.{i}.attn" for i in range(3)] + [""]
    with pytest.raises(ValueError, match="matches no module"):
        plan_units(model, ("NoSuchBlock",))


def test_a_model_without_repeated_blocks_is_one_root_unit():
    plans = plan_units(nn.Sequential(nn.Linear(4, 4)))  # one child: no list of blocks to split
    assert names(plans) == [""] and plans[0].numel == 20


def test_a_lazy_module_is_named_before_anything_is_laid_out():
    model = nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"lazy modules: 0\.weight, 0\.bias\): run one forward on a sample input"):
        plan_units(model)
    model(torch.randn(2, 5))  # shapes known now: the same model is planned
    assert [s.shape for u in plan_units(model) for s in u.slots] == [(8, 5), (8,), (1, 8), (1,)]


def test_a_module_registered_in_two_blocks_is_owned_once_by_the_root_unit():
    model = TinyGPT(layers=3)
    model.blocks[2].mlp = model.blocks[0].mlp  # layers sharing a submodule
    plans = plan_units(model)
    shared = [s for u in plans for s in u.slots if "blocks.0.mlp.0.weight" in s.state_dict_names]
    assert len(shared) == 1 and shared[0].state_dict_names == ["blocks.0.mlp.0.weight", "blocks.2.mlp.0.weight"]
    owners = [u for u in plans if shared[0] in u.slots]
    assert len(owners) == 1 and owners[0].root
    assert not [s for u in plans if u.name in ("blocks.0", "blocks.2") for s in u.slots
                if any(".mlp." in n for n in s.state_dict_names)]
    model = TinyGPT(layers=3)
    model.norm_again = model.blocks[1].ln1  # also registered outside any block
    owners = [u for u in plan_units(model) for s in u.slots if "blocks.1.ln1.weight" in s.state_dict_names]
    assert len(owners) == 1 and owners[0].root


def test_another_name_for_the_blocks_changes_no_unit():
    plain, aliased = TinyGPT(layers=3), TinyGPT(layers=3)
    aliased.layers = aliased.blocks  # as some models keep a second attribute for their layer list

    def owned(model):
        return [(u.name, sorted(n for s in u.slots for n in s.state_dict_names if not n.startswith("layers.")))
                for u in plan_units(model)]

    assert owned(aliased) == owned(plain)


def test_an_integer_parameter_is_refused_and_a_float64_one_is_said(caplog):
    """An integer parameter was cast into the float unit and failed far away (an IndexError in the
    forward that used it as indices); float64 ones train at fp32 precision, which the log says."""
    model = TinyGPT(layers=2)
    model.blocks[1].order = nn.Parameter(torch.arange(4), requires_grad=False)
    with pytest.raises(ValueError, match=r"parameter 'blocks.1.order' is torch.int64: .*register_buffer"):
        plan_units(model)
    model = TinyGPT(layers=2)
    model.blocks[0].gain = nn.Parameter(torch.ones(4, dtype=torch.float64))
    with caplog.at_level("WARNING", logger="outcore.runtime.units"):
        plan_units(model)
    assert [r.getMessage() for r in caplog.records] == [
        "1 float64 parameter(s) (blocks.0.gain) are trained in Config.dtype with fp32 master weights, not in float64"]


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)


class MoeLayer(nn.Module):  # a mixture of experts: a list of experts inside every layer
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.experts = nn.ModuleList(Expert() for _ in range(4))


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.block = nn.ModuleList(MoeLayer() for _ in range(layers))


class EncoderDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(32, 8)
        self.encoder, self.decoder = Stack(3), Stack(2)


def test_the_blocks_are_the_outermost_lists_of_repeated_blocks_in_every_stack():
    """Both stacks of an encoder-decoder, and the layers rather than the experts inside each: the
    deepest list alone (layer 0's experts) left the decoder one unit of half the model."""
    plans = plan_units(EncoderDecoder())
    assert names(plans) == [f"encoder.block.{i}" for i in range(3)] + [f"decoder.block.{i}" for i in range(2)] + [""]
    assert {n for s in plans[-1].slots for n in s.state_dict_names} == {"shared.weight"}


def test_a_sequential_model_of_blocks_is_split_by_its_children_under_their_own_names():
    blocks = [(f"layer{i}", nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))) for i in range(3)]
    model = nn.Sequential(OrderedDict([("embed", nn.Embedding(16, 8)), *blocks, ("head", nn.Linear(8, 16))]))
    assert names(plan_units(model)) == ["embed", "layer0", "layer1", "layer2", "head"]  # nothing left for a root
    stack = nn.Sequential(nn.Embedding(16, 8), nn.Sequential(*(b for _, b in blocks)), nn.Linear(8, 16))
    assert names(plan_units(stack)) == ["1.0", "1.1", "1.2", "2", ""]  # not a list of blocks: its inner one is


def test_a_model_without_a_list_of_blocks_is_said_once_to_be_one_unit(caplog):
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    with caplog.at_level("WARNING", logger="outcore.runtime.units"):
        assert names(plan_units(Flat())) == [""]
    assert [r.message for r in caplog.records if "no list of repeated blocks" in r.message] == [
        "Flat has no list of repeated blocks: it is one unit, gathered whole for every step. Name its block "
        "classes in Config.unit_classes to page it in parts."]


def test_a_hybrid_of_three_kinds_of_layer_is_still_a_list_of_blocks():
    kinds = [nn.Linear, nn.Bilinear, nn.Conv1d]
    make = {nn.Linear: lambda: nn.Linear(8, 8), nn.Bilinear: lambda: nn.Bilinear(8, 8, 8),
            nn.Conv1d: lambda: nn.Conv1d(8, 8, 3)}

    class Hybrid(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(make[kinds[i % 3]]() for i in range(6))

    assert names(plan_units(Hybrid())) == [f"layers.{i}" for i in range(6)]


def test_a_module_dict_of_blocks_is_a_list_of_blocks_too():
    class Titan(nn.Module):  # torchtitan's Llama keeps its layers in a ModuleDict keyed "0", "1", ...
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(4, 8)  # smaller than a layer: the root keeps it
            self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(3)})

    assert names(plan_units(Titan())) == ["layers.0", "layers.1", "layers.2", ""]
