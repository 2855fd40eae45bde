"""Packaging: one import name, `moemesh`, with the repository's folders mapped beneath it.

`moemesh/` holds the command line; `common/`, `services/`, `bench/` and `tools/` install as
`moemesh.common`, `moemesh.services`, `moemesh.bench` and `moemesh.tools`. Everything else is in
pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
MAPPED_FOLDERS = ("common", "services", "bench", "tools")


def packages_under(folder: str) -> list[str]:
    """Dotted names, under `moemesh`, of every package in a repository folder."""
    return [".".join(("moemesh", *init.parent.relative_to(ROOT).parts))
            for init in sorted((ROOT / folder).rglob("__init__.py"))]


packages = ["moemesh", *(name.replace("moemesh.moemesh", "moemesh", 1) for name in packages_under("moemesh")[1:])]
for folder in MAPPED_FOLDERS:
    packages += packages_under(folder)

setup(packages=packages, package_dir={"moemesh": "moemesh", **{f"moemesh.{f}": f for f in MAPPED_FOLDERS}})
