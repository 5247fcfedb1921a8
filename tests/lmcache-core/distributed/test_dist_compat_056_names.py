"""0.5.6's storage functions stay importable from their 0.5.6 modules, each the one object
``compat_056`` defines, and the typed views (``if TYPE_CHECKING`` imports) name exactly the
names of the one list in ``compat_056_names``."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from lmcache.v1.distributed import compat_056
from lmcache.v1.distributed.compat_056_names import ALL_COMPAT_NAMES, REEXPORTED_BY


@pytest.mark.parametrize("module_name", sorted(REEXPORTED_BY))
def test_each_0_5_6_module_reexports_the_compat_objects(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in REEXPORTED_BY[module_name]:
        assert name in module.__all__, f"{module_name}.__all__ lacks {name}"
        assert name in dir(module)
        assert getattr(module, name) is getattr(compat_056, name)


@pytest.mark.parametrize("module_name", sorted(REEXPORTED_BY))
def test_typed_views_match_the_list(module_name: str) -> None:
    tree = ast.parse(inspect.getsource(importlib.import_module(module_name)))
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == compat_056.__name__:
            typed.update(alias.name for alias in node.names)
    assert typed == set(REEXPORTED_BY[module_name])


def test_compat_module_defines_every_listed_name() -> None:
    assert sorted(compat_056.__all__) == list(ALL_COMPAT_NAMES)
    for name in ALL_COMPAT_NAMES:
        assert callable(getattr(compat_056, name)), name
