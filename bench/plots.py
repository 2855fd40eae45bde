"""Render benchmark results as PNG plots beside their JSON: `python -m bench.plots [DIR]`.

Every `bench/results/*.json` becomes `<name>.png`: a horizontal bar chart of its numeric
figures (the leaves of the JSON, named by their path, e.g. `decode.b1.step_ms`), at most
`MAX_BARS` of them, in file order. Metadata (dates, commits, commands, device names) is text
and is left out. matplotlib is optional: without it nothing is drawn and the command says so
(exit 0), so `make` never needs it. A PNG newer than its JSON is not redrawn.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_BARS = 40
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def numeric_leaves(value: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(path, number) for every int/float leaf of a JSON value (bools excluded), in order."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield prefix or "value", float(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from numeric_leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numeric_leaves(item, f"{prefix}[{index}]")


def render(json_path: Path, png_path: Path | None = None) -> Path | None:
    """Draw one result file; None when it has no numbers. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    leaves = list(numeric_leaves(json.loads(json_path.read_text(encoding="utf-8"))))[:MAX_BARS]
    if not leaves:
        return None
    png_path = png_path or json_path.with_suffix(".png")
    labels, values = zip(*leaves)
    figure, axes = plt.subplots(figsize=(10, 0.3 * len(leaves) + 1.5))
    axes.barh(range(len(values)), values, color="#2b6cb0")
    axes.set_yticks(range(len(labels)), labels, fontsize=7)
    axes.invert_yaxis()
    axes.set_title(json_path.name)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path


def render_all(results_dir: Path = RESULTS_DIR) -> list[Path]:
    written = []
    for json_path in sorted(results_dir.glob("*.json")):
        png_path = json_path.with_suffix(".png")
        if png_path.exists() and png_path.stat().st_mtime >= json_path.stat().st_mtime:
            continue
        out = render(json_path, png_path)
        if out is not None:
            written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", nargs="?", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    try:
        written = render_all(Path(args.results_dir))
    except ImportError:
        print("bench.plots: matplotlib is not installed; no plots drawn (pip install matplotlib)", file=sys.stderr)
        return 0
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
