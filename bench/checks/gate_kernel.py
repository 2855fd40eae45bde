"""The one-launch MoE gate (common/kernels/gate.py) against `Gate`'s torch path on the same inputs.

`python -m moemesh.bench.checks.gate_kernel --suite interpret` runs the small cases (meant for
TRITON_INTERPRET=1 on CPU: the kernel is called on CPU tensors) and prints one JSON object per
case; `cuda_cases()` are the V4-Flash sizes (E 256, D 4096, K 6, bf16) on a GPU.

Criteria: weights within WEIGHT_TOLERANCE[dtype] relative, element by element (fp32: summation
order and the last bit of exp/log; bf16: two roundings, 2^-6, for a logit rounded the other way by
cuBLAS; from equal logits bf16 weights are bit-equal). "grid" inputs are small multiples of powers of
two whose products and sums are exact in fp32 in any order, so the kernel's logits equal the
reference's bit for bit and its ids must equal the reference's in every row, ties included (the tie
rule: the lowest expert id among equal values at the K-th place). "normal" inputs are Gaussian, as
trained weights look; there a row's ids may differ only where the reference's K-th and (K+1)-th
biased scores are within two roundings of the score (a logit summed in another order can round the
other way), and such rows' weights are not compared. On the GPU the grid references run with
cuBLAS's reduced-precision bf16 reductions off, so their logits are exact too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch

WEIGHT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}
ROUTE_SCALE = 1.5


@dataclass(frozen=True)
class GateCheck:
    case_id: str
    ids_equal: bool
    mismatched_rows: int
    weight_error: float  # max |w − w_ref| / |w_ref|
    tolerance: float
    bit_equal_weights: float  # share of weights equal bit for bit
    boundary_ties: int = 0  # learned rows whose K-th and (K+1)-th biased scores are equal
    near_tie_mismatches: int = 0  # of mismatched_rows, those allowed ("normal" inputs: near ties)
    ties_required: bool = False
    kernel_ran: bool = True

    @property
    def passed(self) -> bool:
        ties_ok = self.boundary_ties > 0 or not self.ties_required
        ids_ok = self.ids_equal or self.near_tie_mismatches == self.mismatched_rows
        return ids_ok and self.weight_error <= self.tolerance and self.kernel_ran and ties_ok


def make_gate(num_experts: int, hidden: int, top_k: int, hashed: bool, dtype, device, *, vocab: int = 64):
    """A `Gate` of the given shape (one layer, learned or hash); parameters left uninitialised."""
    from moemesh.common.model.config import RouterKind
    from moemesh.common.model.moe import Gate

    config = SimpleNamespace(mlp_layer_types=[RouterKind.HASH if hashed else RouterKind.LEARNED],
                             num_experts_per_tok=top_k, routed_scaling_factor=ROUTE_SCALE,
                             n_routed_experts=num_experts, hidden_size=hidden, vocab_size=vocab)
    return Gate(config, 0, dtype=dtype, device=device).requires_grad_(False)


def fill_gate(gate, x_rows: int, inputs: str, bias: str, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random parameters in place -> (x [T, D], token_ids [T]).

    inputs "grid": x in k/8, W in k/64 (|k| ≤ 8), exact fp32 sums, many tied scores; "normal":
    x ~ N(0, 1), W ~ N(0, 1/D). bias "random" N(0, 0.1²), "zero" (ties stay ties) or "none" (hash).
    """
    num_experts, hidden = gate.weight.shape
    device, dtype = gate.weight.device, gate.weight.dtype

    def grid(*shape, step):
        return torch.randint(-8, 9, shape, generator=generator, device=device).float() * step

    if inputs == "grid":
        x, weight = grid(x_rows, hidden, step=1 / 8), grid(num_experts, hidden, step=1 / 64)
    else:
        x = torch.randn(x_rows, hidden, generator=generator, device=device)
        weight = torch.randn(num_experts, hidden, generator=generator, device=device) / hidden**0.5
    gate.weight.copy_(weight.to(dtype))
    vocab = 64 if not hasattr(gate, "tid2eid") else gate.tid2eid.shape[0]
    if hasattr(gate, "tid2eid"):  # distinct experts per token, in random order
        noise = torch.rand(vocab, num_experts, generator=generator, device=device)
        gate.tid2eid.copy_(noise.argsort(dim=-1)[:, :gate.top_k])
    else:
        random_bias = torch.randn(num_experts, generator=generator, device=device) * 0.1
        gate.bias.copy_(random_bias if bias == "random" else torch.zeros_like(random_bias))
    token_ids = torch.randint(0, vocab, (x_rows,), generator=generator, device=device)
    return x.to(dtype), token_ids


def boundary_margins(gate, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Learned gates (torch path): per row the K-th minus the (K+1)-th largest s + bias, and the
    spacing of x's dtype at the K-th score (its last-bit value); None for hash gates."""
    if hasattr(gate, "tid2eid") or gate.top_k >= gate.weight.shape[0]:
        return None
    scores = torch.nn.functional.softplus(torch.nn.functional.linear(x, gate.weight)).sqrt()
    ranked, order = (scores + gate.bias).sort(dim=-1, descending=True)
    kth_score = scores.gather(1, order[:, gate.top_k - 1:gate.top_k]).squeeze(1).float().abs().clamp_min(1e-30)
    spacing = torch.exp2(torch.floor(torch.log2(kth_score))) * torch.finfo(scores.dtype).eps
    return ranked[:, gate.top_k - 1] - ranked[:, gate.top_k], spacing


@contextlib.contextmanager
def exact_cublas_sums(on: bool):
    """Within the block (when on), cuBLAS keeps fp32 reductions for bf16 matmuls."""
    matmul = torch.backends.cuda.matmul
    previous = matmul.allow_bf16_reduced_precision_reduction
    if on:
        matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = previous


def compare(case_id, out, ref, dtype, margins=None, ties_required: bool = False, near_ties_allowed: bool = False,
            kernel_ran: bool = True) -> GateCheck:
    """margins: `boundary_margins` of the reference; near_ties_allowed: rows with a margin within two
    spacings may differ in ids (their weights are then not compared)."""
    (ids, weights), (ref_ids, ref_weights) = out, ref
    row_ok = (ids == ref_ids).all(dim=-1)
    ties, near_tie_mismatches, compared = 0, 0, row_ok
    if margins is not None:
        margin, spacing = (m.to(row_ok.device) for m in margins)
        ties = int((margin == 0).sum())
        if near_ties_allowed:
            near_tie_mismatches = int((~row_ok & (margin <= 2 * spacing)).sum())
    if not near_ties_allowed:
        compared = torch.ones_like(row_ok)
    error = ((weights.double() - ref_weights.double()).abs() / ref_weights.double().abs().clamp_min(1e-30))
    error = error[compared].max() if bool(compared.any()) else torch.zeros(())
    return GateCheck(case_id, bool(row_ok.all()), int((~row_ok).sum()), float(error), WEIGHT_TOLERANCE[dtype],
                     float((weights == ref_weights).double().mean()), ties, near_tie_mismatches, ties_required,
                     kernel_ran)


def check_gate(case_id, num_tokens, num_experts, hidden, top_k, *, hashed=False, bias="random", inputs="grid",
               dtype=torch.float32, device="cpu", config=None, kernel_bias: bool = True) -> GateCheck:
    """The kernel against `Gate`'s torch path (kernel_bias False: the kernel gets no bias, the
    reference a zero one)."""
    from moemesh.common.kernels import gate as gate_kernel
    from moemesh.common.kernels.glue import forced_torch_glue

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    module = make_gate(num_experts, hidden, top_k, hashed, dtype, device)
    x, token_ids = fill_gate(module, num_tokens, inputs, bias, generator)
    with forced_torch_glue(), exact_cublas_sums(inputs == "grid"):
        ref = module(x, token_ids)
        margins = boundary_margins(module, x)
    out = gate_kernel.gate(x, module.weight, top_k=top_k, route_scale=ROUTE_SCALE,
                           bias=module.bias if not hashed and kernel_bias else None,
                           tid2eid=module.tid2eid if hashed else None, token_ids=token_ids if hashed else None,
                           config=config)
    return compare(case_id, out, ref, dtype, margins, near_ties_allowed=inputs == "normal")


def tie_rule_ids(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """The documented rule, one row at a time: largest first, lowest id among equals -> ids ascending."""
    rows = [sorted(sorted(range(len(row)), key=lambda e: (-row[e], e))[:top_k]) for row in scores.tolist()]
    return torch.tensor(rows, dtype=torch.long)


def check_tie_rule(case_id, dtype=torch.float32, device="cpu", config=None) -> GateCheck:
    """Blocks of experts with identical gate rows straddle the K-th place: both the kernel and the
    reference must take the lowest ids of the tied block (and agree with `tie_rule_ids`)."""
    from moemesh.common.kernels import gate as gate_kernel
    from moemesh.common.kernels.glue import forced_torch_glue

    num_experts, hidden, top_k, num_tokens = 16, 64, 6, 5
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    module = make_gate(num_experts, hidden, top_k, False, dtype, device)
    x, token_ids = fill_gate(module, num_tokens, "grid", "zero", generator)
    levels = torch.randperm(4, generator=torch.Generator().manual_seed(1)).to(device)  # 4 tied blocks of 4 experts
    rows = torch.randint(-8, 9, (4, hidden), generator=generator, device=device).float() / 64
    module.weight.copy_(rows[levels.repeat_interleave(4)].to(dtype))
    with forced_torch_glue():
        ref = module(x, token_ids)
        scores = torch.nn.functional.softplus(torch.nn.functional.linear(x, module.weight)).sqrt().float()
        margins = boundary_margins(module, x)
    out = gate_kernel.gate(x, module.weight, top_k=top_k, route_scale=ROUTE_SCALE, bias=module.bias, config=config)
    result = compare(case_id, out, ref, dtype, margins, ties_required=True)
    rule_ok = torch.equal(out[0].cpu(), tie_rule_ids(scores.cpu(), top_k))
    if device == "cuda":  # torch.topk on CUDA picks the same set
        topk_ids = torch.topk(scores, top_k, dim=-1, sorted=False).indices.sort(dim=-1).values
        rule_ok = rule_ok and torch.equal(topk_ids.cpu(), out[0].cpu())
    return GateCheck(case_id, result.ids_equal and rule_ok, result.mismatched_rows, result.weight_error,
                     result.tolerance, result.bit_equal_weights, result.boundary_ties, 0, True)


def check_dispatch(case_id, hashed: bool, device="cpu") -> GateCheck:
    """`Gate.forward` takes the kernel where the glue rule says so (here: the interpreter on CPU with
    MOEMESH_TRITON_GLUE_ON_CPU=1) and gives the torch path's result."""
    import os

    from moemesh.common.kernels import gate as gate_kernel
    from moemesh.common.kernels.glue import INTERPRET_ON_CPU_ENV, forced_torch_glue

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    module = make_gate(32, 128, 6, hashed, torch.float32, device)
    x, token_ids = fill_gate(module, 3, "normal", "random", generator)
    with forced_torch_glue():
        ref = module(x, token_ids)
    calls = []
    original = gate_kernel.gate
    gate_kernel.gate = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    previous = os.environ.get(INTERPRET_ON_CPU_ENV)
    os.environ[INTERPRET_ON_CPU_ENV] = "1"
    try:
        out = module(x, token_ids)
    finally:
        gate_kernel.gate = original
        if previous is None:
            os.environ.pop(INTERPRET_ON_CPU_ENV)
        else:
            os.environ[INTERPRET_ON_CPU_ENV] = previous
    return compare(case_id, out, ref, torch.float32, kernel_ran=len(calls) == 1)


def check_graph_replay(case_id, num_tokens: int, device="cuda") -> GateCheck:
    """The kernel captured in a CUDA graph and replayed on new inputs gives the eager result."""
    from moemesh.common.kernels import gate as gate_kernel

    generator = torch.Generator(device=device).manual_seed(zlib.crc32(case_id.encode()))
    module = make_gate(256, 4096, 6, False, torch.bfloat16, device)
    x, _ = fill_gate(module, num_tokens, "normal", "random", generator)
    static_x = x.clone()

    def call():
        return gate_kernel.gate(static_x, module.weight, top_k=6, route_scale=ROUTE_SCALE, bias=module.bias)

    call()  # compile and create the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    x_new, _ = fill_gate(module, num_tokens, "normal", "random", generator)
    static_x.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    return compare(case_id, captured, call(), torch.bfloat16)


def hopper_compile_errors(variants=((1, False), (8, True), (64, True), (2048, False))) -> dict[str, str | None]:
    """Compile the kernel at V4-Flash shape for sm_90 with ptxas (no GPU needed), one variant per
    (tokens, hashed) with the launch configuration chosen for it -> {variant: error or None}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moemesh.common.kernels import gate as gate_kernel

    signature = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32", "tid2eid_ptr": "*i64",
                 "token_ids_ptr": "*i64", "ids_ptr": "*i64", "weights_ptr": "*bf16", "partial_ptr": "*fp32",
                 "counter_ptr": "*i32", "num_tokens": "i32", "hidden": "i32", "num_experts": "i32",
                 "route_scale": "fp32"}
    errors: dict[str, str | None] = {}
    for num_tokens, hashed in variants:
        config = gate_kernel.choose_config(num_tokens, 256, 4096)
        padded = gate_kernel.padded_experts(256)
        constexprs = {"TOP_K": 6, "KP": 8, "EP": padded, "HASH": hashed, "HAS_BIAS": not hashed,
                      "ROUND_BF16": True, "BLOCK_T": config.block_t, "BLOCK_E": config.block_e,
                      "BLOCK_D": config.block_d, "D_STEPS": triton.cdiv(4096 // config.num_splits, config.block_d),
                      "NUM_E_BLOCKS": padded // config.block_e, "NUM_SPLITS": config.num_splits,
                      "USE_DOT": config.use_dot, "PRECISION": "tf32"}
        full_signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        name = f"t{num_tokens}_{'hash' if hashed else 'learned'}"
        try:
            triton.compile(ASTSource(gate_kernel._gate_kernel, full_signature, constexprs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
            errors[name] = None
        except Exception as exc:  # the message is the result
            errors[name] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    return errors


Case = tuple[str, Callable[[], GateCheck]]


def interpret_cases() -> list[Case]:
    """Small shapes covering both routings, bias kinds, dtypes, and each launch path of the kernel:
    finish in registers (one program per row block), split over experts, over D, both, and tl.dot."""
    from moemesh.common.kernels.gate import GateConfig

    bf16 = torch.bfloat16
    one_block, split_e, split_d, split_both = (GateConfig(1, 16, 32), GateConfig(4, 8, 32),
                                               GateConfig(2, 16, 32, num_splits=2),
                                               GateConfig(8, 16, 64, num_splits=2))
    dot_split = GateConfig(16, 16, 32, num_splits=2)
    specs = [  # (case_id, T, E, D, K, kwargs)
        ("learned_t1_e8_d64_k2", 1, 8, 64, 2, {}),
        ("learned_t5_e16_d128_k6_bf16", 5, 16, 128, 6, {"dtype": bf16}),
        ("learned_t17_e32_d128_k6", 17, 32, 128, 6, {}),
        ("learned_t17_e32_d64_k2_bf16_normal", 17, 32, 64, 2, {"dtype": bf16, "inputs": "normal"}),
        ("learned_t5_e32_d128_k6_normal", 5, 32, 128, 6, {"inputs": "normal"}),
        ("learned_zero_bias_t5_e16_d64_k6", 5, 16, 64, 6, {"bias": "zero"}),
        ("learned_no_bias_t17_e8_d128_k2_bf16", 17, 8, 128, 2, {"bias": "zero", "kernel_bias": False, "dtype": bf16}),
        ("learned_one_block_t5_e16_d64_k6", 5, 16, 64, 6, {"config": one_block}),
        ("learned_split_e_t5_e32_d64_k6_bf16", 5, 32, 64, 6, {"config": split_e, "dtype": bf16}),
        ("learned_split_d_t5_e16_d128_k2", 5, 16, 128, 2, {"config": split_d, "bias": "zero"}),
        ("learned_split_both_t17_e32_d128_k6", 17, 32, 128, 6, {"config": split_both}),
        ("learned_dot_split_t17_e32_d128_k6_bf16", 17, 32, 128, 6, {"config": dot_split, "dtype": bf16}),
        ("hash_t1_e8_d64_k2", 1, 8, 64, 2, {"hashed": True}),
        ("hash_t5_e32_d128_k6_bf16", 5, 32, 128, 6, {"hashed": True, "dtype": bf16}),
        ("hash_t17_e16_d64_k6_normal", 17, 16, 64, 6, {"hashed": True, "inputs": "normal"}),
        ("hash_split_both_t17_e32_d128_k2", 17, 32, 128, 2, {"hashed": True, "config": split_both}),
    ]
    cases: list[Case] = [(case_id, lambda c=case_id, t=t, e=e, d=d, k=k, kw=kw: check_gate(c, t, e, d, k, **kw))
                         for case_id, t, e, d, k, kw in specs]
    cases += [("tie_rule_fp32", lambda: check_tie_rule("tie_rule_fp32")),
              ("tie_rule_bf16_split", lambda: check_tie_rule("tie_rule_bf16_split", bf16, config=split_e)),
              ("dispatch_learned", lambda: check_dispatch("dispatch_learned", False)),
              ("dispatch_hash", lambda: check_dispatch("dispatch_hash", True))]
    return cases


def cuda_cases() -> list[Case]:
    """V4-Flash shapes in bf16 through `Gate` (kernel by default, torch under forced_torch_glue)."""
    bf16, cuda = torch.bfloat16, "cuda"
    cases: list[Case] = []
    for num_tokens in (1, 8, 64, 2048):
        for hashed in (False, True):
            for inputs in ("grid", "normal"):
                case_id = f"flash_{'hash' if hashed else 'learned'}_{inputs}_t{num_tokens}"
                cases.append((case_id, lambda c=case_id, t=num_tokens, h=hashed, i=inputs: check_gate(
                    c, t, 256, 4096, 6, hashed=h, inputs=i, dtype=bf16, device=cuda)))
    cases.append(("flash_zero_bias_grid_t64", lambda: check_gate("flash_zero_bias_grid_t64", 64, 256, 4096, 6,
                                                                 bias="zero", dtype=bf16, device=cuda)))
    cases.append(("tie_rule_cuda_bf16", lambda: check_tie_rule("tie_rule_cuda_bf16", bf16, cuda)))
    for num_tokens in (1, 64):
        case_id = f"graph_replay_t{num_tokens}"
        cases.append((case_id, lambda c=case_id, t=num_tokens: check_graph_replay(c, t)))
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("interpret", "cuda"), required=True)
    args = parser.parse_args(argv)
    if args.suite == "interpret":
        from moemesh.bench.checks.quantized_kernels import patch_interpreter_bf16_dot

        patch_interpreter_bf16_dot()
        torch.set_num_threads(1)
    failed = 0
    for case_id, run_case in interpret_cases() if args.suite == "interpret" else cuda_cases():
        result = run_case()
        failed += not result.passed
        print(json.dumps({**asdict(result), "passed": result.passed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
