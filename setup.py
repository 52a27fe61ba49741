"""What the ``ipcount`` distribution holds; everything else about it is in pyproject.toml.

IPCOUNT_DIST=product builds the product alone (package ``ipcount``, command ``ipcount``): what
the product image installs. The default, ``dev``, adds the lab (package ``ipcount_lab``, command
``ipcount-lab``), as bin/setup installs it, editable, for development.
"""
import os

from setuptools import find_namespace_packages, setup

DISTS = {"product": ["ipcount"], "dev": ["ipcount", "ipcount_lab"]}
dist = os.environ.get("IPCOUNT_DIST", "dev")
if dist not in DISTS:
    raise SystemExit(f"IPCOUNT_DIST must be one of {', '.join(DISTS)}, got {dist!r}")
roots = DISTS[dist]
commands = {"ipcount": "ipcount.cli:main", "ipcount-lab": "ipcount_lab.cli:main"}

# Namespace packages too: the monitor's templates are a directory without an __init__.py.
setup(packages=find_namespace_packages(include=[pattern for root in roots for pattern in (root, f"{root}.*")],
                                       exclude=["*.__pycache__"]),
      entry_points={"console_scripts": [f"{name} = {target}" for name, target in commands.items()
                                        if target.split(".")[0] in roots]})
