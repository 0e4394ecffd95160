"""The ``shardopt`` command without the developer tools: ``bench`` and ``gpu-check`` say what to
install, on one line, with status 2 ([Note: developer tools])."""

from __future__ import annotations

import importlib.util

import pytest

from shardopt.cli import main


@pytest.mark.parametrize("command", [["bench"], ["gpu-check", "--items", "b"]])
def test_a_developer_command_without_devtools_names_what_to_install(monkeypatch, capsys, command):
    find_spec = importlib.util.find_spec

    def without_devtools(name, *args):
        return None if name.startswith("shardopt.devtools") else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_devtools)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardopt {command[0]}: error: needs the developer tools")
    assert "pip install -e packages/devtools" in err
    assert err.count("\n") == 1
