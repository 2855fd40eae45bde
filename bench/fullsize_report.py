"""Where the time of a `bench.fullsize` run went, its weight-bandwidth floor, and the printed table.

Per measured step (all from timestamps taken during the run, none modelled):
- `step_s`: wall time of `AttentionWorker.step` (ends once the sampled tokens are on the host);
- `wait_s`: time the attention worker was blocked in `MoEDispatcher.finish` (waiting for answers);
- `attention_side_s` = step_s - wait_s: embedding, attention, gate, shared expert, dispatch packing,
  head and sampling on the attention device, host time included (the dispatch reads the routing ids
  to the host every layer, so this part is synchronous with the device);
- `expert_s[worker]`: Σ over its Dispatches of arrival -> answer ready (device-synchronised);
- `transfer_and_queue_s`: Σ over layers of (round trip from building the Dispatch to the last answer)
  minus the slowest worker's compute for that layer: serialisation, ZeroMQ, host<->device copies,
  queueing (the shared expert runs inside this window, overlapped); split along the hop of the worker
  that answered last: `dispatch_build_s` (routing tables, masks, staging copies, sends), `inbound_s`
  (sends done -> its arrival in the worker, after decoding), `outbound_s` (its answer ready, or the
  attention side reaching `finish` if later -> the routed output on the attention device).
Floor: each layer must read its attention-side weights and the near experts it touched on the
attention device, and the far experts it touched on the far device, in parallel:
Σ_layers max(near_bytes / near_bw, far_bytes / far_bw) + head / near_bw, with the experts touched
counted by the workers (distinct experts per Dispatch) and bandwidths measured in the same run.
Legend: L layers, W expert workers.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any

from moemesh.bench.timing import floor_s as _bytes_floor_s
from moemesh.bench.timing import median

_median0 = partial(median, empty=0.0)  # a field no step measured reads 0


def analyse_steps(steps, dispatch_records: list[list[float]], expert_timings: dict[str, dict], *,
                  near_worker: str, far_worker: str, layer_bytes: list[int], head_bytes: int, embed_row_bytes: int,
                  near_bw: float, far_bw: float, top_k: int | None = None) -> dict[str, Any]:
    """Breakdown, token shares and floors of `steps` (TimedStep list); see the module docstring."""
    step_ids = {s.step_id for s in steps}
    rounds = defaultdict(list)  # step -> [(layer, start_begin, finish_end, finish_begin)]
    sent_at = {}  # (step, layer, micro-batch) -> (start_begin, start_end, finish_begin, finish_end)
    for step_id, layer, mb, start_begin, start_end, finish_begin, finish_end in dispatch_records:
        if step_id in step_ids:
            rounds[step_id].append((int(layer), start_begin, finish_end, finish_begin))
            sent_at[(step_id, int(layer), int(mb))] = (start_begin, start_end, finish_begin, finish_end)
    # the hop of the worker that answered last, per (step, layer, micro-batch): (began, ended) on its clock
    last_hop: dict[tuple[int, int, int], tuple[float, float]] = {}
    for timing in expert_timings.values():
        for step_id, layer, mb, _tokens, _slots, _experts, began, ended in timing["records"]:
            key = (step_id, int(layer), int(mb))
            if key in sent_at and (key not in last_hop or ended > last_hop[key][1]):
                last_hop[key] = (began, ended)
    hops = defaultdict(lambda: [0.0, 0.0, 0.0])  # step -> [build_and_send, inbound, outbound] seconds
    for key, (start_begin, start_end, finish_begin, finish_end) in sent_at.items():
        if key not in last_hop:
            continue
        began, ended = last_hop[key]
        totals = hops[key[0]]
        totals[0] += start_end - start_begin
        totals[1] += max(0.0, began - start_end)
        totals[2] += max(0.0, finish_end - max(ended, finish_begin))
    compute = defaultdict(float)  # (step, worker) -> s
    layer_compute = defaultdict(float)  # (step, layer, worker) -> s
    touched = defaultdict(int)  # (step, layer, worker) -> experts
    slots = defaultdict(int)  # worker -> slots over all steps
    num_empty = defaultdict(int)  # worker -> Dispatches with tokens but no selected slot (must stay 0)
    layer_slots = defaultdict(int)  # (step, layer) -> slots received by all workers
    for name, timing in expert_timings.items():
        for step_id, layer, _mb, _tokens, num_slots, num_experts, began, ended in timing["records"]:
            if step_id not in step_ids:
                continue
            compute[(step_id, name)] += ended - began
            layer_compute[(step_id, int(layer), name)] += ended - began
            touched[(step_id, int(layer), name)] += num_experts
            slots[name] += num_slots
            layer_slots[(step_id, int(layer))] += num_slots
            num_empty[name] += int(_tokens > 0 and num_slots == 0)
    bytes_per_expert = max((t.get("bytes_per_expert", 0) for t in expert_timings.values()), default=0)
    per_step = []
    for step in steps:
        wait_s = sum(fe - fb for _l, _sb, fe, fb in rounds[step.step_id])
        transfer_s = 0.0
        floor_s = _bytes_floor_s(head_bytes + step.num_tokens * embed_row_bytes, near_bw)
        near_bytes = far_bytes = 0
        for layer, start_begin, finish_end, _fb in rounds[step.step_id]:
            slowest = max(layer_compute.get((step.step_id, layer, w), 0.0) for w in (near_worker, far_worker))
            transfer_s += max(0.0, finish_end - start_begin - slowest)
        for layer in range(len(layer_bytes)):
            near_layer = layer_bytes[layer] + touched.get((step.step_id, layer, near_worker), 0) * bytes_per_expert
            far_layer = touched.get((step.step_id, layer, far_worker), 0) * bytes_per_expert
            near_bytes += near_layer
            far_bytes += far_layer
            floor_s += max(_bytes_floor_s(near_layer, near_bw), _bytes_floor_s(far_layer, far_bw) if far_bw else 0.0)
        per_step.append({"step_id": step.step_id, "num_tokens": step.num_tokens, "step_s": step.wall_s,
                         "wait_s": wait_s, "attention_side_s": step.wall_s - wait_s,
                         "expert_s": {w: compute.get((step.step_id, w), 0.0) for w in (near_worker, far_worker)},
                         "transfer_and_queue_s": transfer_s, "near_bytes": near_bytes + head_bytes,
                         "dispatch_build_s": hops[step.step_id][0], "inbound_s": hops[step.step_id][1],
                         "outbound_s": hops[step.step_id][2],
                         "far_bytes": far_bytes, "floor_s": floor_s,
                         "experts_touched": {w: sum(touched.get((step.step_id, l, w), 0)
                                                    for l in range(len(layer_bytes)))
                                             for w in (near_worker, far_worker)}})
    total_slots = sum(slots.values())
    tokens_of = {s.step_id: s.num_tokens for s in steps}
    short_layers = ([[step_id, layer, layer_slots.get((step_id, layer), 0), tokens_of[step_id] * top_k]
                     for step_id in sorted(tokens_of) for layer in range(len(layer_bytes))
                     if layer_slots.get((step_id, layer), 0) != tokens_of[step_id] * top_k]
                    if top_k is not None else [])
    summary = {
        "num_steps": len(per_step),
        "step_s": _median0([s["step_s"] for s in per_step]),
        "attention_side_s": _median0([s["attention_side_s"] for s in per_step]),
        "wait_s": _median0([s["wait_s"] for s in per_step]),
        "near_expert_s": _median0([s["expert_s"][near_worker] for s in per_step]),
        "far_expert_s": _median0([s["expert_s"][far_worker] for s in per_step]),
        "transfer_and_queue_s": _median0([s["transfer_and_queue_s"] for s in per_step]),
        # the slowest worker's hop per layer, summed over layers: building + sending the Dispatches (routing
        # tables, masks, staging copies), send end -> its arrival (wire + queue + decode), its answer ready
        # (or the attention side at finish, whichever is later) -> routed output on the attention device
        "dispatch_build_s": _median0([s["dispatch_build_s"] for s in per_step]),
        "inbound_s": _median0([s["inbound_s"] for s in per_step]),
        "outbound_s": _median0([s["outbound_s"] for s in per_step]),
        "floor_s": _median0([s["floor_s"] for s in per_step]),
        "near_bytes": _median0([s["near_bytes"] for s in per_step]),
        "far_bytes": _median0([s["far_bytes"] for s in per_step]),
        "near_slot_share": slots[near_worker] / total_slots if total_slots else None,
        "far_slot_share": slots[far_worker] / total_slots if total_slots else None,
        "num_routed_slots": total_slots,
        "num_dispatches_without_slots": dict(num_empty),
        # what the workers should have received in total: every token's top-k slots in every layer
        "layers_with_wrong_slot_count": short_layers[:50],  # [step, layer, received, expected]
        "expected_routed_slots": (sum(s.num_tokens for s in steps) * top_k * len(layer_bytes)
                                  if top_k is not None else None),
    }
    far_experts = sum(s["experts_touched"][far_worker] for s in per_step)
    far_s = sum(s["expert_s"][far_worker] for s in per_step)
    summary["far_expert_read_bytes_per_s"] = far_experts * bytes_per_expert / far_s if far_s else None
    near_experts = sum(s["experts_touched"][near_worker] for s in per_step)
    near_s = sum(s["expert_s"][near_worker] for s in per_step)
    summary["near_expert_read_bytes_per_s"] = near_experts * bytes_per_expert / near_s if near_s else None
    if summary["step_s"] and summary["floor_s"]:
        summary["ratio_to_floor"] = summary["step_s"] / summary["floor_s"]
    return {"summary": summary, "steps": per_step}


def _hops_ms(summary: dict[str, Any]) -> str:
    parts = [summary.get(k) for k in ("dispatch_build_s", "inbound_s", "outbound_s")]
    return "/".join("-" if p is None else f"{p * 1e3:.0f}" for p in parts)


def print_table(result: dict[str, Any]) -> None:
    placement = result["placement"]
    print(f"\nfullsize: {result['num_layers']} layers, experts near={placement['near_device']} "
          f"({placement['num_near_experts']}) far={placement['far_device']} ({placement['num_far_experts']}); "
          f"bandwidth near {result['bandwidth']['near_bytes_per_s'] / 1e9:.0f} GB/s, far "
          f"{result['bandwidth']['far_bytes_per_s'] / 1e9:.0f} GB/s")
    header = (f"{'routing':8} {'B':>3} {'tok/s':>8} {'step ms':>9} {'attn ms':>8} {'near ms':>8} {'far ms':>8} "
              f"{'xfer ms':>8} {'bld/in/out ms':>15} {'floor ms':>9} {'x floor':>8} {'near %':>7} {'steps':>5}")
    print(header)
    for run in result["decode"]:
        if "error" in run:
            print(f"{run['routing']:8} {run['batch']:>3}  failed: {run['error'][:150]}")
            continue
        s = run["summary"]
        share = 100 * s["near_slot_share"] if s["near_slot_share"] is not None else float("nan")
        print(f"{run['routing']:8} {run['batch']:>3} {run['tokens_per_s']:>8.2f} {s['step_s'] * 1e3:>9.1f} "
              f"{s['attention_side_s'] * 1e3:>8.1f} {s['near_expert_s'] * 1e3:>8.1f} {s['far_expert_s'] * 1e3:>8.1f} "
              f"{s['transfer_and_queue_s'] * 1e3:>8.1f} "
              f"{_hops_ms(s):>15} {s['floor_s'] * 1e3:>9.2f} "
              f"{s.get('ratio_to_floor', float('nan')):>8.1f} {share:>7.1f} {s['num_steps']:>5}")
    for run in result.get("prefill", []):
        if "error" in run:
            print(f"prefill {run['num_tokens']}: {run['error'][:200]}")
            continue
        s = run["summary"]
        print(f"prefill {run['num_tokens']:>5} tokens ({run['routing']}): {s['step_s']:.2f} s, "
              f"{run['tokens_per_s']:.0f} tok/s, attention side {s['attention_side_s']:.2f} s, near experts "
              f"{s['near_expert_s']:.2f} s, far experts {s['far_expert_s']:.2f} s")
    if result.get("speculative"):
        from moemesh.bench.fullsize_spec import print_spec_rows

        print("speculation (tok/s = tokens gained / (verify step + drafter round trip); tau = tokens per sequence "
              "per verify step)")
        print_spec_rows(result["speculative"])


def markdown_rows(result: dict[str, Any], label: str) -> list[str]:
    """One markdown table row per decode run and prefill of a (possibly partial) fullsize result."""
    rows = []
    for run in result.get("decode", []):
        if "error" in run:
            rows.append(f"| {label} | {run['routing']} | {run['batch']} | failed: {run['error'][:120]} |||||||")
            continue
        s = run["summary"]
        rows.append(
            f"| {label} | {run['routing']} | {run['batch']} | {run['tokens_per_s']:.2f} | {s['step_s'] * 1e3:.1f} | "
            f"{s['attention_side_s'] * 1e3:.1f} / {s['near_expert_s'] * 1e3:.1f} / {s['far_expert_s'] * 1e3:.1f} / "
            f"{s['transfer_and_queue_s'] * 1e3:.1f} ({_hops_ms(s)}) | {s['floor_s'] * 1e3:.2f} | "
            f"{s.get('ratio_to_floor', 0):.1f} | "
            f"{100 * (s['near_slot_share'] or 0):.1f} / {100 * (s['far_slot_share'] or 0):.1f} | {s['num_steps']} |")
    for run in result.get("prefill", []):
        if "error" in run:
            rows.append(f"| {label} | prefill {run['num_tokens']} | 1 | failed: {run['error'][:120]} |||||||")
            continue
        s = run["summary"]
        rows.append(f"| {label} | prefill {run['num_tokens']} ({run['routing']}) | 1 | {run['tokens_per_s']:.0f} | "
                    f"{s['step_s'] * 1e3:.0f} | {s['attention_side_s'] * 1e3:.0f} / {s['near_expert_s'] * 1e3:.0f} / "
                    f"{s['far_expert_s'] * 1e3:.0f} / {s['transfer_and_queue_s'] * 1e3:.0f} | "
                    f"{s['floor_s'] * 1e3:.2f} | "
                    f"{s.get('ratio_to_floor', 0):.1f} | {100 * (s['near_slot_share'] or 0):.1f} / "
                    f"{100 * (s['far_slot_share'] or 0):.1f} | {run['num_steps']} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m moemesh.bench.fullsize_report LABEL=FILE ...`: the markdown tables of docs/performance.md (the decode
    and prefill table, then the speculative runs' table when any file has them)."""
    import json
    import sys
    from pathlib import Path

    from moemesh.bench.fullsize_spec import markdown_spec_rows

    print("| config | routing | B | tok/s | step ms | attention / near / far / transfer (build/in/out) ms | floor ms "
          "| x floor "
          "| near / far slot % | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    spec_rows = []
    for item in (sys.argv[1:] if argv is None else argv):
        label, _, path = item.partition("=")
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
        for row in markdown_rows(loaded.get("raw", loaded), label):
            print(row)
        spec_rows += markdown_spec_rows(loaded.get("raw", loaded), label)
    if spec_rows:
        print("\n| config | routing | B | drafts (width) | tok/s | tau | verify step ms (x plain step ms) | verify "
              "attention / wait ms | drafter round trip ms | x plain tok/s | output = plain |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in spec_rows:
            print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
