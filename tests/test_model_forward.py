"""Our DeepSeek-V4 forward against transformers 5.23.0 (fp32 CPU), full, chunked and batched.

Oracle: `DeepseekV4ForCausalLM` built from a seed with every inert-by-default path randomised
(bench.checks.tiny_model). Sequences are >= 5x the largest window/ratio (window 8, HCA ratio 8) and the
CSA layers have more closed rows than index_topk, so top-k selection really happens.
"""

from __future__ import annotations

import random

import pytest
import torch

from moemesh.common.model.attention_side import AttentionSide
from moemesh.common.model.batch import SequenceChunk
from moemesh.common.model.moe import RoutedExperts
from moemesh.common.model.reference import ReferenceModel
from moemesh.common.model.rope import RotaryTable, inverse_frequencies
from moemesh.common.model.config import YarnConfig
from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config

TOLERANCE = 1e-4  # fp32 max abs logit difference; observed ~3e-7
SEQ_LEN = 56

CONFIGS = {
    # docs/model.md §7.1: window+hash, CSA (top-2 of up to 14 rows), HCA ratio 8, 4 streams, YaRN
    "spec_tiny": dict(),
    # other shapes: 2 hash layers, 2 streams, 3 experts per token, no YaRN, CSA first
    "variant": dict(
        layer_types=["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=2, num_experts_per_tok=3,
        rope_scaling=None, index_topk=3, o_groups=4, sliding_window=6,
    ),
}


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny tensors: one intra-op thread is fastest, and avoids spin-waiting on a busy 2-core CI."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def setup(request):
    config = tiny_config(**CONFIGS[request.param])
    hub_sd, hf_model = random_hub_state_dict(config, seed=1234)
    attention_sd, experts = split_hub_state_dict(hub_sd, config)
    side = AttentionSide.from_state_dict(config, attention_sd)
    model = ReferenceModel(side, RoutedExperts.from_config(experts, config))
    generator = torch.Generator().manual_seed(99)
    sequences = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in (SEQ_LEN, 47, 61)]
    with torch.no_grad():
        oracle = [hf_model(s[None], use_cache=False).logits[0] for s in sequences]
    return config, hf_model, model, sequences, oracle


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_full_forward_matches_transformers(setup):
    _, _, model, sequences, oracle = setup
    for tokens, expected in zip(sequences, oracle):
        assert max_diff(model.forward_sequence(tokens), expected) < TOLERANCE
    # the comparison can fail: logits are far from zero and differ across positions
    assert oracle[0].abs().max() > 0.1


def test_chunked_prefill_then_decode_matches(setup):
    _, _, model, sequences, oracle = setup
    rng = random.Random(7)
    tokens, expected = sequences[0], oracle[0]
    for _ in range(2):
        state = model.new_sequence()
        outputs, pos = [], 0
        prefill_end = rng.randint(20, 40)
        while pos < prefill_end:  # random chunk sizes, boundaries inside compression windows
            n = min(rng.randint(1, 11), prefill_end - pos)
            outputs.append(model.forward(tokens[pos:pos + n], [SequenceChunk(state, n)]))
            pos += n
        while pos < len(tokens):  # token-by-token decode
            outputs.append(model.forward(tokens[pos:pos + 1], [SequenceChunk(state, 1)]))
            pos += 1
        assert state.num_tokens == len(tokens)
        assert max_diff(torch.cat(outputs), expected) < TOLERANCE


def test_batch_of_different_lengths_and_chunks_in_one_forward(setup):
    _, _, model, sequences, oracle = setup
    states = [model.new_sequence() for _ in sequences]
    chunk_plans = [[9, 1, 13, 1, 1, 2], [4, 4, 4, 1], [17, 3, 1]]  # cycled per sequence
    positions = [0] * len(sequences)
    outputs: list[list[torch.Tensor]] = [[] for _ in sequences]
    step = 0
    while any(p < len(s) for p, s in zip(positions, sequences)):
        chunks, token_parts, order = [], [], []
        for i, (tokens, state) in enumerate(zip(sequences, states)):
            if positions[i] >= len(tokens):
                continue
            n = min(chunk_plans[i][step % len(chunk_plans[i])], len(tokens) - positions[i])
            chunks.append(SequenceChunk(state, n))
            token_parts.append(tokens[positions[i]: positions[i] + n])
            order.append((i, n))
        logits = model.forward(torch.cat(token_parts), chunks)
        offset = 0
        for i, n in order:
            outputs[i].append(logits[offset: offset + n])
            offset += n
            positions[i] += n
        step += 1
    for parts, expected in zip(outputs, oracle):
        assert max_diff(torch.cat(parts), expected) < TOLERANCE


def test_logits_of_last_tokens_only(setup):
    _, _, model, sequences, oracle = setup
    states = [model.new_sequence() for _ in sequences[:2]]
    chunks = [SequenceChunk(state, len(tokens)) for state, tokens in zip(states, sequences[:2])]
    last = torch.tensor([len(sequences[0]) - 1, len(sequences[0]) + len(sequences[1]) - 1])
    logits = model.forward(torch.cat(sequences[:2]), chunks, logits_indices=last)
    assert logits.shape == (2, oracle[0].shape[-1])
    assert max_diff(logits[0], oracle[0][-1]) < TOLERANCE and max_diff(logits[1], oracle[1][-1]) < TOLERANCE


def test_rope_tables_equal_transformers(setup):
    config, hf_model, _, _, _ = setup
    rotary = hf_model.model.rotary_emb
    assert torch.equal(RotaryTable.for_config(config, compressed=False).inv_freq, rotary.main_inv_freq)
    assert torch.equal(RotaryTable.for_config(config, compressed=True).inv_freq, rotary.compress_inv_freq)


def test_yarn_table_at_flash_scale():
    """docs/model.md §2.4: θ=160000, factor 16, original 65536 -> pairs < 15 unchanged, > 25 slowed 16x."""
    yarn = YarnConfig(16.0, 65536, 32.0, 1.0)
    base = inverse_frequencies(64, 160000.0, None)
    scaled = inverse_frequencies(64, 160000.0, yarn)
    assert torch.equal(scaled[:15], base[:15])
    assert torch.allclose(scaled[26:], base[26:] / 16)
    assert scaled[0] == 1.0 and abs(scaled[31].item() - 5.68e-7) < 1e-8
