"""Timing of the serving attention worker's decode steps, eager vs CUDA graphs.

Builds a V4-Flash-width model of reduced depth with random weights (`random_model`), gives each of B
sequences a random history (`fill_random_context`), and times `ModelRunner.forward` decode steps with
and without `DecodeGraphs`, host clock with a device sync per step, medians. Positions advance every
step (nothing is rolled back), so the graph steps replay with changing positions as a serving worker
does. Routed experts either run in this process between the segments (`local`: eager, as the in-process
reference) or are replaced by zeros (`none`: the attention worker's own work only).

`python -m moemesh.bench.attention_graphs --batch 1,8,64 --layers 4 --context 4096 --out-dir DIR`
writes `attention-graphs-<stamp>.json` (bench.results_io). Legend: B sequences, L layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from moemesh.common.model.config import AttentionKind


@dataclass
class _Ticket:
    layer: int
    routed: torch.Tensor


class ZeroDispatcher:
    """No routed experts: the attention worker's own work only."""

    def start(self, step_id, micro_batch, layer, x, ids, weights) -> _Ticket:
        return _Ticket(layer, torch.zeros_like(x))

    def finish(self, ticket: _Ticket) -> torch.Tensor:
        return ticket.routed

    def device_step_ready(self, num_tokens: int) -> bool:
        """False: decode steps replay the segment graphs (what this benchmark times)."""
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(runner, states, token_ids, num_micro_batches: int, num_steps: int, device
                ) -> tuple[list[float], list[torch.Tensor]]:
    """(seconds per timed step, final streams of the first step (copies))."""
    from moemesh.common.model.batch import SequenceChunk
    from moemesh.services.attention.worker import split_micro_batches

    samples, first = [], []
    for step in range(num_steps + 2):  # two warm-ups (the graph path captures in the first)
        inputs = [(token_ids[g.start:g.stop], [SequenceChunk(states[i], 1) for i in g])
                  for g in split_micro_batches(len(states), num_micro_batches)]
        _sync(device)
        started = time.perf_counter()
        finals = runner.forward(step, inputs)
        _sync(device)
        if step == 0:
            first = [h.clone() for h in finals]
        if step >= 2:
            samples.append(time.perf_counter() - started)
    return samples, first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--layers", type=int, default=4, help="CSA/HCA alternating (plus 2 window layers first)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--experts", default="none,local")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--routed-experts", type=int, default=64)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny model on the CPU, graphs not captured "
                        "(the metadata path; run under TRITON_INTERPRET=1): checks this script, times nothing useful")
    args = parser.parse_args(argv)

    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.random_init import fill_random_context, flash_config, random_model
    from moemesh.common.model.state import SequenceState
    from moemesh.bench.checks.decode_graphs import LocalDispatcher
    from moemesh.services.attention.graph_decode import DecodeGraphConfig, DecodeGraphs
    from moemesh.services.attention.model_runner import ModelRunner

    kinds = [AttentionKind.WINDOW, AttentionKind.WINDOW] + [
        AttentionKind.CSA if i % 2 == 0 else AttentionKind.HCA for i in range(args.layers)]
    if args.smoke_cpu:
        from moemesh.bench.checks.attention import patch_interpreter_scalar_index
        from moemesh.common.model.random_init import tiny_flash_like_config

        patch_interpreter_scalar_index()
        device, dtype = torch.device("cpu"), "float32"
        config = tiny_flash_like_config(kinds, sliding_window=8, compress_rate_hca=8, index_topk=2)
    else:
        device, dtype = torch.device("cuda"), "bfloat16"
        config = flash_config(kinds, n_routed_experts=args.routed_experts)
    side, experts = random_model(config, device, numerics=NumericsConfig(dtype=dtype))
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        generator = torch.Generator(device=device).manual_seed(batch)
        base = []
        for _ in range(batch):
            state = SequenceState(config, dtype=side.dtype, device=device)
            fill_random_context(state, args.context, generator=generator)
            base.append(state)
        token_ids = torch.randint(0, config.vocab_size, (batch,), device=device)
        for experts_mode in args.experts.split(","):
            dispatcher = ZeroDispatcher() if experts_mode == "none" else LocalDispatcher(experts)
            result = {"batch": batch, "experts": experts_mode, "layers": len(kinds), "context": args.context,
                      "micro_batches": args.micro_batches}
            firsts = {}
            for mode in ("eager", "graphs"):
                states = [state.clone() for state in base]
                runner = ModelRunner(side, dispatcher)
                if mode == "graphs":
                    runner.graphs = DecodeGraphs(side, DecodeGraphConfig(capture=not args.smoke_cpu), device)
                with torch.inference_mode():
                    samples, firsts[mode] = _time_steps(runner, states, token_ids, args.micro_batches, args.steps,
                                                        device)
                result[f"{mode}_ms"] = round(1e3 * statistics.median(samples), 3)
                if mode == "graphs":
                    result["graph_steps"] = runner.graphs.stats.num_graph_steps
                    result["graph_eager_reasons"] = runner.graphs.stats.eager_reasons
                del states, runner
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            result["speedup"] = round(result["eager_ms"] / result["graphs_ms"], 2)
            result["first_step_bit_identical"] = all(torch.equal(a, b) for a, b in zip(firsts["eager"], firsts["graphs"]))
            print(result, flush=True)
            rows.append(result)
            if args.out_dir:  # what finished so far survives a wall-clock cap
                import json
                from pathlib import Path

                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.out_dir) / "attention-graphs-partial.json").write_text(json.dumps(rows, indent=1) + "\n")
    if args.out_dir:
        from pathlib import Path

        from moemesh.bench.results_io import write_result

        path = write_result("attention-graphs", {"rows": rows}, out_dir=Path(args.out_dir))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
