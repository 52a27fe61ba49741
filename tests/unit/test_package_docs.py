"""Each package's docstring lists its modules and subpackages (``- :mod:`.name` ...`` lines),
all of them and no others: the first page a newcomer reads of a package cannot drift from
what is in it."""
from __future__ import annotations

import ast
import re

import pytest

from ipcount.rules.config import REPO_ROOT

PACKAGES = sorted(p.parent for root in ("ipcount", "ipcount_lab") for p in (REPO_ROOT / root).rglob("__init__.py")
                  if "__pycache__" not in p.parts)


def members(package) -> set[str]:
    return ({p.stem for p in package.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in package.iterdir() if (p / "__init__.py").exists()})


def listed(package) -> set[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    dotted = ".".join(package.relative_to(REPO_ROOT).parts)
    return {name.removeprefix(dotted).lstrip(".") for name in re.findall(r"(?m)^- :mod:`([\w.]+)`", doc)}


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: ".".join(p.relative_to(REPO_ROOT).parts))
def test_a_package_docstring_lists_every_module(package):
    have, say = members(package), listed(package)
    assert (sorted(have - say), sorted(say - have)) == ([], []), "(missing from the docstring, not in the package)"
