"""The one-launch compressor step (`common/kernels/compressor_step.py`) against the per-row launches it replaces
(pool, norm + RoPE, row writes, ring writes): the same layer outputs and the same bytes in every store, bit for
bit, over decode, speculative verification (several windows closing in one forward), rollbacks, own and paged
row stores, bf16-width and FP8 main rows. Under TRITON_INTERPRET=1 at tiny width (run in a child process), and
compiled at V4-Flash width on a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from interpret_support import INTERPRETING, cuda, interpreted, patch_interpreter, run_interpreted_tests  # noqa: E402,F401
from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV  # noqa: E402
from moemesh.common.model.config import AttentionKind  # noqa: E402
from moemesh.common.model.kv_storage import KVStorage  # noqa: E402
from moemesh.common.model.random_init import flash_config, tiny_flash_like_config  # noqa: E402
from moemesh.common.model.state import SequenceState  # noqa: E402

KINDS = (AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA)


patch_interpreter()


def test_interpreted_cases_in_a_child():
    run_interpreted_tests(__file__)


def _states(config, num_sequences: int, row_store: str, storage: KVStorage, dtype, device) -> list[SequenceState]:
    if row_store == "own":
        return [SequenceState(config, dtype=dtype, device=device, kv_storage=storage) for _ in range(num_sequences)]
    from moemesh.services.attention.kv_config import KVPoolConfig
    from moemesh.services.attention.kv_pool import BlockTable, KVPool

    block_size = max(32, *(config.compress_ratio(layer) or 1 for layer in range(config.num_hidden_layers)))
    num_blocks = 8 * num_sequences + 8
    pool = KVPool(config, KVPoolConfig(block_size_tokens=block_size, num_primary_blocks=num_blocks,
                                       kv_storage=storage), dtype, device)
    states = []
    for index in range(num_sequences):
        table = BlockTable(torch.device(device))
        table.update([num_blocks - 1 - 8 * index - k for k in range(8)])  # scattered, descending blocks
        states.append(SequenceState(config, dtype=dtype, device=device, kv_storage=storage,
                                    row_store_factory=pool.row_store_factory(table)))
    states[0]._pool_keepalive = pool  # noqa: SLF001 - the pool must outlive the states
    return states


def run_both_forms(config, steps, num_sequences: int, row_store: str, storage: KVStorage, dtype, device,
                   random_context: tuple[int, ...] = ()) -> int:
    """`steps` through window, CSA and HCA layers on the kernel path, once with the one-launch compressor step and
    once with the per-row launches; asserts equal outputs and stores after every forward. Returns how many
    forwards took the one-launch step."""
    from moemesh.bench.checks.attention import random_layers
    from moemesh.common.model import attention_kernels
    from moemesh.common.model.batch import AttentionBackend, ForwardBatch, SequenceChunk
    from moemesh.common.model.random_init import fill_random_context

    layers = random_layers(config, dtype, device, seed=1)
    forms = {True: _states(config, num_sequences, row_store, storage, dtype, device),
             False: _states(config, num_sequences, row_store, storage, dtype, device)}
    for states in forms.values():
        generator = torch.Generator(device=device).manual_seed(2)
        for state, num_tokens in zip(states, random_context):
            fill_random_context(state, num_tokens, generator=generator)
    applies = attention_kernels.compressor_step_applies
    num_fused = 0
    generator = torch.Generator().manual_seed(3)
    try:
        with torch.inference_mode():
            for step in steps:
                if step[0] == "rollback":
                    for states in forms.values():
                        states[step[1]].rollback(step[2])
                    continue
                x = torch.randn(sum(n for _, n in step), config.hidden_size, generator=generator).to(device, dtype)
                outputs = {}
                for one_launch, states in forms.items():
                    attention_kernels.compressor_step_applies = applies if one_launch else (lambda *args: False)
                    batch = ForwardBatch([SequenceChunk(states[i], n) for i, n in step], device,
                                         attention_backend=AttentionBackend.TRITON)
                    assert batch.attention_tables is not None
                    if one_launch and applies(batch.attention_tables, x.shape[0], False):
                        num_fused += 1
                    outputs[one_launch] = [layer(x, batch) for layer in layers]
                    batch.finish()
                for got, want in zip(outputs[True], outputs[False]):
                    assert torch.equal(got, want), step
                for got_state, want_state in zip(forms[True], forms[False]):
                    want_live, got_live = want_state.live_tensors(), got_state.live_tensors()
                    for name, tensor in want_live.items():
                        assert torch.equal(got_live[name], tensor), (step, name)
    finally:
        attention_kernels.compressor_step_applies = applies
    return num_fused


# decode and verification forwards closing several CSA windows at once, a window-0 close, a rollback across closes
STEPS = (((0, 3), (1, 5), (2, 1)), ((0, 1), (1, 3), (2, 8)), ("rollback", 2, 5), ((0, 9), (1, 1), (2, 4)),
         ((0, 1), (1, 1), (2, 1)))


@interpreted
@pytest.mark.parametrize("row_store, storage", [("own", KVStorage.BF16), ("paged", KVStorage.FP8)])
def test_interpreted_one_launch_step_equals_the_row_launches(row_store, storage, monkeypatch):
    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")  # the row launches' norm + RoPE in Triton too, as on a GPU
    config = tiny_flash_like_config(KINDS, kernel_friendly=True)
    dtype = torch.bfloat16 if storage is KVStorage.FP8 else torch.float32
    assert run_both_forms(config, STEPS, 3, row_store, storage, dtype, "cpu", random_context=(5, 30)) == 4


@interpreted
def test_interpreted_longer_forwards_keep_the_row_launches(monkeypatch):
    monkeypatch.setenv(INTERPRET_ON_CPU_ENV, "1")
    from moemesh.common.kernels.compressor_step import MAX_STEP_TOKENS

    config = tiny_flash_like_config(KINDS, kernel_friendly=True)
    steps = (((0, MAX_STEP_TOKENS + 1),), ((0, 2),))
    assert run_both_forms(config, steps, 1, "own", KVStorage.BF16, torch.float32, "cpu") == 1


def test_inputs_that_do_not_fit_are_refused():
    from moemesh.common.kernels.compressor_step import CompressorStep, compressor_step

    step = CompressorStep(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 1e-6, 4, True, 8, indexer=False)
    with pytest.raises(ValueError, match="do not fit"):
        compressor_step((step,), _FakeTables(), 0, torch.ones(2))
    indexer_first = CompressorStep(torch.zeros(2, 16), torch.zeros(2, 16), torch.ones(8), 1e-6, 4, True, 8,
                                   indexer=True)
    with pytest.raises(ValueError, match="layer's then the indexer's"):
        compressor_step((indexer_first,), _FakeTables(), 0, torch.ones(2))


class _FakeTables:
    seq_info = torch.zeros(1, 3, dtype=torch.int64)
    main_rows = None
    state_dtype = torch.float32


@cuda
@pytest.mark.parametrize("storage", [KVStorage.BF16, KVStorage.FP8])
def test_cuda_flash_width_one_launch_step_equals_the_row_launches(storage):
    config = flash_config(KINDS)
    steps = (((0, 1), (1, 1), (2, 1)), ((0, 4), (1, 1), (2, 2)), ((0, 1), (1, 7), (2, 1)), ("rollback", 1, 3),
             ((0, 1), (1, 1), (2, 1)))
    assert run_both_forms(config, steps, 3, "paged", storage, torch.bfloat16, "cuda",
                          random_context=(300, 127, 1021)) == 4
