"""Ratios, 43-layer extrapolation, goal checks and the printed table of `bench.layers`.

Every ratio is measured time / floor (1.0 = at the floor); `fraction_of_bf16` is the inverse for
prefill FLOPs (achieved share of the measured bf16 matmul rate). Extrapolation: 2 window + 21 CSA +
20 HCA layers (docs/model.md §1.2), each kind's measured per-layer time (a kind not measured takes a measured
kind's time; `stand_ins` says which), plus the measured embed + head pieces.
"""

from __future__ import annotations

from statistics import mean

from moemesh.bench import layers_floors as floors
from moemesh.common.model.config import AttentionKind


def _per_kind(values: list[float], kinds: list[AttentionKind]) -> dict[AttentionKind, float]:
    out = {}
    for kind in set(kinds):
        out[kind] = mean(v for v, k in zip(values, kinds) if k is kind)
    return out


def _decode_summary(entry: dict, raw: dict, config, kinds: list[AttentionKind]) -> dict:
    copy = raw["ceilings"]["copy_bytes_per_s"]
    info = raw["bytes"]
    # the experts the timed step selects (counted); older results hold only the uniform-routing expectation
    distinct = entry.get("distinct_experts_per_layer") or [entry["expected_distinct_experts"]] * len(kinds)
    layer_bytes = [b + n * info["expert_bytes"] for b, n in zip(info["layer_weight_bytes"], distinct)]
    layer_s = [entry["piece_s"][f"layer{i}"] for i in range(len(kinds))]
    layer_floor_s = [b / copy for b in layer_bytes]
    fixed_s = entry["piece_s"]["embed"] + entry["piece_s"]["head"]
    step_bytes = sum(layer_bytes) + info["head_weight_bytes"]
    t43, stand_ins = floors.extrapolate(_per_kind(layer_s, kinds), fixed_s)
    floor43, _ = floors.extrapolate(_per_kind(layer_floor_s, kinds), info["head_weight_bytes"] / copy)
    return {
        "batch_size": entry["batch_size"],
        "layer_weight_bytes": layer_bytes,
        "distinct_experts_per_layer": distinct,
        "layer_floor_s": layer_floor_s,
        "layer_s": layer_s,
        "layer_ratio": [t / f for t, f in zip(layer_s, layer_floor_s)],
        "step_bytes": step_bytes,
        "step_floor_s": step_bytes / copy,
        "step_s": entry["step_s"],
        "step_ratio": entry["step_s"] / (step_bytes / copy),
        "eager_over_graph": (entry["eager_step_s"] / entry["step_s"]) if entry.get("eager_step_s") else None,
        "model43_step_s": t43,
        "model43_floor_s": floor43,
        "model43_ratio": t43 / floor43,
        "model43_tok_s": entry["batch_size"] / t43,
        "model43_floor_tok_s": entry["batch_size"] / floor43,
        "stand_ins": stand_ins,
        "kernels_per_layer": _kernels_per_layer(entry, len(kinds)),
        "kernel_floors": kernel_floors(entry, len(kinds), copy),
    }


def kernel_floors(entry: dict, num_layers: int, copy_bytes_per_s: float) -> list[dict] | None:
    """Per layer and kernel name: the profiled device µs of one step, launches, the floor of the bytes the
    kernel must read (`layers_floors.kernel_read_bytes`) and their ratio (None where either is missing)."""
    pieces, read_bytes = entry.get("kernels_per_piece"), entry.get("kernel_read_bytes_per_layer")
    if not pieces or not read_bytes:
        return None
    out = []
    for layer in range(num_layers):
        measured = {name: (us, count) for name, us, count in pieces[f"layer{layer}"]["top"]}
        rows = {}
        for name in sorted(set(measured) | set(read_bytes[layer])):
            us, launches = measured.get(name, (None, 0))
            floor_us = read_bytes[layer].get(name, 0.0) / copy_bytes_per_s * 1e6
            rows[name] = {"device_us": us, "launches": launches, "floor_us": floor_us,
                          "x_floor": us / floor_us if us and floor_us > 0 else None}
        out.append(rows)
    return out


def _kernels_per_layer(entry: dict, num_layers: int) -> list[float] | None:
    """Kernels the profiler saw in one replay of each layer's graph (None when not profiled)."""
    pieces = entry.get("kernels_per_piece")
    if not pieces:
        return None
    return [pieces[f"layer{i}"]["kernels"] for i in range(num_layers)]


def _prefill_summary(entry: dict, raw: dict, config, kinds: list[AttentionKind]) -> dict:
    copy, flops = raw["ceilings"]["copy_bytes_per_s"], raw["ceilings"]["bf16_flops_per_s"]
    info = raw["bytes"]
    all_expert_bytes = config.n_routed_experts * info["expert_bytes"]
    layer_s = [entry["piece_s"][f"layer{i}"] for i in range(len(kinds))]
    flop_floor = [f / flops for f in entry["layer_flops"]]
    byte_floor = [(b + all_expert_bytes) / copy for b in info["layer_weight_bytes"]]
    layer_floor = [max(a, b) for a, b in zip(flop_floor, byte_floor)]
    fixed_s = entry["piece_s"]["embed"] + entry["piece_s"]["head"]
    t43, stand_ins = floors.extrapolate(_per_kind(layer_s, kinds), fixed_s)
    head_floor = max(entry["head_flops"] / flops, info["head_weight_bytes"] / copy)
    floor43, _ = floors.extrapolate(_per_kind(layer_floor, kinds), head_floor)
    return {
        "num_tokens": entry["num_tokens"],
        "expert_path": entry.get("expert_path", "fused"),
        "fp8_path": entry.get("fp8_path", "kernel"),
        "attention_path": entry.get("attention_path"),
        "layer_s": layer_s,
        "layer_floor_s": layer_floor,
        "layer_ratio": [t / f for t, f in zip(layer_s, layer_floor)],
        "fraction_of_bf16": sum(flop_floor) / sum(layer_s),
        "step_s": entry["step_s"],
        "model43_s": t43,
        "model43_floor_s": floor43,
        "model43_tok_s": entry["num_tokens"] / t43,
        "model43_floor_tok_s": entry["num_tokens"] / floor43,
        "stand_ins": stand_ins,
    }


def summarize(raw: dict, config, kinds: list[AttentionKind], goals: dict) -> dict:
    decode = [_decode_summary(e, raw, config, kinds) for e in raw["decode"]]
    prefill = [_prefill_summary(e, raw, config, kinds) for e in raw["prefill"]]
    hf = raw.get("transformers", {})
    hf_ratio = {}
    for item in hf.get("decode", []):
        ours = next((d for d in decode if d["batch_size"] == item["batch_size"]), None)
        if ours:
            hf_ratio[str(item["batch_size"])] = {
                "transformers_step_s": item["step_s"], "ours_step_s": ours["step_s"],
                "transformers_over_ours": item["step_s"] / ours["step_s"],
                "transformers_over_floor": item["step_s"] / ours["step_floor_s"]}
    disagg = _disaggregated_summary(raw, decode)
    out_goals = _goals(decode, prefill, goals)
    for batch, target in goals.get("disaggregated_max_ratio", {}).items():
        best = disagg["best_by_batch"].get(str(batch))
        value = best["ratio_to_in_process"] if best else None
        out_goals[f"disaggregated_b{batch}_ratio"] = {"target": target, "value": value,
                                                      "met": None if value is None else value <= target}
    return {"decode": decode, "prefill": prefill, "transformers": hf_ratio, "disaggregated": disagg,
            "goals": out_goals}


def _disaggregated_summary(raw: dict, decode: list[dict]) -> dict:
    """Each disaggregated step against the in-process CUDA-graph step of the same batch in this run
    (when measured) and against the in-process eager step through the same ModelRunner."""
    graph_step = {d["batch_size"]: d["step_s"] for d in decode}
    rows = []
    for run in raw.get("disaggregated", {}).get("runs", []):
        if "disaggregated_step_s" not in run:  # a failed graph capture, kept in raw
            continue
        reference = graph_step.get(run["batch_size"])
        rows.append({**run, "in_process_graph_step_s": reference,
                     "ratio_to_in_process_graph": run["disaggregated_step_s"] / reference if reference else None})
    best: dict[str, dict] = {}
    for row in rows:
        if row["data_plane"] == "in_process":  # a reference row (segment graphs, experts in this process)
            continue
        # the goal's in-process step is the CUDA-graph step of this run (`decode`); the eager
        # in-process step of the same ModelRunner stands in only where that was not measured (CPU)
        ratio = row["ratio_to_in_process_graph"] or row["ratio_to_in_process_eager"]
        key = str(row["batch_size"])
        if key not in best or ratio < best[key]["ratio_to_in_process"]:
            best[key] = {"ratio_to_in_process": ratio, "data_plane": row["data_plane"],
                         "micro_batches": row["micro_batches"], "graphs": bool(row.get("graphs")),
                         "disaggregated_step_s": row["disaggregated_step_s"]}
    return {"runs": rows, "best_by_batch": best}


def _goals(decode: list[dict], prefill: list[dict], goals: dict) -> dict:
    out = {}

    def check(name: str, value: float | None, target: float, at_most: bool) -> None:
        if value is None:
            out[name] = {"target": target, "value": None, "met": None}
            return
        out[name] = {"target": target, "value": value, "met": value <= target if at_most else value >= target}

    by_batch = {d["batch_size"]: d for d in decode}
    b1, b64 = by_batch.get(1), by_batch.get(64)
    check("decode_b1_layer_ratio", max(b1["layer_ratio"]) if b1 else None, goals["decode_b1_max_ratio"], True)
    check("decode_b64_layer_ratio", max(b64["layer_ratio"]) if b64 else None, goals["decode_b64_max_ratio"], True)
    # several routed-expert paths may be timed per length: the goals take the fastest
    p8 = min((p for p in prefill if p["num_tokens"] == 8192), key=lambda p: sum(p["layer_s"]), default=None)
    check("prefill_8k_fraction_of_bf16", p8["fraction_of_bf16"] if p8 else None,
          goals["prefill_8k_min_fraction_of_bf16"], False)
    check("single_stream_tok_s", b1["model43_tok_s"] if b1 else None, goals["single_stream_min_tok_s"], False)
    kernels = b1.get("kernels_per_layer") if b1 else None
    check("decode_b1_kernels_per_layer", max(kernels) if kernels else None,
          goals["decode_b1_max_kernels_per_layer"], True)
    longest = max(prefill, key=lambda p: (p["num_tokens"], p["model43_tok_s"])) if prefill else None
    check("prefill_tok_s", longest["model43_tok_s"] if longest else None, goals["prefill_min_tok_s"], False)
    return out


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f}"


def print_table(raw: dict, ratios: dict) -> None:
    ceilings = raw["ceilings"]
    print(f"\ndevice ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"matmul {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; layers {','.join(raw['config']['layers'])}, "
          f"context {raw['args']['context']}")
    print("\nDECODE (per layer; us)   batch | layer time | floor | ratio | step us (floor) | 43L tok/s (floor) | eager/graph")
    for d in ratios["decode"]:
        layers = " ".join(f"{_us(t)}/{_us(f)}/{r:.1f}x" for t, f, r in zip(d["layer_s"], d["layer_floor_s"],
                                                                      d["layer_ratio"]))
        eager = f"{d['eager_over_graph']:.1f}" if d["eager_over_graph"] else "-"
        kernels = "/".join(f"{k:.0f}" for k in d["kernels_per_layer"]) if d.get("kernels_per_layer") else "-"
        print(f"  b={d['batch_size']:<3} {layers} | {_us(d['step_s'])} ({_us(d['step_floor_s'])}) | "
              f"{d['model43_tok_s']:,.0f} ({d['model43_floor_tok_s']:,.0f}) | {eager} | kernels/layer {kernels}")
        for layer, rows in enumerate(d.get("kernel_floors") or []):
            cells = [f"{name.strip('_').removesuffix('_kernel')} {r['device_us']:.1f}/{r['floor_us']:.1f}"
                     + (f"={r['x_floor']:.1f}x" if r["x_floor"] else "")
                     for name, r in sorted(rows.items(), key=lambda item: -(item[1]["device_us"] or 0))
                     if r["device_us"] is not None]
            print(f"        layer{layer} kernels us/floor: " + ", ".join(cells))
    print("\nPREFILL (per layer; ms)  tokens | layer time/floor/ratio | bf16 share | 43L tok/s (floor)")
    for p in ratios["prefill"]:
        layers = " ".join(f"{t * 1e3:.1f}/{f * 1e3:.1f}/{r:.1f}x" for t, f, r in zip(p["layer_s"], p["layer_floor_s"],
                                                                                 p["layer_ratio"]))
        print(f"  P={p['num_tokens']:<5} {p['expert_path']:>7}/{p['fp8_path']:<7} attn {p['attention_path']} "
              f"{layers} | {p['fraction_of_bf16']:.2f} | "
              f"{p['model43_tok_s']:,.0f} ({p['model43_floor_tok_s']:,.0f})")
    hf = raw.get("transformers", {})
    if ratios["transformers"]:
        print(f"\nTRANSFORMERS {hf.get('version')} ({hf.get('dtype')}): batch | step ms | / ours | / floor")
        for batch, r in ratios["transformers"].items():
            print(f"  b={batch:<3} {r['transformers_step_s'] * 1e3:.2f} | {r['transformers_over_ours']:.2f}x | "
                  f"{r['transformers_over_floor']:.1f}x")
    disagg = ratios.get("disaggregated", {}).get("runs", [])
    if disagg:
        print("\nDISAGGREGATED (same device, expert worker process): batch | plane | micro-batches | graphs | "
              "step ms | in-process eager ms | ratio | / in-process graph | identical")
        for r in disagg:
            graph = f"{r['ratio_to_in_process_graph']:.2f}x" if r["ratio_to_in_process_graph"] else "-"
            reference = r.get("in_process_reference_step_s", r["in_process_eager_step_s"])
            print(f"  b={r['batch_size']:<3} {r['data_plane']:>8} | {r['micro_batches']} | {bool(r.get('graphs'))} | "
                  f"{r['disaggregated_step_s'] * 1e3:.2f} | {reference * 1e3:.2f} | "
                  f"{r['ratio_to_in_process_eager']:.2f}x | {graph} | {r.get('identical', '-')}")
    if "error" in hf or "skipped" in hf:
        print(f"\ntransformers: {hf.get('error') or hf.get('skipped')}")
    print("\nGOALS")
    for name, goal in ratios["goals"].items():
        value = "n/a" if goal["value"] is None else f"{goal['value']:.3g}"
        print(f"  {name}: {value} (target {goal['target']}) -> {goal['met']}")
