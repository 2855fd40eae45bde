"""Offline figures of the default model (single process, CPU): expert-load skew from routing
counts, and the DSpark drafter's accepted length per verify step.

Both run the shipped checkpoint through the model core's reference pieces (`AttentionSide` step
methods, `RoutedExperts`), with the MoE call as the seam where gate ids are counted, exactly as
the attention worker does.

Speculation is simulated as the serving loop would run it (the serving loop does not verify drafts
yet): committed tokens c, the seed is the last committed token at position p; the drafter proposes
G = block_size tokens from the fused features of the last `sliding_window` positions before p; the
target runs [seed, d_0 .. d_{G-1}] in one forward (G + 1 logit slots); `verify` (the server's
verifier: greedy exact match at temperature 0, lossless rejection sampling otherwise) accepts a
prefix and emits one more token; the decode state is rolled back over the rejected drafts. The
figure is the mean number of accepted drafts per verify step (0..G; the emitted count is one more).
Legend: T tokens, N HC streams, D hidden, F = 3·D fused features, G draft slots, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.common.model.batch import ForwardBatch, SequenceChunk
from moemesh.common.model.dspark import DSparkDrafter, target_features
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.state import SequenceState
from moemesh.common.placement.stats import Phase, RoutingStats
from moemesh.common.sampling_params import SamplingParams


@torch.inference_mode()
def forward_with_features(model: ReferenceModel, token_ids: torch.Tensor, state: SequenceState,
                          stats: RoutingStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """token_ids [T] of one sequence -> (logits [T, V], fused drafter features [T, F]); counts every
    gate's expert ids into `stats` (phase UNSPLIT) when given. Same layer loop as
    `ReferenceModel.forward`, keeping the hidden states of `dspark_target_layer_ids`."""
    side, config = model.side, model.config
    feature_layers = config.dspark.target_layer_ids
    batch = ForwardBatch([SequenceChunk(state, token_ids.shape[0])], token_ids.device)
    h = side.embed_tokens(token_ids, batch)  # [T, N, D]
    kept = {}
    for layer in range(config.num_hidden_layers):
        h = side.attn_block(layer, h, batch)
        x, post, comb = side.ffn_pre(layer, h)
        ids, weights = side.gate(layer, x, token_ids)  # [T, K]
        if stats is not None:
            stats.observe(Phase.UNSPLIT, layer, ids.reshape(-1).tolist())
        routed = model.experts_fn(layer, x, ids, weights)
        h = side.ffn_post(layer, routed + side.shared_expert(layer, x), h, post, comb)
        if layer in feature_layers:
            kept[layer] = h
    batch.finish()
    return side.logits(h), target_features([kept[layer] for layer in feature_layers])


def routing_stats(model: ReferenceModel, windows: list[torch.Tensor]) -> RoutingStats:
    """Gate counts over `windows` (each a [S] token tensor, its own fresh sequence)."""
    config = model.config
    stats = RoutingStats(config.num_hidden_layers, config.n_routed_experts, config.num_experts_per_tok)
    for ids in windows:
        forward_with_features(model, ids, model.new_sequence(), stats)
    return stats


@dataclass(frozen=True)
class AcceptanceFigure:
    temperature: float
    num_verify_steps: int
    mean_accepted: float  # accepted drafts per verify step, 0..G
    accepted_per_slot: tuple[float, ...]  # fraction of steps whose drafts 0..k were all accepted
    num_generated_tokens: int
    outputs: tuple[tuple[int, ...], ...]  # generated ids per prompt (greedy: equal to plain greedy decoding)


@torch.inference_mode()
def speculative_acceptance(model: ReferenceModel, drafter: DSparkDrafter, prompts: list[list[int]],
                           temperature: float, max_new_tokens: int, eos_id: int, seed: int) -> AcceptanceFigure:
    """Run speculative generation of every prompt (see the module docstring) and average."""
    from moemesh.services.attention.sampling.verify import verify

    block_size = drafter.dspark.block_size
    window = model.config.sliding_window
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed)
    accepted_counts: list[int] = []
    slot_hits = [0] * block_size
    outputs: list[tuple[int, ...]] = []
    for request_index, prompt in enumerate(prompts):
        request_seed = seed + request_index
        state = model.new_sequence(max_rollback_tokens=block_size + 1)
        # Prefill all but the last prompt token; it is the first seed.
        _, features = forward_with_features(model, torch.tensor(prompt[:-1]), state)  # [P-1, F]
        committed = list(prompt)
        output: list[int] = []
        while len(output) < max_new_tokens and (not output or output[-1] != eos_id):
            seed_position = len(committed) - 1
            context = features[-window:]
            positions = torch.arange(seed_position - context.shape[0], seed_position)
            base, hidden = drafter.propose(context, positions, committed[-1], seed_position)
            if params.is_greedy:
                chain = drafter.greedy_chain(base, hidden, committed[-1])
            else:
                chain = drafter.sampled_chain(base, hidden, committed[-1], temperature=temperature,
                                              seed=request_seed,
                                              output_positions=[len(output) + k for k in range(block_size)])
            step_ids = torch.cat([torch.tensor([committed[-1]]), chain.token_ids.cpu()])  # [G + 1]
            logits, step_features = forward_with_features(model, step_ids, state)  # [G + 1, V]
            result = verify(logits[None], chain.token_ids[None].cpu(), None if params.is_greedy else chain.probs[None],
                            [params], [request_seed], [len(output)], [prompt], [output])
            accepted = result.num_accepted[0]
            state.rollback(block_size - accepted)
            features = torch.cat([features, step_features[: accepted + 1]])
            emitted = result.emitted_token_ids[0]
            committed += emitted
            output += emitted
            accepted_counts.append(accepted)
            for k in range(accepted):
                slot_hits[k] += 1
        outputs.append(tuple(output[:max_new_tokens]))
    num_steps = max(1, len(accepted_counts))
    return AcceptanceFigure(temperature, len(accepted_counts), sum(accepted_counts) / num_steps,
                            tuple(hits / num_steps for hits in slot_hits), sum(len(o) for o in outputs),
                            tuple(outputs))
