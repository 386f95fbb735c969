"""Round 4, items 3, 6 and 7 and the small ones on numbers: a size past any machine, a fraction of a
byte, another script's digits, a step count past any run, a YAML alias bomb under a known key and
weights whose sum overflows: each one line naming the flag or key, exit 2, in bounded time."""

import json
import time

import pytest

from outcore.hf.data_mix import FileSamples, data_file, mixed
from outcore.hf.sft_rows import Sample
from outcore.runtime.config import Config
from outcore.tools.cli import main


def refused(capsys, argv, said):
    try:
        code = main(argv)
    except SystemExit as e:  # a flag's own type refused it, as argparse exits
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err


@pytest.mark.parametrize("value, said", [
    ("1e308K", "'1e308K' is past any machine's memory or disk (at most 1.0 EiB)"),
    ("٢٥٦M", "'٢٥٦M' is not a size"),
    ("0.5", "'0.5' is not a whole number of bytes"),
])
def test_a_size_that_is_not_one_is_refused_on_the_command_line(tmp_path, capsys, value, said):
    refused(capsys, ["train", "--device-budget", value, "--out", str(tmp_path / "r")], "--device-budget: " + said)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value, said", [
    ("1e308K", "host_budget='1e308K': '1e308K' is past any machine's memory"),
    (10**400, "...0000000000000000000: must be a positive number of bytes up to"),
], ids=["text", "int"])
def test_a_size_that_overflows_in_a_config_file_names_its_key(tmp_path, capsys, value, said):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"host_budget": value}))
    refused(capsys, ["train", "--config", str(path), "--steps", "1", "--out", str(tmp_path / "r")], said)


def test_half_a_kilobyte_is_a_size():
    assert Config.from_dict({"host_budget": "0.5K"}).host_budget == 512


@pytest.mark.parametrize("flags, said", [
    (["--steps", "1" + "0" * 30], "--steps: '1000000000000000000000000000000' is not a whole number of at least 1 "
     "and at most 1,000,000,000"),
    (["--steps", "٣"], "--steps: '٣' is not a whole number"),
    (["--batch", "٢"], "--batch: '٢' is not a whole number"),
])
def test_a_step_count_past_any_run_or_in_other_digits_is_refused(tmp_path, capsys, flags, said):
    refused(capsys, ["train", *flags, "--out", str(tmp_path / "r")], said)


BOMB = "[" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else '"x"'] * 9) + "]" for i in range(9)) + "]"


@pytest.mark.parametrize("key", ["unit_classes", "optimizer"])
def test_a_yaml_alias_bomb_under_a_known_key_is_refused_at_once(tmp_path, capsys, key):
    path = tmp_path / "bomb.yaml"
    value = BOMB if key == "unit_classes" else "{betas: " + BOMB + "}"
    path.write_text(f"{key}: {value}\n")
    assert len(path.read_bytes()) < 1000  # 9 ** 9 strings once expanded
    start = time.perf_counter()
    refused(capsys, ["train", "--config", str(path), "--out", str(tmp_path / "r")],
            f"{key} holds more than 10,000 values (a YAML alias repeats what it names)")
    assert time.perf_counter() - start < 20


def test_an_error_quotes_at_most_200_characters_of_a_value():
    with pytest.raises(ValueError) as e:
        Config(unit_classes=[["x"] * 1000] * 1000)  # type: ignore[arg-type]
    assert len(str(e.value)) < 300 and str(e.value).startswith("unit_classes=[[")


def test_weights_whose_sum_overflows_draw_from_every_file():
    files = [FileSamples(name, "text", [Sample([i, i], [i, i]) for i in range(200)], 1e308) for name in "ab"]
    _, counts = mixed(files, seed=0)
    assert min(counts) > 60, counts  # 200 each expected; only b was drawn before


@pytest.mark.parametrize("spec", ["data.jsonl:٢", "data.jsonl:abc"])
def test_a_weight_that_is_not_a_number_names_the_weight_form(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="is not a weight: FILE:W takes a positive number"):
        data_file(spec)
