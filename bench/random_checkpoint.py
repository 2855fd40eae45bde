"""`moemesh bench make-checkpoint`: a hub-format DeepSeek-V4 checkpoint directory with random weights.

    moemesh bench make-checkpoint --preset v4-flash --layers 4 [--routing-skew C] [--dspark] [--seed S] \
        [--hidden-size H --experts E --vocab-size V --set KEY=JSON ...] [--shard-size 4GiB --workers N] --out DIR

The directory is a checkpoint like the released one, read by the same loaders (`moemesh serve`,
`moemesh generate`, transformers): `config.json` (the preset's hub keys, `quantization_config` as
DeepSeek-V4-Flash has it), `generation_config.json`, a tokenizer sized to the vocabulary,
`model-0000i-of-0000n.safetensors` shards and `model.safetensors.index.json`. Every tensor of the
config's inventory (`common.model.inventory`) is written under its hub name in its stored format:
- FP8 linears: float8_e4m3fn codes and a ue8m0 scale per 128 x 128 block;
- routed experts: FP4 e2m1 codes, two per byte (low nibble = even column), a ue8m0 scale per 32 inputs
  (or FP8 blocks for `expert_dtype fp8`);
- BF16 / F32 / I64 tensors where the checkpoint keeps them (embed, head, norms, compressors, mHC, sinks,
  gate bias, `tid2eid`);
- with `--dspark`, the three DSpark stages under `mtp.{0,1,2}.*` with their real keys (docs/speculation.md §3.2:
  `main_proj`, `main_norm`, the Markov and confidence heads) and the `dspark_*` config keys.

Values (chosen so a forward stays finite and O(1) through 43 layers; for timing and plumbing, not for
language): FP8 codes follow N(0, 32²) (256 equally likely codes from its quantiles: never a NaN
encoding), FP4 bytes are uniform (every e2m1 code), and each block's power-of-two scale puts a linear's
dequantised weight std near in_features^-1/2 (exponent jittered by -1, 0 or +1 per block). Other tensors by
role: norms N(1, 0.1²), embed N(0, 1), mHC fn N(0, 0.02²) / base N(0, 0.5²) / scale N(1, 0.1²), sinks
N(0, 0.5²), ape N(0, 0.1²), plain linears N(0, 1/in_features), `tid2eid` distinct random experts per token.

Routing skew C >= 0 (`--routing-skew`): the gate bias of every learned-routing layer (and DSpark stage) is
bias[e] = -C·ln(1 + rank[e]) with rank a per-layer random permutation (`skew_ranks`, 0 = the most
favoured); C = 0 keeps a near-uniform random bias N(0, 0.01²). The bias takes part in expert selection
only (docs/model.md §2.8), so this skews which experts run, not the routing weights.

Fast and bounded in memory at full width: quantized bytes are drawn directly (random integers through
small lookup tables, no float weight is quantized), every tensor comes from its own generator seeded by
(seed, tensor name) so the bytes do not depend on sharding, and each shard is streamed to disk in pieces
of at most 64 MiB (`bench.random_checkpoint_tensors`). Progress and bytes written go to stdout.

`cached_checkpoint` gives benchmarks a directory written once per set of arguments (a hash of the
config, seed and skew) under `cache_dir` (default $MOEMESH_CHECKPOINT_CACHE, else
~/.cache/moemesh/checkpoints). More in bench/checkpoints.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moemesh.bench.random_checkpoint_tensors import (
    Entry, checkpoint_entries, shard_plan, skew_bias, skew_ranks, write_shard,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER_DIR = REPO / "models" / "kjv-dsv4-mini"  # the default model's byte-level BPE tokenizer
PROVENANCE_FILE = "moemesh_random_checkpoint.json"  # the arguments that wrote the directory (for people)
INDEX_FILE = "model.safetensors.index.json"
GENERATOR_VERSION = 1  # part of the cache key: bump when the bytes written for given arguments change

# DSpark drafter of V4-Flash (docs/speculation.md §3.2)
FLASH_DSPARK_BLOCK_SIZE = 5
FLASH_DSPARK_MARKOV_RANK = 256
FLASH_DSPARK_NOISE_TOKEN_ID = 128799
FLASH_DSPARK_NUM_STAGES = 3
FLASH_DSPARK_NUM_TARGET_LAYERS = 3  # the last three main layers (40, 41, 42 of 43)

# V4-Flash's structure at a width a CPU runs in seconds (the `tiny` preset; FP8 dims <= 128 or multiples
# of 128, FP4 inputs multiples of 32, >= 16 indexer heads)
TINY_SETTINGS: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32,
    qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=16, num_experts_per_tok=2,
    sliding_window=16, index_n_heads=16, index_head_dim=16, index_topk=4, compress_rate_hca=16,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                  "beta_slow": 1},
)


# ------------------------------------------------------------------------------------ configs
def _flash() -> dict[str, Any]:
    from moemesh.common.model.presets import v4_flash_hub_dict

    return v4_flash_hub_dict()


def _tiny() -> dict[str, Any]:
    d = _flash()
    d.update(TINY_SETTINGS)
    return d


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {"v4-flash": _flash, "tiny": _tiny}


def dspark_hub_keys(num_hidden_layers: int, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The `dspark_*` keys and `num_nextn_predict_layers` of V4-Flash's drafter for a model of
    `num_hidden_layers` layers: target layers = the last three. When the mask token 128799 is not a token of
    a smaller vocabulary, the last token id stands in for it."""
    if num_hidden_layers < FLASH_DSPARK_NUM_TARGET_LAYERS:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: the drafter reads the last "
                         f"{FLASH_DSPARK_NUM_TARGET_LAYERS} layers")
    noise_token_id = FLASH_DSPARK_NOISE_TOKEN_ID
    if vocab_size is not None and noise_token_id >= vocab_size:
        noise_token_id = vocab_size - 1
    first_target = num_hidden_layers - FLASH_DSPARK_NUM_TARGET_LAYERS
    return {
        "dspark_block_size": FLASH_DSPARK_BLOCK_SIZE,
        "dspark_markov_rank": FLASH_DSPARK_MARKOV_RANK,
        "dspark_target_layer_ids": list(range(first_target, num_hidden_layers)),
        "dspark_noise_token_id": noise_token_id,
        "num_nextn_predict_layers": FLASH_DSPARK_NUM_STAGES,
    }


def with_dspark(hub_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `hub_config` with the drafter's keys and one ratio-0 `compress_ratios` entry per stage
    after the main layers (as `-0731`: 43 + 3)."""
    out = dict(hub_config)
    num_layers = int(out["num_hidden_layers"])
    out.update(dspark_hub_keys(num_layers, vocab_size=out.get("vocab_size")))
    if out.get("compress_ratios") is not None:
        out["compress_ratios"] = list(out["compress_ratios"][:num_layers]) + [0] * FLASH_DSPARK_NUM_STAGES
    return out


def hub_config(preset: str = "v4-flash", *, num_layers: int | None = None, dspark: bool = False,
               num_mtp_layers: int | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of a checkpoint: `preset`'s hub keys, its first `num_layers` main layers (the
    real schedule: window-only first, then CSA/HCA alternating; hash routing for the first
    min(3, N)), `num_mtp_layers` plain MTP blocks (default: the preset's) or the DSpark stages, then
    `overrides` (hub keys, applied last). Validated by `ModelConfig`."""
    from moemesh.common.model.config import ModelConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    d = PRESETS[preset]()
    full = d["compress_ratios"][: d["num_hidden_layers"]]
    layers = d["num_hidden_layers"] if num_layers is None else num_layers
    if not 1 <= layers <= len(full):
        raise ValueError(f"--layers {layers}: must be within 1..{len(full)}")
    mtp = d["num_nextn_predict_layers"] if num_mtp_layers is None else num_mtp_layers
    d.update(num_hidden_layers=layers, num_hash_layers=min(d["num_hash_layers"], layers),
             num_nextn_predict_layers=mtp, compress_ratios=full[:layers] + [0] * mtp)
    d.update(overrides or {})
    if dspark:
        d = with_dspark(d)
    ModelConfig.from_dict(d)  # fails here, naming the key, on a config the model cannot run
    return d


# ------------------------------------------------------------------------------------ writing
def write_tokenizer(out_dir: Path, vocab_size: int, source_dir: Path = DEFAULT_TOKENIZER_DIR) -> None:
    """tokenizer.json + tokenizer_config.json: the default model's byte-level BPE (its 32 special tokens
    at ids 0-31, bytes at 32-287, merges after) cut to `vocab_size` ids, or padded to it with plain tokens
    `<r{id}>` that encoding never produces (so every id the model can emit decodes)."""
    doc = json.loads((source_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = doc["model"]
    num_base = 32 + 256
    if vocab_size < num_base:
        raise ValueError(f"vocab_size={vocab_size}: the byte-level tokenizer needs at least {num_base} ids")
    vocab = {token: index for token, index in model["vocab"].items() if index < vocab_size}
    kept = set(vocab)
    merges = []
    for merge in model["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    for index in range(len(model["vocab"]), vocab_size):
        vocab[f"<r{index}>"] = index
    model["vocab"], model["merges"] = vocab, merges
    doc["added_tokens"] = [token for token in doc["added_tokens"] if token["id"] < vocab_size]
    (out_dir / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    shutil.copyfile(source_dir / "tokenizer_config.json", out_dir / "tokenizer_config.json")


@dataclass
class WriteReport:
    path: Path
    num_tensors: int = 0
    num_bytes: int = 0
    num_shards: int = 0
    seconds: float = 0.0
    shards: list[dict[str, Any]] = field(default_factory=list)


def _format_bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{int(num_bytes)} B"


def write_random_checkpoint(out_dir: str | Path, hub: dict[str, Any], *, seed: int = 0, routing_skew: float = 0.0,
                            max_shard_bytes: int = 4 << 30, progress: Callable[[str], None] | None = print,
                            provenance: dict[str, Any] | None = None, workers: int | None = None) -> WriteReport:
    """Write the checkpoint of hub config `hub` into `out_dir` (created; must not hold a checkpoint).
    workers: shards written at once, each by its own process (default: half the cores, at most one per
    shard); the bytes do not depend on it."""
    from moemesh.common.model.config import ModelConfig

    config = ModelConfig.from_dict(hub)
    out_dir = Path(out_dir)
    if (out_dir / INDEX_FILE).exists() or (out_dir / "model.safetensors").exists():
        raise FileExistsError(f"{out_dir} already holds a checkpoint")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not routing_skew >= 0.0:
        raise ValueError(f"routing skew {routing_skew} must be >= 0")
    say = progress or (lambda _text: None)
    entries = checkpoint_entries(config, routing_skew)
    shards = shard_plan(entries, max_shard_bytes)
    total = sum(e.num_bytes for e in entries)
    free = shutil.disk_usage(out_dir).free
    if free < total:
        raise OSError(f"{out_dir}: the checkpoint needs {_format_bytes(total)} of disk, {_format_bytes(free)} is free")
    say(f"writing {len(entries)} tensors, {_format_bytes(total)}, in {len(shards)} shards to {out_dir}")
    report = WriteReport(out_dir, num_tensors=len(entries), num_shards=len(shards))
    weight_map: dict[str, str] = {}
    began_s = time.perf_counter()
    names = [f"model-{index:05d}-of-{len(shards):05d}.safetensors" for index in range(1, len(shards) + 1)]
    jobs = [(out_dir / name, shard, hub, seed, routing_skew) for name, shard in zip(names, shards)]
    workers = max(1, min(len(shards), workers if workers is not None else (os.cpu_count() or 2) // 2))

    def done(name: str, shard: list[Entry], shard_bytes: int, seconds: float) -> None:
        weight_map.update({entry.name: name for entry in shard})
        report.num_bytes += shard_bytes
        report.shards.append({"file": name, "num_tensors": len(shard), "num_bytes": shard_bytes, "s": seconds})
        say(f"  {name}: {len(shard)} tensors, {_format_bytes(shard_bytes)} in {seconds:.1f} s "
            f"({shard_bytes / max(seconds, 1e-9) / 1e6:.0f} MB/s); {_format_bytes(report.num_bytes)} of "
            f"{_format_bytes(total)} after {time.perf_counter() - began_s:.1f} s")

    if workers == 1:
        for name, job in zip(names, jobs):
            done(name, job[1], *write_shard(*job))
    else:  # shards are independent (each tensor has its own generator): one process per shard at a time
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {pool.submit(write_shard, *job): (name, job[1]) for name, job in zip(names, jobs)}
            for future in as_completed(futures):
                done(*futures[future], *future.result())
    index_doc = {"metadata": {"total_size": report.num_bytes}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n", encoding="utf-8")
    (out_dir / "config.json").write_text(json.dumps(hub, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": True,
                  "temperature": 1.0, "top_p": 1.0}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    write_tokenizer(out_dir, config.vocab_size)
    record = {"generator_version": GENERATOR_VERSION, "seed": seed, "routing_skew": routing_skew,
              **(provenance or {})}
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    report.seconds = time.perf_counter() - began_s
    say(f"wrote {_format_bytes(report.num_bytes)} ({report.num_bytes} bytes) in {report.num_shards} shards "
        f"in {report.seconds:.1f} s ({report.num_bytes / max(report.seconds, 1e-9) / 1e6:.0f} MB/s): {out_dir}")
    return report


def cache_key(hub: dict[str, Any], seed: int, routing_skew: float) -> str:
    text = json.dumps({"hub": hub, "seed": seed, "routing_skew": float(routing_skew),
                       "version": GENERATOR_VERSION}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("MOEMESH_CHECKPOINT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "moemesh" / "checkpoints"


def cached_checkpoint(hub: dict[str, Any], *, seed: int = 0, routing_skew: float = 0.0,
                      cache_dir: str | Path | None = None, max_shard_bytes: int = 4 << 30,
                      progress: Callable[[str], None] | None = print) -> Path:
    """The checkpoint directory for (hub, seed, skew) under `cache_dir`, written on first use (into a
    temporary sibling, renamed when complete, so an interrupted write is never reused)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"{hub.get('num_hidden_layers')}l-{hub.get('hidden_size')}d-{cache_key(hub, seed, routing_skew)}"
    final = root / name
    if (final / INDEX_FILE).exists():
        if progress:
            progress(f"reusing checkpoint {final}")
        return final
    partial = root / f".{name}.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    try:
        write_random_checkpoint(partial, hub, seed=seed, routing_skew=routing_skew, max_shard_bytes=max_shard_bytes,
                                progress=progress, provenance={"cache_key": name})
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        partial.rename(final)
    except OSError:  # written meanwhile by another process: keep theirs
        shutil.rmtree(partial, ignore_errors=True)
        if not (final / INDEX_FILE).exists():
            raise
    return final


# ------------------------------------------------------------------------------------ command
def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moemesh bench make-checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="v4-flash", choices=sorted(PRESETS),
                        help="v4-flash: DeepSeek-V4-Flash at true width; tiny: the same structure, CPU-sized")
    parser.add_argument("--layers", type=int, default=None, help="first N main layers (default: all 43)")
    parser.add_argument("--mtp-layers", type=int, default=None,
                        help="plain MTP blocks (default: the preset's 1; ignored with --dspark)")
    parser.add_argument("--dspark", action="store_true", help="add the three DSpark drafter stages and their keys")
    parser.add_argument("--routing-skew", type=float, default=0.0,
                        help="gate bias -C·ln(1 + rank) on learned-routing layers; 0: near-uniform routing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None, help="routed experts per layer (n_routed_experts)")
    parser.add_argument("--top-k", type=int, default=None, help="experts per token (num_experts_per_tok)")
    parser.add_argument("--moe-intermediate-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="any other hub config key, e.g. --set expert_dtype='\"fp8\"' (repeatable)")
    parser.add_argument("--shard-size", default="4GiB", help="largest shard, e.g. 4GiB")
    parser.add_argument("--workers", type=int, default=None,
                        help="shards written at once, one process each (default: half the cores)")
    parser.add_argument("--out", required=True, type=Path, help="directory to write (must not hold a checkpoint)")
    return parser.parse_args(argv)


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    named = {"hidden_size": args.hidden_size, "n_routed_experts": args.experts, "num_experts_per_tok": args.top_k,
             "moe_intermediate_size": args.moe_intermediate_size, "vocab_size": args.vocab_size}
    out.update({key: value for key, value in named.items() if value is not None})
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=JSON")
        out[key.strip()] = _json_value(value)
    return out


def main(argv: list[str] | None = None) -> int:
    from moemesh.common.model.config import ConfigError
    from moemesh.common.placement.devices import parse_size

    args = parse_args(argv)
    try:
        hub = hub_config(args.preset, num_layers=args.layers, dspark=args.dspark,
                         num_mtp_layers=0 if args.dspark else args.mtp_layers, overrides=overrides_of(args))
        write_random_checkpoint(args.out, hub, seed=args.seed, routing_skew=args.routing_skew,
                                max_shard_bytes=parse_size(args.shard_size), workers=args.workers,
                                provenance={"argv": list(argv) if argv is not None else sys.argv[1:]})
    except (ConfigError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


__all__ = ["PRESETS", "TINY_SETTINGS", "WriteReport", "cached_checkpoint", "dspark_hub_keys", "hub_config",
           "skew_bias", "skew_ranks", "with_dspark", "write_random_checkpoint", "write_tokenizer"]


if __name__ == "__main__":
    sys.exit(main())
