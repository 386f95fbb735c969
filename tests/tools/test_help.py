"""`outcore COMMAND --help` explains every flag, with its real default where it has one."""

import argparse

from outcore.tools.cli_flags import build_parser


def flags():
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                for flag in sub._actions:
                    if flag.option_strings and flag.dest != "help" and flag.help != argparse.SUPPRESS:
                        yield command, flag


def test_every_flag_has_help_and_a_flag_with_a_default_names_it():
    silent = [f"{c} {f.option_strings[0]}" for c, f in flags() if not f.help]
    assert silent == []
    unnamed = [f"{c} {f.option_strings[0]}" for c, f in flags()
               if f.default not in (None, False, True) and "default" not in f.help]
    assert unnamed == []


def test_train_describes_fine_tuning():
    train = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    assert "fine-tune" in train.description or "fine-tune" in (train.format_help())
