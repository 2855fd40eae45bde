"""Long context against the oracle: a tiny checkpoint (FP8 linears, FP4 experts) read from disk and served by the
attention worker on the CPU (fp32, paged KV blocks, the router's scheduler with its 1,024-token long-prefill
chunks), against transformers 5.23.0 running the same checkpoint dequantised, with its own cache, fed in
1,024-token chunks (its full-sequence forward builds [T, T] masks: 35 s and 5 GB at 8K, out of reach at 32K).

At 8K, 16K and 32K prompt tokens the tiny model's window (8), CSA ratio (4) and HCA ratio (8) wrap thousands
of times, the HCA layer attends over up to 4,096 compressed rows and the CSA indexer picks 2 of up to 8,192.
The greedy continuation equals transformers' token for token, and the logits that chose its first token agree
within fp32 rounding. 16K and 32K take minutes on two cores: they carry the `long_context` marker, which
`make test` leaves out and `make test-long` runs; 8K runs in `make test`.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from moemesh.common.checkpoint.writer import write_checkpoint
from moemesh.common.placement.worker_holdings import all_pairs
from moemesh.common.sampling_params import SamplingParams
from moemesh.services.attention.kv_config import KVPoolConfig
from attention_worker_support import attention_worker, run_offline
from tiny_checkpoint_support import random_hub_state_dict, tiny_config

LENGTHS = (8192, pytest.param(16384, marks=pytest.mark.long_context),
           pytest.param(32768, marks=pytest.mark.long_context))
MAX_PROMPT = 32768
NEW_TOKENS = 8
CHUNK = 1024  # the scheduler's long-prefill cap; the oracle's chunks
LOGIT_TOLERANCE = 1e-4  # fp32, max abs difference (measured 1.6e-6 to 2.0e-6; the logits are O(1): checked below)

pytestmark = pytest.mark.slow


class _NoExpertWorkers:
    expert_names = ()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_config(max_position_embeddings=2 * MAX_PROMPT)
    path = tmp_path_factory.mktemp("long") / "tiny"
    write_checkpoint(path, config, random_hub_state_dict(config, seed=7, include_mtp=False))
    return path, config


@pytest.fixture(scope="module")
def oracle(checkpoint):
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    path, _ = checkpoint
    return DeepseekV4ForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                 attn_implementation="eager").float().eval()


@pytest.fixture(scope="module")
def worker(checkpoint):
    path, config = checkpoint
    blocks = (MAX_PROMPT + NEW_TOKENS) // 128 + 4
    worker = attention_worker(path, _NoExpertWorkers(), None, list(all_pairs(config.num_hidden_layers,
                                                                             config.n_routed_experts)),
                              "attention-long", device="cpu", kv=KVPoolConfig(block_size_tokens=128,
                                                                               num_primary_blocks=blocks))
    yield worker
    asyncio.run(worker.close())


def _prompt(config, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(length)
    return torch.randint(1, config.vocab_size, (length,), generator=generator).tolist()


@torch.no_grad()
def _oracle_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers with its cache: the prompt in CHUNK-token pieces, then greedy tokens one at a time ->
    (tokens, logits [V] at the last prompt token)."""
    ids = torch.tensor(prompt)[None]
    past, output = None, None
    for start in range(0, ids.shape[1], CHUNK):
        output = model(ids[:, start:start + CHUNK], past_key_values=past, use_cache=True)
        past = output.past_key_values
    first_logits = output.logits[0, -1]
    tokens, logits = [], first_logits
    for _ in range(num_tokens):
        tokens.append(int(logits.argmax()))
        output = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past, logits = output.past_key_values, output.logits[0, -1]
    return tokens, first_logits


@pytest.mark.parametrize("length", LENGTHS)
def test_served_greedy_continuation_equals_transformers_at_length(checkpoint, oracle, worker, length):
    _, config = checkpoint
    prompt = _prompt(config, length)
    want_tokens, want_logits = _oracle_greedy(oracle, prompt, NEW_TOKENS)
    (got_tokens,), step_logits = run_offline(worker, [prompt], SamplingParams(max_tokens=NEW_TOKENS))
    assert got_tokens == want_tokens
    sampled = [logits for logits in step_logits if logits is not None]
    assert len(step_logits) - len(sampled) >= length // CHUNK - 1  # the prompt went in CHUNK-token pieces
    got_logits = sampled[0][0]  # [V]: the step that finished the prompt
    assert want_logits.abs().max() > 0.1  # the comparison can fail: logits far from zero
    difference = float((got_logits - want_logits).abs().max())
    print(f"{length} tokens: max abs logit difference {difference:.2e}")
    assert difference < LOGIT_TOLERANCE
