"""One compressed file for a pre-built training dataset, so it can travel where `bible` is missing.

`python -m moemesh.tools.train.data_pack pack --data-dir .traindata/kjv-recite --out .traindata/kjv-recite.pack`
`python -m moemesh.tools.train.data_pack unpack --pack .traindata/kjv-recite.pack --data-dir DIR`

The pack is an xz-compressed `.npz` of every `*.npy` of the dataset (loss masks bit-packed along the
window, unpacked to the same uint8 arrays) plus `manifest.json`: the 14 MB of the default
dataset become about 2 MB. Unpacking writes the same files `tools.train.build_data` writes, so
`python -m moemesh.tools.train --data-dir DIR` reads them unchanged.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
from pathlib import Path

import numpy as np

MANIFEST_FILE = "manifest.json"
MASK_SUFFIX = "_loss_mask.npy"


def pack(data_dir: Path, out: Path) -> int:
    """Write the pack; returns its size in bytes."""
    manifest = json.loads((data_dir / MANIFEST_FILE).read_text(encoding="utf-8"))
    arrays = {}
    for path in sorted(data_dir.glob("*.npy")):
        array = np.load(path, allow_pickle=False)
        if path.name.endswith(MASK_SUFFIX):
            arrays[f"bits:{path.name}"] = np.packbits(array.astype(bool), axis=-1)
            arrays[f"shape:{path.name}"] = np.asarray(array.shape, dtype=np.int64)
        else:
            arrays[f"array:{path.name}"] = array
    arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode("utf-8"), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(buffer.getvalue(), preset=6))
    return out.stat().st_size


def unpack(pack_file: Path, data_dir: Path) -> dict:
    """Write the dataset files into data_dir; returns the manifest."""
    with np.load(io.BytesIO(lzma.decompress(pack_file.read_bytes())), allow_pickle=False) as archive:
        data_dir.mkdir(parents=True, exist_ok=True)
        for key in archive.files:
            kind, _, name = key.partition(":")
            if kind == "array":
                np.save(data_dir / name, archive[key], allow_pickle=False)
            elif kind == "bits":
                shape = tuple(int(n) for n in archive[f"shape:{name}"])
                bits = np.unpackbits(archive[key], axis=-1, count=shape[-1])
                np.save(data_dir / name, bits.astype(np.uint8).reshape(shape), allow_pickle=False)
        manifest = json.loads(archive["manifest"].tobytes().decode("utf-8"))
    (data_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moemesh.tools.train.data_pack", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--pack", type=Path, required=True)
    u.add_argument("--data-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.action == "pack":
        print(json.dumps({"event": "data_pack.written", "out": str(args.out), "bytes": pack(args.data_dir, args.out)}))
    else:
        manifest = unpack(args.pack, args.data_dir)
        print(json.dumps({"event": "data_pack.unpacked", "data_dir": str(args.data_dir),
                          "train_windows": manifest["streams"]["train"]["num_windows"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
