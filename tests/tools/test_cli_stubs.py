import pytest

from tools.cli import main


@pytest.mark.parametrize("command", ["train", "tune", "estimate", "export"])
def test_commands_of_later_issues_say_so_and_fail(command, capsys):
    assert main([command]) == 1
    assert "not built yet" in capsys.readouterr().err
