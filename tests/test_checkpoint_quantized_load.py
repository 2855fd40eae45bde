"""Checkpoints load into the kernels' quantized layouts: FP4/FP8 expert stacks, `Fp8Linear`s, bytes as
stored; `--expert-dtype fp8` re-encodes FP4 exactly where e4m3 can hold the values and within the
stated bound elsewhere; damaged checkpoints fail at start naming the tensor."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moemesh.common.checkpoint.errors import CheckpointError
from moemesh.common.checkpoint.expert_stacks import fp4_to_fp8_block
from moemesh.common.checkpoint.quant import dequantize_fp4, dequantize_fp8_block, pack_fp4_codes
from moemesh.common.checkpoint.reader import CheckpointReader
from moemesh.common.checkpoint.writer import write_checkpoint
from tiny_checkpoint_support import random_hub_state_dict, tiny_config
from moemesh.common.model.config import NumericsConfig
from moemesh.common.model.quantized import Fp8Linear
from moemesh.common.wire.messages import Dispatch
from moemesh.services.expert.worker import ExpertWorker, ExpertWorkerConfig

MEMORY_GOAL = 1.05  # resident weight bytes <= 1.05 x stored bytes of what a worker holds


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    config = tiny_config()
    path = tmp_path_factory.mktemp("quantized_ckpt")
    write_checkpoint(path, config, random_hub_state_dict(config, seed=11, include_mtp=False))
    return path


def _expert_worker(path: Path, pairs, expert_dtype: str = "native") -> ExpertWorker:
    worker = ExpertWorker(ExpertWorkerConfig(name=f"expert-{expert_dtype}", checkpoint_path=str(path), pairs=pairs,
                                             expert_dtype=expert_dtype))
    asyncio.run(worker.load())
    return worker


def _dispatch(num_tokens: int, num_experts: int, hidden_size: int, layer: int, seed: int,
              experts: list[int] | None = None) -> Dispatch:
    """Two slots per token, among `experts` (default: all)."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(num_experts)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:2]] for _ in range(num_tokens)])
    return Dispatch(dispatch_id=seed, step_id=seed, layer=layer, micro_batch=0,
                    hidden=torch.randn(num_tokens, hidden_size, generator=generator), expert_ids=ids.to(torch.int32),
                    weights=torch.rand(num_tokens, 2, generator=generator), per_expert_outputs=True)


# ------------------------------------------------------------------ expert workers
def test_expert_worker_keeps_fp4_stacks_at_their_stored_bytes(checkpoint):
    config = tiny_config()
    pairs = tuple((layer, e) for layer in range(config.num_hidden_layers) for e in range(0, 8, 2))
    worker = _expert_worker(checkpoint, pairs)
    held = worker.holdings.experts._layers[1]
    inter, hidden = config.moe_intermediate_size, config.hidden_size
    assert held.w1.dtype == torch.uint8 and tuple(held.w1.shape) == (4, inter, hidden // 2)
    assert tuple(held.s1.shape) == (4, inter, hidden // 32) and tuple(held.w2.shape) == (4, hidden, inter // 2)
    reader = CheckpointReader(checkpoint)
    stored = sum(reader.stored_nbytes(f"layers.{l}.ffn.experts.{e}.{w}.{kind}")
                 for l, e in pairs for w in ("w1", "w2", "w3") for kind in ("weight", "scale"))
    inventory = worker.inventory()
    assert inventory.num_stored_weight_bytes == stored
    assert inventory.num_weight_bytes <= MEMORY_GOAL * stored
    # the stacked bytes are the checkpoint's bytes
    assert torch.equal(held.w3[2], reader.load_quantized("layers.1.ffn.experts.4.w3.weight").weight.view(torch.uint8))


def test_load_and_drop_restack_only_what_changes(checkpoint):
    from moemesh.common.wire.messages import DropExperts, ExpertKey, LoadExperts

    worker = _expert_worker(checkpoint, ((0, 1), (0, 5), (2, 3)))
    untouched = worker.holdings.experts._layers[2].w1
    before = worker.handle_dispatch(_dispatch(6, 8, 128, 0, seed=3, experts=[1, 5]))
    reply = asyncio.run(worker.handle(LoadExperts(2, (ExpertKey(0, 0), ExpertKey(0, 7)))))
    assert [(k.layer, k.expert) for k in reply.experts] == [(0, 0), (0, 1), (0, 5), (0, 7), (2, 3)]
    assert worker.holdings.experts._layers[2].w1 is untouched  # layer 2 was not rebuilt
    assert worker.holdings.experts._layers[0].expert_ids == [0, 1, 5, 7]
    asyncio.run(worker.handle(DropExperts(3, (ExpertKey(0, 0), ExpertKey(0, 7), ExpertKey(2, 3)))))
    assert worker.holdings.pairs == [(0, 1), (0, 5)] and 2 not in worker.holdings.experts._layers
    after = worker.handle_dispatch(_dispatch(6, 8, 128, 0, seed=3, experts=[1, 5]))
    assert torch.equal(before.output, after.output)
    inventory = worker.inventory()
    assert inventory.num_stored_weight_bytes == inventory.num_weight_bytes  # FP4 held exactly as stored


def test_fp8_expert_outputs_equal_native_where_the_conversion_is_exact(checkpoint):
    config = tiny_config()
    pairs = tuple((1, e) for e in range(config.n_routed_experts))
    native = _expert_worker(checkpoint, pairs, "native")
    fp8 = _expert_worker(checkpoint, pairs, "fp8")
    held = fp8.holdings.experts._layers[1]
    assert held.w1.dtype == torch.float8_e4m3fn and held.fmt.value == "fp8"
    reader = CheckpointReader(checkpoint)
    for index, expert in enumerate(held.expert_ids):  # this checkpoint's blocks convert exactly
        for which, w, s in (("w1", held.w1, held.s1), ("w2", held.w2, held.s2), ("w3", held.w3, held.s3)):
            assert torch.equal(dequantize_fp8_block(w[index], s[index]),
                               reader.load(f"layers.1.ffn.experts.{expert}.{which}.weight"))
    dispatch = _dispatch(9, config.n_routed_experts, config.hidden_size, 1, seed=5)
    expected = native.handle_dispatch(dispatch).output
    got = fp8.handle_dispatch(dispatch).output
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # same weights, summation order only
    assert fp8.inventory().num_weight_bytes < 2 * native.inventory().num_weight_bytes  # ~1.06 B vs 0.53 B / param


def _fp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_fp4_codes(codes), (exponents + 127).to(torch.uint8)


def test_fp4_to_fp8_is_exact_within_the_exponent_window_and_bounded_outside():
    generator = torch.Generator().manual_seed(0)
    rows, cols = 256, 256  # 2 x 2 FP8 blocks, 8 FP4 groups per block row
    codes = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
    # block (0, 0): every group within 14 powers of two of the top -> exact
    exponents = torch.randint(-7, 8, (rows, cols // 32), generator=generator)
    packed, scale = _fp4(codes, exponents)
    reference = dequantize_fp4(packed, scale)
    fp8, fp8_scale = fp4_to_fp8_block(packed, scale)
    assert torch.equal(dequantize_fp8_block(fp8, fp8_scale), reference)
    # a spread of 20 powers of two: groups far below the block's top lose bits, within 2^(t-10)
    exponents = exponents.clone()
    exponents[:, 0] = 12
    exponents[:, 1] = -8
    packed, scale = _fp4(codes, exponents)
    reference = dequantize_fp4(packed, scale)
    fp8, fp8_scale = fp4_to_fp8_block(packed, scale)
    error = (dequantize_fp8_block(fp8, fp8_scale) - reference).abs()
    assert error.max() > 0  # the conversion is not exact here
    block_scale = dequantize_fp8_block(torch.ones(rows, cols, dtype=torch.float8_e4m3fn), fp8_scale)  # 2^t per element
    assert torch.all(error <= block_scale * 2.0**-10)


def test_bf16_expert_dtype_holds_dense_bf16(checkpoint):
    worker = _expert_worker(checkpoint, ((3, 2), (3, 6)), "bf16")
    assert worker.holdings.experts is None
    w1, w2, w3 = worker.holdings.dense[(3, 2)]
    assert w1.dtype == torch.bfloat16 and tuple(w2.shape) == (128, 128)
    reply = worker.handle_dispatch(_dispatch(4, 8, 128, 3, seed=1, experts=[2, 6]))
    assert reply.output.shape == (4, 2, 128)


# ------------------------------------------------------------------ attention side
def test_attention_side_keeps_fp8_linears_and_stored_bytes(checkpoint):
    from moemesh.common.checkpoint.module_loader import module_weight_bytes
    from moemesh.common.checkpoint.side_loading import attention_stored_bytes, load_attention_side
    from moemesh.common.model.attention_side import AttentionSide

    reader = CheckpointReader(checkpoint)
    side = load_attention_side(reader, NumericsConfig(dtype="float32"), "cpu")
    wq_b = side.get_submodule("layers.2.attn.wq_b")
    assert isinstance(wq_b, Fp8Linear) and wq_b.weight.dtype == torch.float8_e4m3fn
    assert side.embed.weight.dtype == torch.bfloat16  # stored bf16, widened per call
    assert not any(".ffn.experts." in name for name in reader.read_entry_names)
    resident, stored = module_weight_bytes(side), attention_stored_bytes(reader)
    assert resident <= MEMORY_GOAL * stored, (resident, stored)
    dense = AttentionSide.from_state_dict(reader.config, CheckpointReader(checkpoint).load_attention_side(),
                                          NumericsConfig(dtype="float32"))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(side.layers[2].attn.wq_b(x), dense.layers[2].attn.wq_b(x))
    ids = torch.tensor([3, 1, 4, 1, 5])
    assert torch.equal(side.embed(ids), dense.embed(ids)) and side.embed(ids).dtype == torch.float32
    assert torch.equal(side.head(x), dense.head(x))


# ------------------------------------------------------------------ damaged checkpoints
def _rewrite(path: Path, target: Path, change) -> Path:
    target.mkdir()
    (target / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_truncated_shard_fails_naming_the_tensor(checkpoint, tmp_path):
    damaged = _rewrite(checkpoint, tmp_path / "cut", lambda tensors: None)
    shard = damaged / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"layers\.\d+\.ffn\.experts\.\d+\.w\d\.(weight|scale): truncated"):
        CheckpointReader(damaged)
    with pytest.raises(CheckpointError, match="truncated"):
        _expert_worker(damaged, ((0, 0),))


def test_wrong_dtype_fails_naming_the_tensor(checkpoint, tmp_path):
    def widen(tensors):
        name = "layers.2.attn.wq_b.weight"
        tensors[name] = tensors[name].to(torch.bfloat16)

    damaged = _rewrite(checkpoint, tmp_path / "dtype", widen)
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.wq_b\.weight: expected .*F8_E4M3.*found .*BF16"):
        CheckpointReader(damaged)


def test_missing_scale_fails_naming_the_tensor(checkpoint, tmp_path):
    damaged = _rewrite(checkpoint, tmp_path / "scale", lambda tensors: tensors.pop("layers.0.ffn.experts.3.w2.scale"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.3\.w2\.scale: missing"):
        _expert_worker(damaged, ((0, 3),))


def test_a_damaged_checkpoint_stops_the_expert_process_naming_the_tensor(checkpoint, tmp_path):
    import subprocess
    import sys

    damaged = _rewrite(checkpoint, tmp_path / "proc", lambda tensors: tensors.pop("layers.1.ffn.experts.0.w1.scale"))
    config_path = tmp_path / "deployment.toml"
    config_path.write_text(f'[model]\npath = "{damaged}"\n\n[paths]\nrun_dir = "{tmp_path / "run"}"\n'
                           f'log_dir = "{tmp_path / "logs"}"\n\n[[attention]]\nname = "attention-0"\n\n'
                           '[[expert]]\nname = "expert-0"\n')
    result = subprocess.run([sys.executable, "-m", "moemesh.cli", "expert", "--config", str(config_path)],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode != 0
    assert "layers.1.ffn.experts.0.w1.scale" in result.stderr + result.stdout


# ------------------------------------------------------------------ accounting
@pytest.mark.parametrize("dtype, element_bytes", [("float32", 4), ("bfloat16", 2)])
def test_budgeted_attention_bytes_equal_what_the_loader_holds(checkpoint, dtype, element_bytes):
    from moemesh.common.checkpoint.module_loader import module_weight_bytes
    from moemesh.common.checkpoint.side_loading import load_attention_side
    from moemesh.common.placement.worker_budget import attention_weight_bytes

    reader = CheckpointReader(checkpoint)
    side = load_attention_side(reader, NumericsConfig(dtype=dtype), "cpu")
    assert attention_weight_bytes(reader.config, element_bytes) == module_weight_bytes(side)


@pytest.mark.parametrize("expert_dtype", ["native", "fp8", "bf16"])
def test_budgeted_expert_bytes_equal_what_the_worker_holds(checkpoint, expert_dtype):
    from moemesh.common.placement.worker_budget import resident_bytes_per_expert

    worker = _expert_worker(checkpoint, ((0, 2), (1, 2), (1, 3)), expert_dtype)
    assert worker.inventory().num_weight_bytes == 3 * resident_bytes_per_expert(tiny_config(), expert_dtype)


def test_check_model_prints_formats_and_worker_bytes(checkpoint, tmp_path):
    import subprocess
    import sys

    deployment = tmp_path / "deployment.toml"
    deployment.write_text(f'[model]\npath = "{checkpoint}"\n\n[[attention]]\nname = "attention-0"\n\n'
                          '[[expert]]\nname = "expert-0"\nplacement = "all"\n\n'
                          '[[expert]]\nname = "expert-1"\nplacement = "none"\nexpert_dtype = "fp8"\n')
    result = subprocess.run([sys.executable, "-m", "moemesh.cli", "check-model", "--model", str(checkpoint),
                             "--no-forward", "--json", "--tensors", "--deployment", str(deployment)],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    formats = {row["format"]: row for row in summary["formats"]}
    assert formats["fp4 e2m1 + ue8m0 1x32"]["num_tensors"] == 3 * 4 * 8
    assert formats["fp8 e4m3 + ue8m0 128x128"]["num_tensors"] > 0
    tensors = {row["name"]: row for row in summary["tensors"]}
    assert tensors["layers.0.ffn.experts.0.w2.weight"]["stored_bytes"] == 128 * 64 + 128 * 4
    workers = {row["name"]: row for row in summary["workers"]}
    reader = CheckpointReader(checkpoint)
    assert workers["expert-0"]["num_pairs"] == 32 and workers["expert-1"]["num_pairs"] == 0
    assert workers["expert-0"]["resident_bytes"] == workers["expert-0"]["stored_bytes"]  # FP4 kept as stored
    side_bytes = sum(reader.logical_stored_nbytes(n) for n, s in reader.inventory.items() if s.is_attention_side)
    assert workers["attention-0"]["stored_bytes"] == side_bytes
    assert workers["attention-0"]["resident_bytes"] <= MEMORY_GOAL * side_bytes


def test_fp8_linear_cpu_path_dequantises_row_blocks_and_matches_the_dense_product():
    import torch.nn.functional as F

    from moemesh.common.checkpoint.quant import quantize_fp8_block
    from moemesh.common.model.quantized import TORCH_BLOCK_ROWS

    generator = torch.Generator().manual_seed(3)
    weight, scale = quantize_fp8_block(torch.randn(2 * TORCH_BLOCK_ROWS + 200, 384, generator=generator))
    linear = Fp8Linear(weight, scale)
    x = torch.randn(5, 384, generator=generator)
    torch.testing.assert_close(linear(x), F.linear(x, linear.dequantized()), rtol=1e-6, atol=1e-6)


def test_drafter_keeps_fp8_and_fp4_and_its_own_embedding_within_the_goal(tmp_path):
    from moemesh.common.checkpoint.side_loading import drafter_stored_bytes
    from moemesh.common.model.dspark import DSparkDrafter
    from moemesh.common.model.quantized_experts import QuantizedRoutedExperts
    from moemesh.common.drafting.proposer import load_drafter

    config = tiny_config(num_nextn_predict_layers=2, compress_ratios=[0, 4, 128, 4, 0, 0], dspark_block_size=4,
                         dspark_markov_rank=32, dspark_target_layer_ids=[1, 2, 3], dspark_noise_token_id=255)
    path = write_checkpoint(tmp_path / "dspark", config, random_hub_state_dict(config, seed=8))
    drafter = load_drafter(str(path), "cpu", NumericsConfig(dtype="float32"))
    assert isinstance(drafter, DSparkDrafter) and isinstance(drafter.experts_fn, QuantizedRoutedExperts)
    assert any(isinstance(module, Fp8Linear) for module in drafter.modules())
    assert drafter.embed.weight.dtype == torch.bfloat16  # its own copy, as stored
    from moemesh.common.checkpoint.side_loading import drafter_resident_bytes

    resident, stored = drafter_resident_bytes(drafter), drafter_stored_bytes(CheckpointReader(path))
    assert stored == drafter.stored_weight_bytes
    assert resident <= MEMORY_GOAL * stored, (resident, stored)


def test_expert_dtype_is_read_per_worker_and_checked():
    from moemesh.commands.serve_config import ServeLayout, deployment_table
    from moemesh.common.runtime.deployment import DeploymentError, parse_deployment

    raw = {"model": {"path": "/m"}, "attention": [{"name": "attention-0"}],
           "expert": [{"name": "expert-0"}, {"name": "expert-1", "device": "cpu", "expert_dtype": "fp8"}]}
    deployment = parse_deployment(raw)
    assert [w.expert_dtype for w in deployment.expert] == ["native", "fp8"]
    with pytest.raises(DeploymentError, match=r"expert\[1\]\.expert_dtype: 'fp4'"):
        parse_deployment({**raw, "expert": [{"name": "expert-0"}, {"name": "expert-1", "expert_dtype": "fp4"}]})
    table = deployment_table(ServeLayout(model_path="/m", run_dir="/r", log_dir="/l", num_expert_workers=2,
                                         expert_dtype="fp8"))
    assert [entry["expert_dtype"] for entry in table["expert"]] == ["fp8", "fp8"]
