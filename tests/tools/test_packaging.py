"""One import namespace: only `outcore` is installed at the top level, and a user's own modules
named like outcore's packages neither shadow outcore nor are shadowed by it."""

import subprocess
import sys
from importlib import metadata

import pytest

import outcore


def test_the_distribution_installs_one_top_level_package():
    dist = metadata.distribution("outcore")
    assert dist.read_text("top_level.txt").split() == ["outcore"]
    assert [ep.value for ep in dist.entry_points if ep.name == "outcore"] == ["outcore.tools.cli:main"]


def test_the_public_api_is_reexported_at_the_top():
    from outcore.offload.io_config import IOConfig
    from outcore.offload.residency import Tier
    from outcore.offload.store import TieredStore
    from outcore.runtime.config import Config
    from outcore.runtime.engine import Engine
    from outcore.runtime.materialize import deferred_init
    from outcore.runtime.optimizer import AdamW

    assert (outcore.Engine, outcore.Config, outcore.AdamW, outcore.deferred_init) == (Engine, Config, AdamW,
                                                                                     deferred_init)
    assert (outcore.TieredStore, outcore.Tier, outcore.IOConfig) == (TieredStore, Tier, IOConfig)


@pytest.mark.slow  # spawns a process
def test_a_users_runtime_and_tools_next_to_the_script_win_and_outcore_still_works(tmp_path):
    (tmp_path / "runtime.py").write_text("WHO = 'user'\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "__init__.py").write_text("WHO = 'user tools'\n")
    (tmp_path / "offload.py").write_text("WHO = 'user offload'\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import runtime, tools, offload\n"
        "import outcore, outcore.tools.cli\n"
        "print(runtime.WHO, '|', tools.WHO, '|', offload.WHO, '|', outcore.Config.__module__)\n")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "user | user tools | user offload | outcore.runtime.config"


@pytest.mark.slow  # spawns a process
def test_no_generic_package_is_importable_from_elsewhere(tmp_path):
    code = "import importlib.util as u; print([n for n in ('runtime', 'tools', 'offload') if u.find_spec(n)])"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
