"""Row 8: a config value of the wrong kind is one ValueError naming its key, from code, a file or a
DeepSpeed config; `train` honours the config's optimizer section."""

import copy
import json

import pytest
import torch

import outcore
from outcore.runtime.config import Config
from outcore.tools.cli import main
from outcore.tools.gpt import GPT, PRESETS


@pytest.mark.parametrize("values, key", [
    ({"prefetch_depth": 2.5}, "prefetch_depth=2.5"), ({"grad_accumulation": 1.5}, "grad_accumulation=1.5"),
    ({"io": "fast"}, "io='fast'"), ({"nvme_dir": 5}, "nvme_dir=5"), ({"grad_clip": float("nan")}, "grad_clip=nan"),
    ({"grad_clip": float("inf")}, "grad_clip=inf"), ({"stage": True}, "stage=True"), ({"stage": 2.7}, "stage=2.7"),
    ({"unit_classes": "Block"}, "unit_classes='Block'"), ({"io": {"threads": "4"}}, "io.threads='4'"),
    ({"io": {"direct": 1}}, "io.direct=1"), ({"host_budget": [8]}, "host_budget=[8]"),
    ({"host_budget": "8 gigs"}, "host_budget='8 gigs'"), ({"io": {"block_size": "big"}}, "io.block_size='big'"),
    ({"optimizer": {"lr": float("nan")}}, "optimizer.lr=nan"), ({"optimizer": {"betas": 0.9}}, "optimizer.betas"),
    ({"dtype": None}, "dtype=None"),
])
def test_a_value_of_the_wrong_kind_names_its_key(values, key):
    with pytest.raises(ValueError) as e:
        Config.from_dict(values)
    assert str(e.value).startswith(key)


def test_integral_floats_and_paths_are_taken(tmp_path):
    c = Config.from_dict({"host_budget": 1e9, "sub_group_size": 1e6, "nvme_dir": tmp_path, "offload_optimizer": "nvme"})
    assert (c.host_budget, c.sub_group_size, c.nvme_dir) == (10**9, 10**6, str(tmp_path))
    assert type(c.host_budget) is int


GOOD_DS = {
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "sub_group_size": 1e6,
                          "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
                          "offload_optimizer": {"device": "cpu"}},
    "aio": {"block_size": 1048576, "queue_depth": 16, "thread_count": 2},
}


def _leaves(d, path=()):
    for k, v in d.items():
        yield path + (k,)
        if isinstance(v, dict):
            yield from _leaves(v, path + (k,))


def _malformed():
    for path in _leaves(GOOD_DS):
        for wrong in (5, True, "nvme", [1], 2.7):
            ds = copy.deepcopy(GOOD_DS)
            node = ds
            for k in path[:-1]:
                node = node[k]
            if node[path[-1]] == wrong or (isinstance(node[path[-1]], (int, float)) and wrong in (5,)):
                continue  # a plausible value, not a malformed one
            node[path[-1]] = wrong
            yield pytest.param(ds, id=".".join(path) + "=" + repr(wrong))


@pytest.mark.parametrize("ds", list(_malformed()))
def test_from_deepspeed_malformed_is_a_value_error_or_a_config(ds, caplog):
    """Each leaf of a good ds_config swapped for a value of another kind: a ValueError, or (where the
    new value is a legal one) a Config; never an AttributeError or TypeError."""
    try:
        Config.from_deepspeed(ds)
    except ValueError as e:
        assert str(e)


@pytest.mark.parametrize("ds, message", [
    ({"aio": 5}, "aio=5: must be a mapping"), ({"bf16": True}, "bf16=True: must be a mapping"),
    ({"zero_optimization": {"offload_param": "nvme"}}, "zero_optimization.offload_param='nvme'"),
    ({"zero_optimization": {"stage": 2.7}}, "zero_optimization.stage=2.7: must be a whole number"),
    ({"zero_optimization": {"stage": 0}}, "stage 1, 2 or 3"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both true"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping='1.0'"),
    ({"optimizer": {"params": {"betas": 0.9}}}, "optimizer.params.betas"),
    ([], "a mapping of sections"),
])
def test_from_deepspeed_names_the_malformed_key(ds, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Config.from_deepspeed(ds)


def test_a_bad_config_file_exits_2_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"prefetch_depth": 2.5}))
    assert main(["train", "--config", "run.json", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["outcore: prefetch_depth=2.5: must be a whole number."]


def test_train_honours_the_config_optimizer(tmp_path, monkeypatch):
    """lr 0 and weight decay 0 from the file: the weights do not move, so every evaluation of the same
    held-out batches gives the same loss (the defaults would lower it)."""
    from outcore.tools.train import TrainOptions, train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"stage": 3, "dtype": "fp32",
                                                   "optimizer": {"lr": 0.0, "weight_decay": 0.0}}))
    summary = train(TrainOptions(config="run.json", steps=3, batch=2, seq=32, eval_every=1, eval_batches=1,
                                 save_final=False),
                    report=lambda _: None)
    assert summary["config"]["optimizer"] == {"lr": 0.0, "weight_decay": 0.0}
    vals = [v for _, v in summary["val_losses"]]
    assert len(vals) == 3 and vals[0] == vals[1] == vals[2]
    assert summary["optimizer"]["lr"] == 0.0 and summary["optimizer"]["weight_decay"] == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_device_without_cuda_is_one_clear_error():
    with pytest.raises(ValueError, match="device='cuda', but (this torch is a CPU-only build|it sees no GPU); pass "
                                         "device='cpu'"):
        outcore.Engine(GPT(PRESETS["tiny"]), Config(), device="cuda")


@pytest.mark.cuda
def test_a_gpu_index_past_the_machines_gpus_is_one_clear_error():
    beyond = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"device '{beyond}': this machine shows {torch.cuda.device_count()} GPU"):
        outcore.Engine(GPT(PRESETS["tiny"]), Config(), device=beyond)


@pytest.mark.parametrize("arguments, words", [
    (lambda m: (m, {"stage": 3}, None), r"the config given \(dict\) is not an outcore.Config; .* Config.from_dict"),
    (lambda m: (m, Config(), torch.optim.AdamW(m.parameters(), lr=1e-3)),
     r"the optimizer given \(torch.optim.adamw.AdamW\) is not an outcore.AdamW. The engine runs its own fused "
     "AdamW .* set engine.lr before each step"),
    (lambda m: (m, Config(), torch.optim.SGD(m.parameters(), lr=1e-3)),
     r"\(torch.optim.sgd.SGD\) is not an outcore.AdamW"),
    (lambda m: (m.state_dict(), Config(), None),
     r"the model given \(collections.OrderedDict\) is not a torch.nn.Module"),
])
def test_arguments_of_the_wrong_kind_are_one_type_error_saying_what_to_pass(arguments, words):
    """As DeepSpeed's initialize takes them (a config dict, a torch optimizer): before, an
    AttributeError from deep in the engine."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TypeError, match=words) as e:
        outcore.Engine(*arguments(model))
    assert "\n" not in str(e.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model is as it was


@pytest.mark.parametrize("seed, error, words", [
    (2**32, ValueError, r"seed=4294967296\): a seed is a whole number from 0 to 2\*\*32 - 1"),
    (-1, ValueError, r"seed=-1\): a seed is a whole number"),
    (1.5, TypeError, r"the seed given \(float\) is not an int"),
    (True, TypeError, r"the seed given \(bool\) is not an int"),
])
def test_a_seed_out_of_range_is_refused_before_anything_is_built(seed, error, words):
    """Each unit's seed is derived from this one; before, 2**70 was an overflow in torch.manual_seed
    halfway through materializing the model."""
    with pytest.raises(error, match=words):
        outcore.Engine(torch.nn.Sequential(torch.nn.Linear(8, 8)), Config(), seed=seed)


def test_the_largest_seed_trains():
    def start() -> outcore.Engine:
        torch.manual_seed(0)  # the model's own init; the engine's seed is the one under test
        return outcore.Engine(torch.nn.Sequential(torch.nn.Linear(8, 8)), Config(), seed=2**32 - 1)

    engine, again = start(), start()
    before = engine.full_state_dict()
    assert all(torch.equal(v, again.full_state_dict()[k]) for k, v in before.items())  # the seed reproduces
    again.close()
    x = torch.randn(4, 8)
    engine.backward(engine(x).square().mean())
    stats = engine.step()
    after = engine.full_state_dict()
    engine.close()
    assert stats["skipped"] is False and engine.global_step == 1
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every parameter moved
