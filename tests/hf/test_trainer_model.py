"""The model class each trainer builds from a path (hf/trainer_model.py), against TRL's own sources."""

import inspect
import pathlib
import re

import pytest

from outcore.hf.trainer_model import BUILT_BY, built_class

trl = pytest.importorskip("trl")


def test_every_trainer_that_builds_another_class_from_a_path_is_known():
    """A TRL trainer that passes `create_model_from_path` an Auto class builds that class; BUILT_BY
    must name it, or outcore would build a causal LM in its place."""
    root = pathlib.Path(inspect.getfile(trl)).parent
    found = {}
    for path in root.rglob("*_trainer.py"):
        text = path.read_text()
        for auto_class in re.findall(r"create_model_from_path\(\s*model\s*,\s*(AutoModel\w+)", text):
            trainers = re.findall(r"^class (\w+Trainer)\(", text, flags=re.M)
            found.update({t: auto_class for t in trainers})
    assert "RewardTrainer" in found  # the scan sees what it looks for
    for trainer, auto_class in found.items():
        assert trainer in BUILT_BY and BUILT_BY[trainer][0] == auto_class, (trainer, auto_class)


def test_a_subclass_builds_what_its_trainer_builds():
    class MyReward(trl.RewardTrainer):
        pass

    assert built_class(MyReward) == ("AutoModelForSequenceClassification", {"num_labels": 1})
    assert built_class(trl.SFTTrainer) == (None, {})


def test_a_trainer_not_tested_under_outcore_is_said_once(caplog):
    from outcore.hf import outcore_trainer

    class MySFT(trl.SFTTrainer):
        pass

    gkd = pytest.importorskip("trl.experimental.gkd")
    with caplog.at_level("WARNING", logger="outcore.hf.trainer"):
        outcore_trainer(MySFT)
        assert not caplog.records  # a subclass of a tested trainer
        outcore_trainer(gkd.GKDTrainer)
        outcore_trainer(gkd.GKDTrainer)  # made once (cached), said once
    assert len(caplog.records) == 1 and "GKDTrainer is not among the trainers tested" in caplog.text
