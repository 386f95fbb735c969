"""The tiny Llama directory the Trainer tests of a module share."""

import pytest
from trainer_setup import model_dir


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return model_dir(str(tmp_path_factory.mktemp("llama")))
