"""Runs of the glue checks that need their own process or no GPU (used by the tests).

- `run_interpret_suite`: `glue_kernels` (or another check module, e.g. `gate_kernel`) in a child with
  TRITON_INTERPRET=1 (the interpreter is chosen when a kernel is decorated, so it cannot be switched on
  inside a process that imported the kernels);
- `model_forward_check`: the tiny model's forward with every glue op on the Triton path (child with
  TRITON_INTERPRET=1 and MOEMESH_TRITON_GLUE_ON_CPU=1) against transformers;
- `hopper_compile_errors`: every kernel variant compiled for sm_90 by ptxas, no GPU needed.
"""

from __future__ import annotations

import json
import sys

import torch


def model_forward_check(num_tokens: int = 40) -> dict:
    """The tiny model's full forward with every glue op on the Triton path vs transformers (fp32 CPU).

    Meant for a child with TRITON_INTERPRET=1 and MOEMESH_TRITON_GLUE_ON_CPU=1 (the interpreter runs
    the kernels on CPU tensors); reports whether the Triton path was on and the max |logit difference|.
    """
    from moemesh.common.kernels.glue import use_triton_glue
    from moemesh.common.model.attention_side import AttentionSide
    from moemesh.common.model.moe import RoutedExperts
    from moemesh.common.model.reference import ReferenceModel
    from moemesh.bench.checks.tiny_model import random_hub_state_dict, split_hub_state_dict, tiny_config

    torch.set_num_threads(1)
    config = tiny_config()
    hub_state, hf_model = random_hub_state_dict(config, seed=1234)
    attention_state, experts = split_hub_state_dict(hub_state, config)
    model = ReferenceModel(AttentionSide.from_state_dict(config, attention_state),
                           RoutedExperts.from_config(experts, config))
    tokens = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        oracle = hf_model(tokens[None], use_cache=False).logits[0]
        logits = model.forward_sequence(tokens)
    return {"case_id": "model_forward", "triton_path": use_triton_glue(torch.zeros(1)),
            "max_abs_logit_diff": float((logits - oracle).abs().max()), "all_finite": bool(torch.isfinite(logits).all())}


def hopper_compile_errors(only: str | None = None) -> dict[str, str | None]:
    """Compile every kernel variant the model uses for sm_90 (no GPU needed) -> {variant: error or None}.

    Catches what the interpreter accepts and the compiler does not (unsupported control flow, dot
    shapes, dtype mixes) before a device run.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moemesh.common.kernels import mhc, mhc_streams, norm_rope

    target = GPUTarget("cuda", 90, 32)
    variants = []  # (name, kernel, signature, constexprs)
    if only != "norm":
        mix_sig = {"h_ptr": "*bf16", "fn_ptr": "*fp32", "mix_part_ptr": "*fp32", "sq_part_ptr": "*fp32",
                   "num_tokens": "i32", "num_cols": "i32", "num_mix": "i32"}
        for precision in ("ieee", "tf32x3", "bf16x3"):
            variants.append((f"mix_{precision}", mhc._mix_partials_kernel, mix_sig,
                             {"K_STEPS": 2, "BLOCK_T": 16, "BLOCK_M": 32, "BLOCK_K": 128, "PRECISION": precision}))
        variants.append(("mix_gemv", mhc._mix_gemv_kernel, mix_sig, {"K_STEPS": 2, "BLOCK_M": 32, "BLOCK_K": 128}))
        finish_sig = {"h_ptr": "*bf16", "mix_part_ptr": "*fp32", "sq_part_ptr": "*fp32", "base_ptr": "*fp32",
                      "scale_ptr": "*fp32", "x_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32",
                      "out_weight_ptr": "*fp32", "num_tokens": "i32", "hidden": "i32", "num_splits": "i32",
                      "hc_eps": "fp32", "norm_eps": "fp32", "out_eps": "fp32"}
        for head in (False, True):
            for out_norm in (False, True):
                variants.append((f"finish_head{int(head)}_norm{int(out_norm)}", mhc._hc_finish_kernel, finish_sig,
                                 {"SINKHORN_ITERS": 20, "N": 4, "NP": 4, "BLOCK_M": 32, "BLOCK_S": 64,
                                  "BLOCK_D": 4096 if out_norm else 256, "HEAD": head, "OUT_NORM": out_norm,
                                  "APPROX_DIV": out_norm}))
        post_sig = {"y_ptr": "*bf16", "h_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "out_ptr": "*bf16",
                    "hidden": "i32"}
        variants.append(("post", mhc_streams._hc_post_kernel, post_sig, {"N": 4, "NP": 4, "BLOCK_D": 256}))
        mix_post_sig = {**post_sig, "addend_ptr": "*bf16", "next_fn_ptr": "*fp32", "mix_part_ptr": "*fp32",
                        "sq_part_ptr": "*fp32", "num_mix": "i32"}
        variants.append(("post_addend_mix", mhc_streams._hc_post_kernel, mix_post_sig,
                         {"N": 4, "NP": 4, "BLOCK_D": 256, "BLOCK_M": 32}))
        embed_sig = {"ids_ptr": "*i64", "table_ptr": "*bf16", "out_ptr": "*bf16", "hidden": "i32",
                     "next_fn_ptr": "*fp32", "mix_part_ptr": "*fp32", "sq_part_ptr": "*fp32", "num_mix": "i32"}
        variants.append(("embed_mix", mhc_streams._embed_streams_kernel, embed_sig,
                         {"N": 4, "NP": 4, "BLOCK_D": 256, "BLOCK_M": 32}))
        variants.append(("post_slots_addend_mix", mhc_streams._hc_post_kernel, mix_post_sig,  # routed slots summed inside
                         {"N": 4, "NP": 4, "BLOCK_D": 256, "BLOCK_M": 32, "Y_SLOTS": 6}))
    if only != "mhc":
        norm_sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "weight_ptr": "*fp32", "cos_ptr": "*fp32",
                    "sin_ptr": "*fp32", "rows_per_token": "i32", "num_channels": "i32", "rope_half": "i32",
                    "eps": "fp32"}
        for kind in norm_rope.NormKind:
            for rope in (False, True):
                variants.append((f"norm{int(kind)}_rope{int(rope)}", norm_rope._norm_rope_kernel, norm_sig,
                                 {"NORM": int(kind), "ROPE": rope, "INVERSE": rope, "BLOCK_C": 512, "BLOCK_H": 32}))
    errors: dict[str, str | None] = {}
    for name, kernel, signature, constexprs in variants:
        full_signature = {**signature, **{key: "constexpr" for key in constexprs}}
        try:
            triton.compile(ASTSource(kernel, full_signature, constexprs), target=target, options={"num_warps": 4})
            errors[name] = None
        except Exception as exc:  # the message is the result
            errors[name] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
    return errors


def run_interpret_suite(only: str | None, timeout_s: float = 240, suite: str = "interpret",
                        module: str = "moemesh.bench.checks.glue_kernels") -> tuple[dict[str, dict], str]:
    """Run a check module's suite in a child with TRITON_INTERPRET=1 -> ({case_id: record}, child's stderr).

    suite "model" also sets MOEMESH_TRITON_GLUE_ON_CPU=1 (the whole tiny model through the kernels).
    """
    import os
    import subprocess
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    if suite == "model":
        env["MOEMESH_TRITON_GLUE_ON_CPU"] = "1"
    command = [sys.executable, "-m", module, "--suite", suite]
    if only:
        command += ["--only", only]
    proc = subprocess.run(command, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["case_id"]] = record
    return records, f"rc {proc.returncode}: {proc.stderr[-4000:]}"
