"""The in-process run `bench.fullsize --tiny` compares its split run against.

Same random model directory, same gate bias, every expert in one `QuantizedRoutedExperts` (torch
path: whole-matrix dequantisation, as the single-process reference computes), driven through
`ReferenceModel.forward` with the batches `LocalPlanner` gives the attention worker when every prompt
fits one step (all prompts in one forward, then one token per sequence per step), so the linears see
the same batch sizes and each expert the same rows as in the split run.
Legend: B sequences, V vocab.
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
    return ReferenceModel(side, experts), config


@torch.inference_mode()
def reference_generate(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs per prompt, batched as described in the module docstring."""
    from common.model.batch import SequenceChunk

    states = [model.new_sequence() for _ in prompts]
    token_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    chunks = [SequenceChunk(state, len(p)) for state, p in zip(states, prompts)]
    ends = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
    logits = model.forward(token_ids, chunks, logits_indices=ends)  # [B, V]
    outputs: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    for step in range(max_tokens):
        chosen = logits.argmax(dim=-1)  # [B]
        values = torch.log_softmax(logits.float(), dim=-1).gather(1, chosen[:, None])[:, 0]
        for i, (token, value) in enumerate(zip(chosen.tolist(), values.tolist())):
            outputs[i].append(token)
            logprobs[i].append(value)
        if step + 1 == max_tokens:
            break
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
