"""Where bf16 runs of the quantized model drift: layer by layer and op by op, against an fp32 reference.

`python -m moemesh.bench.kernels_drift [--device cuda] [--out-dir DIR]` (CPU: `TRITON_INTERPRET=1`, small sizes).

Three runs of the same random model (`random_model`, `tiny_flash_like_config` with kernel-friendly
widths, the shape of `tests/test_quantized_cuda.py::test_model_kernels_match_torch_path`):
- `fp32`: the bf16 model's own weights upcast to fp32 (FP8/FP4 bytes are shared), torch backend:
  the reference; it differs from the bf16 runs only by activation rounding.
- `torch_bf16`: bf16 activations, FP8 linears and FP4 experts by dequantise + torch matmul.
- `kernel_bf16`: bf16 activations, the Triton kernels.
Each run records the residual streams after every attention and FFN sub-layer and the logits, for a
prefill and the decode steps after it. The report gives, per point, the relative error of each bf16
run against fp32 and of the two bf16 runs against each other, plus op-level errors of the FP8 linear
and the routed experts on random inputs at the model's shapes. Reading: if kernel-vs-fp32 is no
larger than torch-vs-fp32, the kernels are not the drift; kernel-vs-torch is then about the sum of
the two independent rounding walks, which grows with depth.
Legend: T tokens, N hc streams, D hidden, V vocab, K top-k.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
import json
import sys

import torch



@dataclass(frozen=True)
class DriftCase:
    """One model comparison. hash_routing: every layer routes by token id (`tid2eid`), so no top-k
    selection can flip between runs and the comparison sees only rounding; learned routing is the
    shape of the CUDA model test, where one flipped token out of 72 moves a layer's output by ~5 %."""

    seed: int = 3
    num_prefill: int = 72
    num_decode: int = 8
    hash_routing: bool = False


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def drift_model_config(hash_routing: bool = False, index_topk: int = 64):
    """The 3-layer (window, CSA, HCA) model of the CUDA model test; index_topk above the row count,
    so the CSA indexer never selects."""
    from moemesh.common.model.config import AttentionKind
    from moemesh.common.model.random_init import tiny_flash_like_config

    kinds = [AttentionKind.WINDOW, AttentionKind.CSA, AttentionKind.HCA]
    return tiny_flash_like_config(kinds, kernel_friendly=True, index_topk=index_topk,
                                  num_hash_layers=len(kinds) if hash_routing else 0)


def build_pair(config, device: str, seed: int = 3):
    """(bf16 side, fp32 side with the bf16 side's values, routed experts)."""
    from moemesh.common.model.config import NumericsConfig
    from moemesh.common.model.random_init import random_model

    side16, experts = random_model(config, device, numerics=NumericsConfig(dtype="bfloat16"), seed=seed)
    side32, _ = random_model(config, device, numerics=NumericsConfig(dtype="float32"), seed=seed)
    with torch.no_grad():
        own16 = dict(side16.named_parameters())
        for name, param in side32.named_parameters():
            param.copy_(own16[name].to(param.dtype))  # fp32 copy of exactly the bf16 values
        for (name, b32), (_, b16) in zip(side32.named_buffers(), side16.named_buffers(), strict=True):
            b32.copy_(b16)
    return side16, side32, experts


def set_backend(side, experts, backend) -> None:
    from moemesh.common.model.quantized import Fp8Linear

    for module in side.modules():
        if isinstance(module, Fp8Linear):
            module.backend = backend
    experts.backend = backend


@torch.inference_mode()
def traced_forward(side, experts, token_ids: torch.Tensor, chunks
                   ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """`ReferenceModel.forward` with the streams kept after every sub-layer
    -> (points, logits [T, V], routed expert ids [T, K] per layer)."""
    from moemesh.common.model.batch import ForwardBatch

    batch = ForwardBatch(list(chunks), token_ids.device)
    points, picks = [], []
    h = side.embed_tokens(token_ids, batch)  # [T, N, D]
    for layer in range(side.config.num_hidden_layers):
        h = side.attn_block(layer, h, batch)
        points.append(h.float().clone())
        x, post, comb = side.ffn_pre(layer, h)
        ids, weights = side.gate(layer, x, token_ids)
        picks.append(ids.clone())
        routed = experts(layer, x, ids, weights)
        h = side.ffn_post(layer, routed + side.shared_expert(layer, x), h, post, comb)
        points.append(h.float().clone())
    batch.finish()
    return points, side.logits(h).float(), picks


def run_trace(side, experts, token_ids: torch.Tensor, num_prefill: int) -> dict[str, list[torch.Tensor]]:
    """Prefill of num_prefill tokens, then one single-token step per remaining token: per point,
    prefill and decode streams concatenated over tokens."""
    from moemesh.common.model.batch import SequenceChunk
    from moemesh.common.model.reference import ReferenceModel

    state = ReferenceModel(side, experts).new_sequence()
    pre_points, pre_logits, pre_picks = traced_forward(side, experts, token_ids[:num_prefill], [SequenceChunk(state, num_prefill)])
    dec = [traced_forward(side, experts, token_ids[t:t + 1], [SequenceChunk(state, 1)])
           for t in range(num_prefill, token_ids.shape[0])]
    dec_points = [torch.cat([d[0][i] for d in dec]) for i in range(len(pre_points))]
    dec_picks = [torch.cat([d[2][i] for d in dec]) for i in range(len(pre_picks))]
    return {"prefill": pre_points + [pre_logits], "decode": dec_points + [torch.cat([d[1] for d in dec])],
            "prefill_picks": pre_picks, "decode_picks": dec_picks}


def num_flipped_tokens(picks: list[torch.Tensor], ref_picks: list[torch.Tensor]) -> list[int]:
    """Per layer: tokens whose routed expert set differs from the reference's."""
    return [int((p != r).any(dim=-1).sum()) for p, r in zip(picks, ref_picks, strict=True)]


def point_names(num_layers: int) -> list[str]:
    names = []
    for layer in range(num_layers):
        names += [f"layer{layer}.attn", f"layer{layer}.ffn"]
    return names + ["logits"]


def model_drift(device: str, case: DriftCase = DriftCase()) -> dict:
    """Per point and phase: rel errors torch_bf16/kernel_bf16 vs fp32 and kernel vs torch, plus the
    tokens each bf16 run routed differently from fp32, per layer."""
    from moemesh.common.model.quantized import KernelBackend

    config = drift_model_config(case.hash_routing)
    side16, side32, experts = build_pair(config, device, case.seed)
    tokens = torch.randint(0, config.vocab_size, (case.num_prefill + case.num_decode,),
                           generator=torch.Generator().manual_seed(case.seed)).to(device)
    set_backend(side32, experts, KernelBackend.TORCH)
    ref = run_trace(side32, experts, tokens, case.num_prefill)
    set_backend(side16, experts, KernelBackend.TORCH)
    torch_run = run_trace(side16, experts, tokens, case.num_prefill)
    set_backend(side16, experts, KernelBackend.KERNEL)
    kernel_run = run_trace(side16, experts, tokens, case.num_prefill)
    rows = []
    for phase in ("prefill", "decode"):
        for name, r, t, k in zip(point_names(config.num_hidden_layers), ref[phase], torch_run[phase],
                                 kernel_run[phase], strict=True):
            rows.append({"phase": phase, "point": name, "torch_vs_fp32": rel_err(t, r),
                         "kernel_vs_fp32": rel_err(k, r), "kernel_vs_torch": rel_err(k, t)})
    flips = {f"{run}_{phase}": num_flipped_tokens(out[f"{phase}_picks"], ref[f"{phase}_picks"])
             for run, out in (("torch", torch_run), ("kernel", kernel_run)) for phase in ("prefill", "decode")}
    return {"case": asdict(case), "rows": rows, "routing_flips_vs_fp32": flips}


def op_drift(device: str, seed: int = 0) -> list[dict]:
    """FP8 linear and routed experts on random bf16 inputs: each bf16 path against the fp32 torch path."""
    from moemesh.common.model.quantized import Fp8Linear, KernelBackend
    from moemesh.common.model.quantized_experts import QuantizedRoutedExperts
    from moemesh.common.model.random_init import random_fp4_stack, random_fp8_linear

    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for num_tokens in (1, 72):
        weight, scale = random_fp8_linear(512, 256, generator=gen, device=device)
        x = torch.randn(num_tokens, 256, generator=gen, device=device).to(torch.bfloat16)
        ref = Fp8Linear(weight, scale, backend=KernelBackend.TORCH)(x.float())
        t = Fp8Linear(weight, scale, backend=KernelBackend.TORCH)(x)
        k = Fp8Linear(weight, scale, backend=KernelBackend.KERNEL)(x)
        out.append({"op": f"fp8_linear T{num_tokens} 512x256", "torch_vs_fp32": rel_err(t, ref),
                    "kernel_vs_fp32": rel_err(k, ref), "kernel_vs_torch": rel_err(k, t)})
        num_experts, hidden, inter, top_k = 16, 256, 128, 2
        stacks = [random_fp4_stack(num_experts, n, kk, generator=gen, device=device)
                  for n, kk in ((inter, hidden), (hidden, inter), (inter, hidden))]
        tensors = (stacks[0][0], stacks[0][1], stacks[1][0], stacks[1][1], stacks[2][0], stacks[2][1])
        layers = {0: (list(range(num_experts)), tensors)}
        ids = torch.rand(num_tokens, num_experts, generator=gen, device=device).argsort(-1)[:, :top_k].sort(-1).values
        weights = torch.rand(num_tokens, top_k, generator=gen, device=device) + 0.1
        results = {}
        for label, backend, xx in (("ref", KernelBackend.TORCH, x.float()), ("torch", KernelBackend.TORCH, x),
                                   ("kernel", KernelBackend.KERNEL, x)):
            results[label] = QuantizedRoutedExperts(layers, num_experts, 10.0, backend=backend)(0, xx, ids, weights)
        out.append({"op": f"routed_experts T{num_tokens} D{hidden} I{inter}",
                    "torch_vs_fp32": rel_err(results["torch"], results["ref"]),
                    "kernel_vs_fp32": rel_err(results["kernel"], results["ref"]),
                    "kernel_vs_torch": rel_err(results["kernel"], results["torch"])})
    return out


def store_rounding_agreement(device: str) -> float:
    """Share of an FP8 linear's bf16 outputs equal to its fp32 outputs rounded to nearest even by torch
    (1.0 on the GPU and under the patched interpreter; ~0.5 when the interpreter truncates)."""
    from moemesh.common.kernels.fp8_linear import fp8_linear
    from moemesh.common.model.random_init import random_fp8_linear

    gen = torch.Generator(device=device).manual_seed(1)
    weight, scale = random_fp8_linear(256, 256, generator=gen, device=device)
    x = torch.randn(20, 256, generator=gen, device=device).to(torch.bfloat16)
    wide = fp8_linear(x, weight, scale, out_dtype=torch.float32)
    return (fp8_linear(x, weight, scale) == wide.to(torch.bfloat16)).float().mean().item()


def print_table(model: dict, ops: list[dict]) -> None:
    print(f"{'phase':8} {'point':14} {'torch-fp32':>11} {'kernel-fp32':>12} {'kernel-torch':>13}")
    for row in model["rows"]:
        print(f"{row['phase']:8} {row['point']:14} {row['torch_vs_fp32']:11.4f} {row['kernel_vs_fp32']:12.4f} "
              f"{row['kernel_vs_torch']:13.4f}")
    print("tokens routed differently from fp32, per layer:", model["routing_flips_vs_fp32"])
    for row in ops:
        print(f"op {row['op']:32} {row['torch_vs_fp32']:9.5f} {row['kernel_vs_fp32']:9.5f} {row['kernel_vs_torch']:9.5f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seeds", default="3", help="comma-separated model seeds")
    parser.add_argument("--routing", default="learned,hash", help="comma-separated: learned, hash")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--num-prefill", type=int, default=DriftCase.num_prefill)
    parser.add_argument("--num-decode", type=int, default=DriftCase.num_decode)
    parser.add_argument("--skip-ops", action="store_true", help="only the model comparison")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    parser.add_argument("--truncating-interpreter", action="store_true",
                        help="keep Triton's interpreter casting fp32 -> bf16 by truncation (its default)")
    args = parser.parse_args(argv)
    from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot, patch_interpreter_bf16_rounding

    patch_interpreter_bf16_dot()  # both no-ops unless TRITON_INTERPRET=1
    if not args.truncating_interpreter:
        patch_interpreter_bf16_rounding()
    result = {"device": args.device, "ops": [] if args.skip_ops else op_drift(args.device), "models": {},
              "bf16_store_rounding_agreement": store_rounding_agreement(args.device)}
    print(f"bf16 stores equal to round-to-nearest-even of fp32: {result['bf16_store_rounding_agreement']:.4f}")
    for routing in args.routing.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            model = model_drift(args.device, DriftCase(
                seed=seed, num_prefill=args.num_prefill, num_decode=args.num_decode, hash_routing=routing == "hash"))
            result["models"][f"{routing}-{seed}"] = model
            print(f"--- model seed {seed}, {routing} routing")
            print_table(model, result["ops"])
    if args.json:
        print(json.dumps(result))
    if args.out_dir:
        from moemesh.bench.results_io import write_result

        from pathlib import Path

        path = write_result("kernels-drift", result, command=" ".join(sys.argv), out_dir=Path(args.out_dir))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
