"""moemesh: a disaggregated inference server for DeepSeek-V4-class Mixture-of-Experts models.

The import root of the distribution. The repository keeps its folders (`common/`, `services/`,
`bench/`, `tools/`) beside this package; installed, they live inside it (`moemesh.common`,
`moemesh.services.router`, ...), as `setup.py` maps them. Run from a source tree without
installing, a finder maps the same four names onto the folders beside this package; it goes first,
so a source tree on PYTHONPATH wins over an editable install of another checkout.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

MAPPED_FOLDERS = ("common", "services", "bench", "tools")


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds `moemesh.<folder>` in the repository folder of that name (source trees only)."""

    def __init__(self, source_root: str) -> None:
        self.source_root = source_root

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 (MetaPathFinder protocol)
        head, _, folder = fullname.partition(".")
        if head != __name__ or folder not in MAPPED_FOLDERS:
            return None
        package_dir = os.path.join(self.source_root, folder)
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir])


_package_dir = os.path.dirname(os.path.abspath(__file__))
if not os.path.isdir(os.path.join(_package_dir, "common")):
    sys.meta_path.insert(0, _SourceTreeFinder(os.path.dirname(_package_dir)))
