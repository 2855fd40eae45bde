"""Programmatic dependent launches (common/kernels/dependent_launch.py) change when a kernel is scheduled,
never what it computes: the embedded default model's decode, captured in CUDA graphs, gives the same
tokens and bit-identical logits with dependent launches on and off. Skipped without an sm_90 GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs an sm_90 GPU")

MODEL = Path(__file__).resolve().parents[1] / "models" / "kjv-dsv4-mini"
PROMPTS = [[5, 9, 17], [100, 101, 7, 3, 3, 40, 2, 77, 9, 10, 11, 12, 13], list(range(30, 52))]


def _graphed_run(name: str, open_workers):
    from attention_worker_support import run_offline
    from moemesh.common.checkpoint.reader import CheckpointReader
    from moemesh.common.placement.worker_holdings import WorkerHoldings, all_pairs
    from moemesh.common.sampling_params import SamplingParams
    from moemesh.services.attention.worker import AttentionWorker, AttentionWorkerConfig

    config = CheckpointReader(MODEL).config
    pairs = tuple(all_pairs(config.num_hidden_layers, config.n_routed_experts))
    worker = AttentionWorker(AttentionWorkerConfig(
        name=name, checkpoint_path=str(MODEL), expert_endpoints=(), expert_workers=(), device="cuda",
        cuda_graphs=True, local_holdings=WorkerHoldings(name, pairs)))
    open_workers.append(worker)
    worker.load_now()
    return run_offline(worker, PROMPTS, SamplingParams(max_tokens=10), lambda num_steps: None)


def test_dependent_launch_leaves_every_bit_unchanged(open_workers, monkeypatch):
    from moemesh.common.kernels.dependent_launch import ENV_SWITCH, dependent_launch_enabled

    monkeypatch.setenv(ENV_SWITCH, "0")
    assert not dependent_launch_enabled(torch.device("cuda"))
    want_tokens, want_logits = _graphed_run("plain-launches", open_workers)
    for mode in ("1", "wait-only"):
        monkeypatch.setenv(ENV_SWITCH, mode)
        assert dependent_launch_enabled(torch.device("cuda"))
        got_tokens, got_logits = _graphed_run(f"dependent-launches-{mode}", open_workers)
        assert got_tokens == want_tokens, mode
        assert len(got_logits) == len(want_logits)
        for got, want in zip(got_logits, want_logits):
            assert (got is None) == (want is None)
            if want is not None:
                assert torch.equal(got, want), mode
