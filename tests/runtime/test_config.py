import dataclasses
import json
import logging
import tomllib

import pytest
import yaml

import outcore
from outcore.runtime.config import Config


def test_defaults_validate_and_io_dicts_become_ioconfig():
    c = Config(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_dir="/tmp/x",
               io={"block_size": 1 << 20, "threads": 8})
    assert isinstance(c.io, outcore.IOConfig) and c.io.threads == 8


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 4}, "stage=4"),
    ({"stage": 2, "offload_params": "cpu"}, "needs stage=3"),
    ({"offload_optimizer": "nvme"}, "nvme_dir is required"),
    ({"offload_params": "disk"}, "offload_params='disk'"),
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"grad_accumulation": 0}, "grad_accumulation"),
    ({"grad_clip": -1.0}, "grad_clip"),
    ({"io": {"block_size": 1000}}, "multiple of 4096"),
    ({"io": {"blocksize": 4096}}, "io: unknown key"),
    ({"optimizer": {"momentum": 0.9}}, "momentum"),
    ({"optimizer": {"lr": float("nan")}}, "optimizer.lr=nan"),
    ({"optimizer": {"eps": float("inf")}}, "optimizer.eps=inf"),
])
def test_mistakes_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


@pytest.mark.parametrize("hp, message", [
    ({"lr": float("nan")}, "AdamW.lr=nan"), ({"lr": "3e-4"}, "AdamW.lr='3e-4'"),
    ({"weight_decay": float("-inf")}, "AdamW.weight_decay=-inf"), ({"betas": (0.9, float("nan"))}, "AdamW.betas"),
])
def test_adamw_refuses_numbers_torch_would_not_train_with(hp, message):
    with pytest.raises(ValueError, match=message):
        outcore.AdamW(**hp)


def test_grad_clip_zero_means_no_clipping_as_in_deepspeed_and_transformers():
    assert Config(grad_clip=0).grad_clip is None
    assert Config(grad_clip=0.0).to_dict()["grad_clip"] is None


@pytest.mark.parametrize("ext, text", [
    (".json", json.dumps({"stage": 2, "offload_optimizer": "cpu", "dtype": "bf16", "io": {"threads": 2}})),
    (".yaml", "stage: 2\noffload_optimizer: cpu\ndtype: bf16\nio:\n  threads: 2\n"),
    (".toml", 'stage = 2\noffload_optimizer = "cpu"\ndtype = "bf16"\n[io]\nthreads = 2\n'),
])
def test_from_file_reads_json_yaml_toml(tmp_path, ext, text):
    p = tmp_path / f"run{ext}"
    p.write_text(text)
    c = Config.from_file(p)
    assert (c.stage, c.offload_optimizer, c.dtype, c.io.threads) == (2, "cpu", "bf16", 2)


def test_from_file_rejects_unknown_keys_and_bad_files(tmp_path):
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"stage": 3, "prefetch": 2}))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['prefetch'\]"):
        Config.from_file(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="does not parse"):
        Config.from_file(p)
    with pytest.raises(ValueError, match="cannot read"):
        Config.from_file(tmp_path / "missing.json")
    bad_yaml = tmp_path / "run.yaml"
    bad_yaml.write_text("stage: 3\noffload_params: [nvme\n")
    with pytest.raises(ValueError, match=r"does not parse: .*\(line 3, column 1\)$") as e:
        Config.from_file(bad_yaml)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=".toml"):
        Config.from_file(tmp_path / "run.ini")


@pytest.mark.parametrize("ext", ["json", "yaml", "yml", "toml"])
@pytest.mark.parametrize("nvme_dir", [True, False])
def test_to_file_writes_the_format_its_suffix_names_and_round_trips(tmp_path, ext, nvme_dir):
    c = Config(stage=3, offload_params="cpu", offload_optimizer="cpu", dtype="fp16", nvme_dir=None,
               unit_classes=("Block",), io={"block_size": 8 << 20, "queue_depth": 16}, grad_clip=None,
               optimizer={"lr": 1e-4, "betas": (0.9, 0.95)}, host_budget=3 << 30)
    if nvme_dir:
        c = dataclasses.replace(c, offload_optimizer="nvme", nvme_dir=str(tmp_path / 'a "quoted" dir'))
    path = tmp_path / f"c.{ext}"
    c.to_file(path)
    assert Config.from_file(path) == c
    text = path.read_text()
    if ext == "json":
        assert json.loads(text)["grad_clip"] is None
    else:  # the format's own syntax, not JSON (which YAML would also read)
        assert not text.startswith("{") and "stage" in (tomllib.loads(text) if ext == "toml" else yaml.safe_load(text))


def test_to_file_refuses_a_suffix_from_file_would_not_read(tmp_path):
    with pytest.raises(ValueError, match="use a .json, .yaml, .yml or .toml file"):
        Config().to_file(tmp_path / "c.txt")
    assert not (tmp_path / "c.txt").exists()


def test_from_deepspeed_translates_and_names_every_ignored_key_in_one_warning(caplog):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "overlap_comm": True,
                              "offload_param": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": True},
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
        "aio": {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 4, "single_submit": False},
    }
    with caplog.at_level(logging.WARNING):
        c = Config.from_deepspeed(ds)
    assert (c.stage, c.offload_params, c.offload_optimizer, c.nvme_dir) == (3, "nvme", "nvme", "/nvme")
    assert (c.dtype, c.grad_clip, c.grad_accumulation) == ("bf16", 1.0, 8)
    assert (c.io.block_size, c.io.queue_depth, c.io.threads) == (1 << 20, 16, 4)
    assert c.optimizer == {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    assert [r.message for r in caplog.records] == [
        "from_deepspeed: 5 setting(s) outcore does not use were ignored: train_micro_batch_size_per_gpu, "
        "optimizer.params.torch_adam, zero_optimization.offload_param.pin_memory, zero_optimization.overlap_comm, "
        "aio.single_submit"]


def test_from_deepspeed_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="AdamW only"):
        Config.from_deepspeed({"optimizer": {"type": "Lamb"}})
    with pytest.raises(ValueError, match="needs stage=3"):
        Config.from_deepspeed({"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}})


def test_from_deepspeed_reads_a_json_path_and_says_what_auto_became(tmp_path, caplog):
    ds = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.1}},
          "zero_optimization": {"stage": 3}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with caplog.at_level(logging.WARNING):
        c = Config.from_deepspeed(tmp_path / "ds.json")
    assert c == Config.from_deepspeed(str(tmp_path / "ds.json"))
    assert (c.stage, c.grad_accumulation, c.grad_clip, c.dtype) == (3, 1, 1.0, "fp32")
    assert c.optimizer == {"weight_decay": 0.1}
    assert {r.message for r in caplog.records if '"auto"' in r.message} == {  # the same for both calls
        'from_deepspeed: gradient_accumulation_steps, gradient_clipping, bf16.enabled, optimizer.params.lr are '
        '"auto", which the Hugging Face Trainer fills in from its own arguments; outcore took its own defaults '
        "(give values to choose)"}
    with pytest.raises(ValueError, match="cannot read DeepSpeed config .*no-such.json"):
        Config.from_deepspeed(tmp_path / "no-such.json")
    (tmp_path / "bad.json").write_text("{stage: 3")
    with pytest.raises(ValueError, match="bad.json' is not JSON"):
        Config.from_deepspeed(tmp_path / "bad.json")


def test_from_deepspeed_refuses_adam_with_l2_decay():
    """DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; that one is not what outcore runs."""
    assert Config.from_deepspeed({"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}).optimizer == {"lr": 1e-4}
    with pytest.raises(ValueError, match=r"adam_w_mode false decays weights as L2.*Use type \"AdamW\""):
        Config.from_deepspeed({"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False}}})


@pytest.mark.parametrize("ext, text", [
    (".json", '{"device_budget": "256M", "host_budget": "1.5G", "sub_group_size": "4M", "io": {"block_size": "8M"}}'),
    (".yaml", "device_budget: 256M\nhost_budget: 1.5G\nsub_group_size: 4M\nio:\n  block_size: 8M\n"),
    (".toml", 'device_budget = "256M"\nhost_budget = "1.5G"\nsub_group_size = "4M"\n[io]\nblock_size = "8M"\n'),
])
def test_a_config_file_takes_sizes_as_the_command_line_writes_them(tmp_path, ext, text):
    path = tmp_path / f"c{ext}"
    path.write_text(text)
    c = Config.from_file(path)
    assert (c.device_budget, c.host_budget, c.sub_group_size, c.io.block_size) == (256 << 20, 3 << 29, 4_000_000,
                                                                                   8 << 20)
    path.write_text(text.replace("256M", "256Q"))
    with pytest.raises(ValueError, match="device_budget='256Q': '256Q' is not a size"):
        Config.from_file(path)
