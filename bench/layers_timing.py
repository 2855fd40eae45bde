"""Timing machinery of `bench.layers`: device ceilings, decode steps (CUDA graphs) and prefill.

A step is cut into pieces: `embed`, one piece per layer (attention block, gate, shared and
routed experts, mHC), `head` (hc_head, final norm, logits). Each piece is timed on its own, so
per-layer figures and the 43-layer extrapolation come from one measured stack.

Decode on CUDA: for each of `num_graph_steps` consecutive decode positions the step runs once
eagerly (warm-up: Triton compilation, cuBLAS handles), is rolled back (`SequenceState.rollback`),
and is captured piece by piece into CUDA graphs that share one memory pool. Replaying the graphs
of steps 0..S-1 in order reproduces exactly those S steps (the state's Python counters moved once,
at capture; the device writes of each replay are the same), so replays can be repeated and timed
with events between pieces. S = 4 covers one CSA window close (a compressed row emitted).
Elsewhere (CPU) every step runs eagerly, timed by the host clock, then is rolled back.
Legend: B sequences in the batch, T tokens, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moemesh.bench.timing import Marks, median, time_s, wall_s
from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.common.model.moe import routed_answer
from moemesh.common.model.random_init import fill_random_context, new_sequence_state

Piece = tuple[str, Callable[[], None]]


@dataclass(frozen=True)
class TimedPieces:
    """Median seconds per piece name (`embed`, `layer0`, ..., `head`) and per whole step."""

    piece_s: dict[str, float]
    step_s: float
    eager_step_s: float | None = None
    attention_path: str | None = None  # prefill: "kernels" (batched Triton attention) or "torch" (reference loop)
    kernels: dict | None = None  # decode in graphs: per piece, what the profiler saw in one replay (`profile_pieces`)
    distinct_experts: list[float] | None = None  # decode: per layer, distinct routed experts of the timed steps (mean)


def measure_ceilings(device: torch.device) -> dict:
    """Copy bandwidth (read + write bytes) and bf16 (fp32 on CPU) matmul rate of `device`."""
    if device.type == "cuda":
        from moemesh.bench.kernels import measure_ceilings as cuda_ceilings

        return cuda_ceilings()
    num_bytes, size = 256 * 1024**2, 1024
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = _host_median(lambda: dst.copy_(src), 5)
    a, b = torch.randn(size, size), torch.randn(size, size)
    mm_s = _host_median(lambda: a @ b, 5)
    return {"copy_bytes_per_s": 2 * num_bytes / copy_s, "bf16_flops_per_s": 2 * size**3 / mm_s,
            "note": "CPU: fp32 matmul rate"}


def _host_median(fn: Callable[[], object], reps: int) -> float:
    return median(time_s(fn, "cpu", warmup=1, repeats=reps))


def step_pieces(side, experts, batch: ForwardBatch, token_ids: torch.Tensor,
                logits_indices: torch.Tensor | None = None,
                routed_ids: dict[int, torch.Tensor] | None = None) -> list[Piece]:
    """The pieces of one forward (the `ReferenceModel.forward` loop, cut at layer boundaries).

    Piece i writes streams[i] (the embedding, then each layer's output) and layer i reads streams[i]; every one is
    kept, never rebound, so no piece's input returns to the memory pool while its graph lives (graphs of all steps
    share one pool, and `profile_pieces` replays one piece of every step before the next piece).
    `batch.finish()` is the caller's. routed_ids: each layer's gate ids [T, K] are kept there (in a captured graph,
    the buffer every replay rewrites)."""
    streams: list[torch.Tensor] = []  # [T, N, D] each

    def embed() -> None:
        streams.append(side.embed_tokens(token_ids, batch))  # the forward's RoPE tables too

    def layer_piece(layer: int) -> Callable[[], None]:
        def run() -> None:
            h = side.attn_block(layer, streams[layer], batch)
            x, post, comb = side.ffn_pre(layer, h)
            ids, weights = side.gate(layer, x, token_ids)
            if routed_ids is not None:
                routed_ids[layer] = ids
            shared = side.shared_expert(layer, x)
            routed = routed_answer(experts, layer, x, ids, weights)  # [T, K, D] per slot, or [T, D]
            streams.append(side.ffn_post(layer, routed, h, post, comb, shared=shared))
        return run

    def head() -> None:
        side.logits(streams[-1], logits_indices)  # [T or B, V]

    num_layers = side.config.num_hidden_layers
    return [("embed", embed)] + [(f"layer{i}", layer_piece(i)) for i in range(num_layers)] + [("head", head)]


def decode_states(config, num_sequences: int, context_tokens: int, dtype, device, seed: int) -> list:
    """`num_sequences` states, each holding a random `context_tokens`-token history."""
    generator = torch.Generator(device=device).manual_seed(seed)
    states = []
    for _ in range(num_sequences):
        state = new_sequence_state(config, context_tokens + 64, dtype, device)
        fill_random_context(state, context_tokens, generator=generator)
        states.append(state)
    return states


def _decode_batch(states, device) -> ForwardBatch:
    return ForwardBatch([SequenceChunk(state, 1) for state in states], device)


def _rollback(states, num_tokens: int = 1) -> None:
    for state in states:
        state.rollback(num_tokens)


def _decode_token_ids(side, states, vocab_size: int, seed: int) -> torch.Tensor:
    device = side.head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, vocab_size, (len(states),), generator=generator, device=device)  # [B]


def _distinct_experts(routed_ids_per_step: list[dict[int, torch.Tensor]]) -> list[float]:
    """Per layer, the mean over steps of the distinct experts its gate selected: the experts those steps read."""
    num_layers = len(routed_ids_per_step[0])
    return [sum(int(torch.unique(step[layer]).numel()) for step in routed_ids_per_step) / len(routed_ids_per_step)
            for layer in range(num_layers)]


def time_decode(side, experts, states, vocab_size: int, *, num_steps: int, num_graph_steps: int = 4,
                use_graphs: bool = True, seed: int = 0, profile_kernels: bool = False) -> TimedPieces:
    """Median time of one decode step (one new token for every state) and of each piece, and the distinct routed
    experts each layer's gate selected in the timed steps (read back from them, replays included); with
    `profile_kernels` (graphs only) also the kernels of each piece's replay (`profile_pieces`)."""
    device = side.head.weight.device
    token_ids = _decode_token_ids(side, states, vocab_size, seed)
    if device.type != "cuda" or not use_graphs:
        return _time_eager(side, experts, states, token_ids, num_steps)
    return _time_graphs(side, experts, states, token_ids, num_steps, num_graph_steps, profile_kernels)


def _time_eager(side, experts, states, token_ids, num_steps: int) -> TimedPieces:
    device = token_ids.device
    per_piece: dict[str, list[float]] = {}
    steps = []
    routed_ids: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for rep in range(num_steps + 1):  # the first is warm-up
            batch = _decode_batch(states, device)
            times = {}
            for name, run in step_pieces(side, experts, batch, token_ids, routed_ids=routed_ids):
                times[name] = wall_s(run, device, repeats=1)[0]
            batch.finish()
            _rollback(states)
            if rep:
                for name, seconds in times.items():
                    per_piece.setdefault(name, []).append(seconds)
                steps.append(sum(times.values()))
    return TimedPieces({n: median(v) for n, v in per_piece.items()}, median(steps),
                       distinct_experts=_distinct_experts([routed_ids]))


def _time_graphs(side, experts, states, token_ids, num_steps: int, num_graph_steps: int,
                 profile_kernels: bool = False) -> TimedPieces:
    device = token_ids.device
    pool = torch.cuda.graph_pool_handle()
    captured: list[list[tuple[str, torch.cuda.CUDAGraph]]] = []
    routed_ids_per_step: list[dict[int, torch.Tensor]] = []  # the captured steps' gate ids, rewritten by replays
    keep_alive = []  # the pieces' closures and buffers must outlive the graphs
    eager_steps = []
    side_stream = torch.cuda.Stream(device)
    with torch.inference_mode():
        for _ in range(num_graph_steps):
            batch = _decode_batch(states, device)
            side_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side_stream):  # warm-up outside the capture, then undo it
                pieces = step_pieces(side, experts, batch, token_ids)
                eager_steps.append(wall_s(lambda: [run() for _, run in pieces], device, repeats=1)[0])
            torch.cuda.current_stream(device).wait_stream(side_stream)
            batch.finish()
            _rollback(states)
            batch = _decode_batch(states, device)
            routed_ids_per_step.append({})
            pieces = step_pieces(side, experts, batch, token_ids, routed_ids=routed_ids_per_step[-1])
            graphs = []
            for name, run in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    run()
                graphs.append((name, graph))
            batch.finish()  # the states now stand after this step, as the replay leaves them
            captured.append(graphs)
            keep_alive.append((batch, pieces))
        for step_graphs in captured:  # one untimed pass
            for _, graph in step_graphs:
                graph.replay()
        torch.cuda.synchronize(device)
        per_piece: dict[str, list[float]] = {}
        step_samples = []
        for _ in range(num_steps):
            marks = Marks(device)
            for step_graphs in captured:
                for name, graph in step_graphs:
                    marks.mark(name)
                    graph.replay()
            sums = marks.seconds()  # summed over the captured steps
            for name, seconds in sums.items():
                per_piece.setdefault(name, []).append(seconds / num_graph_steps)
            step_samples.append(sum(sums.values()) / num_graph_steps)
        distinct = _distinct_experts(routed_ids_per_step)  # as the timed replays left them
        kernels = profile_pieces(captured, device) if profile_kernels else None
    del captured, keep_alive, routed_ids_per_step
    torch.cuda.synchronize(device)
    return TimedPieces({n: median(v) for n, v in per_piece.items()}, median(step_samples),
                       eager_step_s=median(eager_steps[1:] or eager_steps), kernels=kernels,
                       distinct_experts=distinct)


def profile_pieces(captured: list[list[tuple[str, "torch.cuda.CUDAGraph"]]], device: torch.device,
                   num_top: int = 40) -> dict:
    """Kernels per replay of each piece's graphs, seen by torch.profiler (CUPTI records the kernels a graph
    launches): {piece: {"kernels": n, "copies": n, "device_us": t, "top": [[name, us, count], ...]}}, each
    figure per replay, averaged over the captured steps (a CSA step that closes a window runs more)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    num_steps = len(captured)
    for index, (name, _) in enumerate(captured[0]):
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for step_graphs in captured:
                step_graphs[index][1].replay()
            torch.cuda.synchronize(device)
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        is_copy = [e.key.startswith(("Memcpy", "Memset")) for e in events]
        out[name] = {
            "kernels": sum(e.count for e, c in zip(events, is_copy) if not c) / num_steps,
            "copies": sum(e.count for e, c in zip(events, is_copy) if c) / num_steps,
            "device_us": sum(e.self_device_time_total for e in events) / num_steps,
            "top": [[e.key[:120], round(e.self_device_time_total / num_steps, 2), e.count / num_steps]
                    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:num_top]],
        }
    return out


def time_prefill(side, experts, config, num_tokens: int, *, num_reps: int, seed: int = 0) -> TimedPieces:
    """One sequence, all `num_tokens` prompt tokens in one forward (logits of the last only).

    Eager (a prefill is thousands of tokens per launch); pieces timed with events on CUDA."""
    device = side.head.weight.device
    generator = torch.Generator(device=device).manual_seed(seed)
    token_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator, device=device)
    per_piece: dict[str, list[float]] = {}
    steps = []
    for rep in range(num_reps + 1):  # the first is warm-up
        # The state is made outside inference mode: the kernels' address tables find a preallocated row
        # store's tensor through a view's `_base`, which inference tensors do not keep (made inside it, the
        # prefill would fall back to the per-sequence torch attention).
        state = new_sequence_state(config, num_tokens + 64, side.dtype, device)
        with torch.inference_mode():
            batch = ForwardBatch([SequenceChunk(state, num_tokens)], device)
            last = torch.full((1,), num_tokens - 1, device=device, dtype=torch.int64)
            times = _run_timed(step_pieces(side, experts, batch, token_ids, last), device)
            batch.finish()
            attention_path = "kernels" if batch.attention_tables is not None else "torch"
        del state, batch
        if rep:
            for name, seconds in times.items():
                per_piece.setdefault(name, []).append(seconds)
            steps.append(sum(times.values()))
    return TimedPieces({n: median(v) for n, v in per_piece.items()}, median(steps),
                       attention_path=attention_path)


def _run_timed(pieces: list[Piece], device: torch.device) -> dict[str, float]:
    """Seconds per piece in one pass: CUDA events between pieces (no sync in between), the host clock on the CPU."""
    marks = Marks(device)
    for name, run in pieces:
        marks.mark(name)
        run()
    return marks.seconds()
