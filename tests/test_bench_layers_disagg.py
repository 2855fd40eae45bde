"""`bench layers --disaggregated` at tiny width on the CPU: a real expert worker process, both data planes
(cuda_ipc falls back to ZeroMQ on the CPU), the ping-pong of two micro-batches, outputs compared with the
in-process runner, ratios and goals in the JSON."""

from __future__ import annotations

import json

import pytest
import torch

from moemesh.bench.layers import main

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; on a GPU the CUDA tests below cover it")
def test_disaggregated_bench_runs_both_planes_and_matches_in_process(tmp_path):
    code = main(["--tiny", "--layers", "csa,hca", "--batch", "1,4", "--context", "40", "--prefill", "",
                 "--steps", "1", "--no-transformers", "--disaggregated", "--data-planes", "zmq,cuda_ipc",
                 "--micro-batches", "2", "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("layers-*.json")
    record = json.loads(path.read_text())
    runs = record["ratios"]["disaggregated"]["runs"]
    # b=1 runs one micro-batch only; b=4 runs 1 and 2, per data plane
    assert sorted((r["data_plane"], r["batch_size"], r["micro_batches"]) for r in runs) == [
        ("cuda_ipc", 1, 1), ("cuda_ipc", 4, 1), ("cuda_ipc", 4, 2), ("zmq", 1, 1), ("zmq", 4, 1), ("zmq", 4, 2)]
    for run in runs:
        # the expert worker computes the in-process experts: on the CPU its native FP4 kernel adds in another
        # order than the in-process holder's torch path, so fp32 rounding apart (bit-equal on a GPU, where
        # both run the same Triton kernels)
        assert run["identical"] or run["max_abs_diff"] <= 1e-5, run
        assert run["disaggregated_step_s"] > 0 and run["in_process_eager_step_s"] > 0
        assert run["ratio_to_in_process_graph"] is not None  # the in-process decode of the same run
        assert run["slot_dispatches"] == 0  # no CUDA here: every Dispatch went over ZeroMQ
    two = next(r for r in runs if r["micro_batches"] == 2 and r["data_plane"] == "zmq")
    assert two["overlap"]["overlapped_runs"] > 0  # attention of one micro-batch ran while the other's was away
    goals = record["ratios"]["goals"]
    assert goals["disaggregated_b1_ratio"]["value"] is not None and goals["disaggregated_b64_ratio"]["value"] is None


# ----------------------------------------------------------------------------- CUDA graphs (CUDA only)


@cuda
@pytest.mark.parametrize("per_expert_outputs", [False, True])
def test_expert_graphs_equal_eager_for_every_size_in_and_out_of_the_buckets(per_expert_outputs):
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.kernels.moe_layout import sum_slots_in_order
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config
    from moemesh.services.expert.graphs import ExpertGraphConfig, ExpertGraphs

    config = tiny_flash_like_config([AttentionKind.CSA], kernel_friendly=True)
    _, experts = random_model(config, "cuda", seed=5)
    graphs = ExpertGraphs(experts, ExpertGraphConfig((1, 4, 16)), torch.device("cuda"), torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for num_tokens in (1, 3, 4, 11, 16, 17):
        for with_mask in (False, True):
            hidden = torch.randn(num_tokens, config.hidden_size, device="cuda", generator=generator).bfloat16()
            ids = torch.rand(num_tokens, config.n_routed_experts, device="cuda", generator=generator).argsort(-1)[
                :, :config.num_experts_per_tok]
            weights = torch.rand(num_tokens, config.num_experts_per_tok, device="cuda", generator=generator)
            mask = (torch.rand(ids.shape, device="cuda", generator=generator) > 0.3) if with_mask else None
            eager = experts.per_expert_outputs(0, hidden, ids, weights, mask)
            eager = eager if per_expert_outputs else sum_slots_in_order(eager)
            replayed = graphs.run(0, hidden, ids, weights, mask, per_expert_outputs)
            if num_tokens > 16:
                assert replayed is None  # beyond the largest bucket: eager
                continue
            assert torch.equal(replayed, eager), (num_tokens, with_mask)
    assert graphs.stats.num_replays == 10 and graphs.stats.num_captures == 6  # 3 buckets x (mask, no mask)


@cuda
def test_segment_graphs_over_cuda_ipc_equal_the_eager_in_process_step():
    import tempfile

    import zmq

    from moemesh.bench.layers_disagg import (LocalDispatcher, decode_inputs, start_expert_process, stop_process,
                                     wait_until_serving)
    from moemesh.bench.layers_graphs import SegmentGraphDecode
    from moemesh.bench.layers_timing import decode_states
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import random_model, tiny_flash_like_config
    from moemesh.common.wire.cuda_ipc import CudaIpcConfig, DataPlane
    from moemesh.services.attention.expert_channel import ExpertChannel
    from moemesh.services.attention.model_runner import ModelRunner
    from moemesh.services.attention.moe_dispatch import MoEDispatcher

    device = torch.device("cuda", torch.cuda.current_device())
    config = tiny_flash_like_config([AttentionKind.CSA, AttentionKind.HCA], kernel_friendly=True)
    side, experts = random_model(config, device, seed=0)
    states = decode_states(config, 4, 40, torch.bfloat16, device, seed=0)
    token_ids = torch.randint(0, config.vocab_size, (4,), device=device)
    with torch.inference_mode():
        reference = ModelRunner(side, LocalDispatcher(experts)).forward(0, decode_inputs(states, token_ids, 2))
        reference = [h.clone() for h in reference]
        for state in states:
            state.rollback(1)
    owner = [[0] * config.n_routed_experts for _ in range(config.num_hidden_layers)]
    context = zmq.Context()
    with tempfile.TemporaryDirectory(prefix="moemesh-graphs-") as run_dir:
        endpoint = f"ipc://{run_dir}/expert.sock"
        process = start_expert_process(endpoint, "csa,hca", True, str(device), 0, kernel_friendly=True,
                                       graph_buckets=(1, 2, 4))
        try:
            wait_until_serving(endpoint, context, process, timeout_s=300)
            channel = ExpertChannel([endpoint], context=context, timeout_s=60)
            dispatcher = MoEDispatcher(channel, owner, placement_invariant=False, device=device,
                                       data_plane=DataPlane.CUDA_IPC, cuda_ipc=CudaIpcConfig(max_tokens=8))
            graphs = SegmentGraphDecode(side, states, token_ids, 2, 1, experts)
            with torch.inference_mode():
                for _ in range(3):  # every replay of the one captured step equals the eager step
                    outputs = graphs.step(0, dispatcher)
                    torch.cuda.synchronize()
                    for got, want in zip(outputs, reference):
                        assert torch.equal(got, want)
            assert dispatcher.slot_plane.num_slot_dispatches == 3 * 2 * 2
            channel.close()
        finally:
            stop_process(process)
    context.term()
