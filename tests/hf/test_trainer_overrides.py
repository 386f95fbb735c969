"""The methods of `transformers.Trainer` (and of TRL's trainers) that outcore's Trainer replaces
exist in the installed versions with the parameters outcore's versions take: an upgrade that
renames or reshapes one fails here, by name, not deep in a training run."""

import inspect

import pytest

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")

from outcore.hf.trainer import OutcoreTrainerMixin  # noqa: E402
from outcore.hf.trainer_backend import EngineBackend  # noqa: E402

OURS_ALONE = {"_calls_model_again", "_loss_scaled_for_window", "_precompute_deferred"}  # no method of theirs


def _theirs(name: str):
    for cls in (transformers.Trainer, trl.DPOTrainer, trl.KTOTrainer, trl.GRPOTrainer):
        if name in vars(cls):
            return cls, vars(cls)[name]
    return None, None


def _parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


@pytest.mark.parametrize("name", sorted(n for cls in (OutcoreTrainerMixin, EngineBackend) for n, f in vars(cls).items()
                                        if callable(f) and not n.startswith("__") and n not in OURS_ALONE))
def test_each_replaced_method_is_the_installed_trainers_with_the_same_parameters(name):
    ours = vars(OutcoreTrainerMixin).get(name) or vars(EngineBackend)[name]
    owner, theirs = _theirs(name)
    assert theirs is not None, f"{name}: no installed Trainer has it any more; outcore's Trainer must follow the rename"
    if name == "__init__":
        return
    mine, installed = _parameters(ours), _parameters(theirs)
    if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(ours).parameters.values()):
        return  # ours passes whatever it is given through (train(*args, **kwargs))
    assert mine == installed[: len(mine)] and len(installed) - len(mine) <= sum(
        1 for p in inspect.signature(theirs).parameters.values() if p.default is not p.empty), (
        f"{owner.__name__}.{name}{inspect.signature(theirs)} against outcore's {inspect.signature(ours)}")


def test_the_scan_sees_the_methods_outcore_replaces():
    names = {n for cls in (OutcoreTrainerMixin, EngineBackend) for n in vars(cls)}
    assert {"_prepare_for_training", "_save_optimizer_and_scheduler", "_precompute_ref_logps", "training_step"} <= names
