"""Render benchmark results as PNG plots beside their JSON: `python -m moemesh.bench.plots [DIR|FILE...]`.

Every benchmark result `<name>.json` becomes `<name>.png`: its numeric figures (the leaves of the
JSON, named by their path, e.g. `decode.b1.step_ms`) as horizontal bars, one panel per kind of
quantity (milliseconds, seconds, rates, ratios, counts, ...) so that each panel has one scale and
a 2 ms step is not drawn beside 5,000 tokens/s. A panel shows at most `MAX_BARS_PER_PANEL` bars,
in file order; metadata (dates, commits, commands, device names) is text and is left out.

`bench.results_io.write_result` calls `render_beside` for every result it writes, so
`moemesh bench NAME` leaves `NAME-<device>-<time>.png` next to `NAME-<device>-<time>.json`. matplotlib (in the
`test` extra) is optional: without it nothing is drawn (`render_beside` returns None, the command
says so and exits 0), so running a benchmark never needs it. `render_all` skips a PNG that is
newer than its JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_BARS_PER_PANEL = 30
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# a leaf goes to the first panel whose suffixes end its last name or whose fragments occur in it
_PANELS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    # title, name suffixes, name fragments
    ("microseconds", ("_us",), ()),
    ("milliseconds", ("_ms",), ()),
    ("per second (rates)", ("per_s", "tok_s", "_tps", "req_s", "_rps"), ("per_second", "throughput")),
    ("bandwidth / compute rate", ("gbps", "gb_s", "tflops", "gflops"), ()),
    ("seconds", ("_s", "seconds"), ()),
    ("bytes", ("_bytes", "_mib", "_mb", "_gib", "_gb"), ()),
    ("ratios and fractions", (), ("ratio", "fraction", "share", "accept", "_over_", "speedup", "efficiency")),
    ("counts", (), ("num_", "count")),
)
OTHER_PANEL = "other values"


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


def panel_of(path: str) -> str:
    """The panel a leaf belongs to, from the innermost name that says a unit: `raw.decode.step_ms`
    and `raw.ttft_ms.mean` are milliseconds, `ratios.b8_over_b1` a ratio."""
    for name in reversed(path.lower().split(".")):
        name = name.split("[", 1)[0]
        for title, suffixes, fragments in _PANELS:
            if name.endswith(suffixes) or any(fragment in name for fragment in fragments):
                return title
    return OTHER_PANEL


def panels(leaves: list[tuple[str, float]]) -> dict[str, list[tuple[str, float]]]:
    """Leaves grouped by panel, in the order panels first appear; each cut to MAX_BARS_PER_PANEL."""
    grouped: dict[str, list[tuple[str, float]]] = {}
    for path, number in leaves:
        group = grouped.setdefault(panel_of(path), [])
        if len(group) < MAX_BARS_PER_PANEL:
            group.append((path, number))
    return grouped


def render(json_path: Path, png_path: Path | None = None) -> Path | None:
    """Draw one result file; None when it has no numbers. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = panels(list(numeric_leaves(json.loads(json_path.read_text(encoding="utf-8")))))
    if not grouped:
        return None
    png_path = png_path or json_path.with_suffix(".png")
    heights = [0.28 * len(bars) + 0.9 for bars in grouped.values()]
    figure, axes_list = plt.subplots(len(grouped), 1, figsize=(11, sum(heights) + 0.8),
                                     gridspec_kw={"height_ratios": heights}, squeeze=False)
    for axes, (title, bars) in zip(axes_list[:, 0], grouped.items()):
        labels, values = zip(*bars)
        positions = range(len(values))
        axes.barh(positions, values, color="#2b6cb0")
        axes.set_yticks(positions, labels, fontsize=7)
        axes.invert_yaxis()
        axes.set_title(title, fontsize=9, loc="left")
        axes.tick_params(axis="x", labelsize=7)
        for position, number in zip(positions, values):
            axes.annotate(f"{number:.4g}", (number, position), xytext=(3, 0), textcoords="offset points",
                          va="center", fontsize=6)
    figure.suptitle(json_path.name, fontsize=10)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return png_path


def render_beside(json_path: Path) -> Path | None:
    """`<json_path stem>.png` next to the result, or None without matplotlib or numbers. Never
    raises for a plot problem: a benchmark's result must not be lost to its picture."""
    try:
        return render(Path(json_path))
    except ImportError:
        print("bench.plots: matplotlib is not installed; no plot drawn (pip install matplotlib)", file=sys.stderr)
    except (ValueError, OSError, RuntimeError) as error:
        print(f"bench.plots: no plot for {json_path}: {error}", file=sys.stderr)
    return None


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
    parser.add_argument("paths", nargs="*", default=[str(RESULTS_DIR)],
                        help="result directories (every *.json not yet drawn) or JSON files")
    args = parser.parse_args(argv)
    try:
        written = []
        for path in map(Path, args.paths):
            if path.is_dir():
                written += render_all(path)
            else:
                out = render(path)
                written += [out] if out is not None else []
    except ImportError:
        print("bench.plots: matplotlib is not installed; no plots drawn (pip install matplotlib)", file=sys.stderr)
        return 0
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
