"""`kvrt launch --config FILE`: an option that takes several values takes a list in the file
(or one string, as the command line takes one value)."""
from __future__ import annotations

import argparse

import pytest

from kvrt import launcher
from kvrt.runtime.node.config_file import ConfigFileError, config_defaults


def _launch_parser() -> argparse.ArgumentParser:
    return launcher._add_launch(argparse.ArgumentParser(prog="kvrt").add_subparsers())


@pytest.mark.parametrize("value, want", [('"a"', ["a"]), ('["a", "org/b"]', ["a", "org/b"])])
def test_served_model_names_from_a_file(tmp_path, value, want):
    cfg = tmp_path / "node.toml"
    cfg.write_text(f"served-model-name = {value}\n")
    assert config_defaults(_launch_parser(), cfg) == {"served_model_name": want}


@pytest.mark.parametrize("value", ["[]", "[1]", "3"])
def test_served_model_names_of_the_wrong_type_are_refused(tmp_path, value):
    cfg = tmp_path / "node.toml"
    cfg.write_text(f"served-model-name = {value}\n")
    with pytest.raises(ConfigFileError, match="a string or a non-empty list of strings"):
        config_defaults(_launch_parser(), cfg)
