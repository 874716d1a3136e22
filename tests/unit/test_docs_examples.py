"""Every public name the API reference (docs/reference/api.md) shows carries an ``Example:`` section.

The names are what each package exports (its ``__all__``, ``tandem``'s lazy names included) and,
of each such class, the public methods and properties mkdocstrings shows (its own members with a
docstring). Docstrings are read the way the site reads them: with griffe, Google style, so an
attribute's docstring (a string under a constant) counts and an ``Example:`` must parse as that
section, with a fenced python block.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

PACKAGES = ["tandem", "tandem.optim", "tandem.kvstore", "tandem.models", "tandem.data"]


@pytest.fixture(scope="module")
def api() -> Any:
    try:
        import griffe
    except ImportError:
        pytest.fail(
            "griffe is not installed: scripts/env.sh installs the [docs] extra (mkdocstrings[python])"
        )
    return griffe.load("tandem", docstring_parser="google", resolve_aliases=True, resolve_external=False)


def _documented(api: Any, package: str, name: str) -> Any:
    """The griffe object the reference renders for ``package.name``: where it is defined."""
    value = getattr(importlib.import_module(package), name)
    if inspect.isclass(value) or inspect.isfunction(value):
        return api[f"{value.__module__}.{value.__qualname__}".removeprefix("tandem.")]
    # a constant, as its package exports it
    found = api[f"{package}.{name}".removeprefix("tandem").lstrip(".")]
    return found.final_target if found.is_alias else found  # where it is assigned (its docstring under it)


def _shown_members(cls: Any) -> list[Any]:
    """The methods and properties of ``cls`` that mkdocstrings shows (own, public, with a docstring)."""
    return [member for name, member in cls.members.items()
            if not member.is_alias and member.docstring is not None and name != "__init__"
            and not (name.startswith("_") and not name.endswith("__"))
            and (member.is_function or "property" in member.labels)]  # fmt: skip


def _has_example(obj: Any) -> bool:
    if obj.docstring is None:
        return False
    return any(section.kind.value == "admonition" and section.title == "Example"
               and "```python" in section.value.contents for section in obj.docstring.parse("google"))  # fmt: skip


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_has_an_example(api: Any, package: str) -> None:
    names = [n for n in importlib.import_module(package).__all__ if not n.startswith("__")]
    objects = [_documented(api, package, name) for name in names]
    shown = objects + [member for obj in objects if obj.is_class for member in _shown_members(obj)]
    missing = [obj.path for obj in shown if not _has_example(obj)]
    assert not missing, (
        f"public names of {package} without an 'Example:' section (```python block): {missing}"
    )
