"""The in-process run `bench.fullsize --tiny` compares its split run against.

Same random model directory, same gate bias, every expert in one process, computed by the code the
CPU expert workers run (`services.expert.cpu_experts.expert_rows`, `ExpertPathExperts`), driven
through `ReferenceModel.forward` with the batches `LocalPlanner` gives the attention worker when
every prompt fits one step (all prompts in one forward, then one token per sequence per step). So
the linears see the same batch sizes and each expert the same rows, in the same order, as in the
split run, and with top-k = 2 (the tiny model) the per-worker partial sums add up in the reference's
order: the split run must equal this one exactly, bit for bit (what tests/test_bench_fullsize.py
checks). Why not `QuantizedRoutedExperts`' own torch path: it dequantises whole matrices and sums in
another order (agreement to ~1e-6 only), which would hide a transport bug that changes a few bits.
Legend: B sequences, V vocab, T tokens, K top-k, D hidden.
"""

from __future__ import annotations

import torch


def build_reference(model_dir: str, skew: float):
    """(ReferenceModel, config) in float32 on the CPU, with the run's routing skew applied."""
    from common.model.config import ModelConfig
    from common.model.reference import ReferenceModel
    from services.attention.random_weights import apply_routing_skew, random_attention_side_for
    from services.expert.placement import all_pairs
    from services.expert.random_weights import ExpertFill, build_random_experts, read_random_spec

    config, side = random_attention_side_for(model_dir, torch.float32, torch.device("cpu"))
    spec = read_random_spec(model_dir)
    apply_routing_skew(side, config, spec.seed, skew)
    experts = build_random_experts(ModelConfig.load(model_dir), all_pairs(config.num_hidden_layers,
                                                                          config.n_routed_experts),
                                   "cpu", spec, fill=ExpertFill.EXACT)
    return ReferenceModel(side, ExpertPathExperts(experts)), config


class ExpertPathExperts:
    """experts_fn(layer, x [T, D], ids [T, K], weights [T, K]) -> [T, D] through `expert_rows` (the CPU
    expert worker's path, on its own `CpuBlockRunner`), slots added in order as the workers add them."""

    def __init__(self, experts) -> None:
        from services.expert.cpu_experts import CpuBlockRunner

        self.experts = experts  # QuantizedRoutedExperts holding every pair
        self.runner = CpuBlockRunner(torch.get_num_threads())

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from common.model.moe import sum_slots_in_order
        from services.expert.cpu_experts import expert_rows

        experts = self.experts
        per_slot = expert_rows(experts._layers[layer], x, ids, weights, None, experts.swiglu_limit,
                               experts.route_weight_before_w2, self.runner)  # [T, K, D]
        return sum_slots_in_order(per_slot)


@torch.inference_mode()
def reference_generate(model, prompts: list[list[int]], max_tokens: int, before_decode=None
                       ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs per prompt, batched as described in the module docstring;
    before_decode() runs once between the prompt forward and the first decode forward."""
    from common.model.batch import SequenceChunk
    from services.attention.sampling.logprobs import chosen_logprobs

    states = [model.new_sequence() for _ in prompts]
    token_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    chunks = [SequenceChunk(state, len(p)) for state, p in zip(states, prompts)]
    ends = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    logits = model.forward(token_ids, chunks, logits_indices=ends)  # [B, V]
    outputs: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    for step in range(max_tokens):
        chosen = logits.argmax(dim=-1)  # [B]
        values = chosen_logprobs(logits.float(), chosen)  # as the worker's sampler reports them
        for i, (token, value) in enumerate(zip(chosen.tolist(), values.tolist())):
            outputs[i].append(token)
            logprobs[i].append(value)
        if step + 1 == max_tokens:
            break
        if step == 0 and before_decode is not None:
            before_decode()
        chunks = [SequenceChunk(state, 1) for state in states]
        logits = model.forward(chosen, chunks)  # [B, V]
    return outputs, logprobs


def compare(split_outputs: dict[str, list[int]], split_logprobs: dict[str, list[float]],
            ref_outputs: list[list[int]], ref_logprobs: list[list[float]], prefix: str) -> dict:
    """{"tokens_equal", "max_abs_logprob_diff", "num_tokens"} of the split run against the reference."""
    equal, max_diff, count = True, 0.0, 0
    for i, (tokens, values) in enumerate(zip(ref_outputs, ref_logprobs)):
        got = split_outputs[f"{prefix}-{i}"]
        got_lp = split_logprobs[f"{prefix}-{i}"]
        equal &= got == tokens
        count += len(tokens)
        for a, b in zip(got_lp, values):
            max_diff = max(max_diff, abs(a - b))
    return {"tokens_equal": equal, "max_abs_logprob_diff": max_diff, "num_tokens": count}
