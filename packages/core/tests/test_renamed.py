"""Core's names renamed by issue 39 still resolve, each with a FutureWarning naming the new one."""

from __future__ import annotations

import importlib

import pytest

import shardopt.core
import shardopt.core.blocks

RENAMED = [
    ("shardopt.core", "FlatGroup", "BufferGroup"),
    ("shardopt.core", "update_flat_", "update_pieces_"),
    ("shardopt.core.blocks", "FlatRule", "PieceRule"),
    ("shardopt.core.blocks", "flat_rule", "piece_rule"),
    ("shardopt.core.blocks", "with_flat_rule", "with_piece_rule"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED)
def test_an_old_name_is_the_new_object_and_warns_with_the_new_name(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(FutureWarning, match=rf"{module}\.{old} is renamed {module}\.{new}"):
        value = getattr(mod, old)
    assert value is getattr(mod, new)
    assert old not in mod.__all__
    assert new in mod.__all__


def test_from_import_of_an_old_name_works_and_warns():
    with pytest.warns(FutureWarning, match="BufferGroup"):
        from shardopt.core import FlatGroup
    assert FlatGroup is shardopt.core.BufferGroup


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'FlatThing'"):
        shardopt.core.FlatThing  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'flat_thing'"):
        shardopt.core.blocks.flat_thing  # noqa: B018
