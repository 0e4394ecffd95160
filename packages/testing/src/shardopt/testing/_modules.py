"""Pickling a rank's function so that the rank loads it, even from a test file off sys.path."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import os
import pickle
import sys
import types
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ModuleSource", "dumps_with_sources", "load_sources", "loads_with_sources"]

# [Note: loading test modules in ranks]
# A rank unpickles its function by reference (module name + qualified name), so the module must
# be importable in the child. Test files collected by pytest with --import-mode=importlib (the
# project default) are not: pytest imports them by path under a made-up name. So the parent
# records, while pickling, the module of every function and class that the payload refers to,
# together with its file. The child loads each such module by path under the same name before
# unpickling, unless a normal import finds that very file. Modules that pytest had rewritten
# for assertion introspection are loaded by path with the same rewriting, so that a failing
# `assert` inside a rank explains itself as it would in the parent. The rewriting uses pytest's
# `rewrite_asserts`; if it is missing or fails, the module is loaded plainly.

_NOT_LOADED_BY_PATH = frozenset({"__main__", "__mp_main__", "builtins"})


@dataclass(frozen=True, slots=True)
class ModuleSource:
    """A module a payload refers to: its name, file, and whether pytest rewrote its asserts."""

    name: str
    path: str
    rewrite_asserts: bool


class _RecordingPickler(pickle.Pickler):
    """A Pickler that records the modules of the functions and classes it pickles by name."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            module = getattr(obj, "__module__", None)
            if isinstance(module, str):
                self.modules.add(module)
        return NotImplemented  # pickle as usual


def dumps_with_sources(obj: Any) -> tuple[bytes, tuple[ModuleSource, ...]]:
    """Pickles ``obj`` and returns the sources of the modules it refers to.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled.

    Example:
        >>> import operator
        >>> data, sources = dumps_with_sources((operator.add, (1, 2)))
        >>> pickle.loads(data)[0] is operator.add
        True
    """
    buffer = io.BytesIO()
    pickler = _RecordingPickler(buffer)
    pickler.dump(obj)
    sources = tuple(
        source for name in sorted(pickler.modules) if (source := _source_of(name)) is not None
    )
    return buffer.getvalue(), sources


def _source_of(name: str) -> ModuleSource | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if name in _NOT_LOADED_BY_PATH or not isinstance(path, str) or not path.endswith(".py"):
        return None
    loader = getattr(getattr(module, "__spec__", None), "loader", None)
    rewritten = type(loader).__name__ == "AssertionRewritingHook"
    return ModuleSource(name=name, path=path, rewrite_asserts=rewritten)


def loads_with_sources(data: bytes, sources: Iterable[ModuleSource]) -> Any:
    """Loads the modules in ``sources`` as needed, then unpickles ``data``."""
    load_sources(sources)
    return pickle.loads(data)


def load_sources(sources: Iterable[ModuleSource]) -> None:
    """Makes each module importable under its name (see [Note: loading test modules in ranks])."""
    for source in sources:
        if source.name in sys.modules:
            continue
        if not source.rewrite_asserts and _imports_same_file(source):
            continue
        _load_by_path(source)


def _imports_same_file(source: ModuleSource) -> bool:
    try:
        spec = importlib.util.find_spec(source.name)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None)
    if not isinstance(origin, str) or not os.path.exists(origin):
        return False
    return os.path.samefile(origin, source.path)


def _load_by_path(source: ModuleSource) -> None:
    _ensure_parent_packages(source.name)
    spec = importlib.util.spec_from_file_location(source.name, source.path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {source.name!r} from {source.path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[source.name] = module
    try:
        code = _rewritten_code(source.path) if source.rewrite_asserts else None
        if code is None:
            spec.loader.exec_module(module)
        else:
            exec(code, module.__dict__)
    except BaseException:
        del sys.modules[source.name]
        raise


def _ensure_parent_packages(name: str) -> None:
    """Makes ``a`` and ``a.b`` exist for ``a.b.c``: imported if possible, else empty packages."""
    parts = name.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if prefix in sys.modules:
            continue
        try:
            importlib.import_module(prefix)
        except ImportError:
            package = types.ModuleType(prefix)
            package.__path__ = []
            sys.modules[prefix] = package


def _rewritten_code(path: str) -> types.CodeType | None:
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return None
    try:
        with open(path, "rb") as file:
            source = file.read()
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        return compile(tree, path, "exec", dont_inherit=True)
    except Exception:  # the plain module still works, with less helpful asserts
        return None
