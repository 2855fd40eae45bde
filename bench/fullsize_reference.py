"""The in-process run `bench.fullsize --tiny` compares its split run against.

The same checkpoint loaded by the single-process path of `moemesh generate` (every expert in one
process, float32 on the CPU), with the same gate biases at the same steps, driven through
`ReferenceModel.forward` with the batches the router's scheduler gives the attention worker when every prompt
fits one step (all prompts in one forward, then one token per sequence per step). The split run must
give the same greedy tokens, and its chosen-token logprobs must agree within `LOGPROB_TOLERANCE`: the
workers compute the same float32 arithmetic in other groupings (each expert worker sums its own slots,
the quantized holders dequantise block by block), which moves logprobs by ~1e-6, while a transport bug
(a wrong row, a stale buffer, a slot sent to the wrong worker) moves them by far more.
Legend: B sequences, V vocab.
"""

from __future__ import annotations

import torch

LOGPROB_TOLERANCE = 1e-4


def build_reference(model_dir: str):
    """(ReferenceModel, config) of the checkpoint at `model_dir`, float32 on the CPU."""
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.checkpoint.reference_model import load_reference_model
    from moemesh.common.model.config import NumericsConfig

    reader = CheckpointReader(model_dir)
    return load_reference_model(reader, NumericsConfig(dtype="float32"), "cpu"), reader.config


@torch.inference_mode()
def reference_generate(model, prompts: list[list[int]], max_tokens: int, before_decode=None
                       ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and their logprobs per prompt, batched as described in the module docstring;
    before_decode() runs once between the prompt forward and the first decode forward."""
    from moemesh.common.model.batch import SequenceChunk
    from moemesh.services.attention.sampling.logprobs import chosen_logprobs

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
