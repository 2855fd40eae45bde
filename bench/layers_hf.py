"""transformers' `DeepseekV4ForCausalLM` on the same layer stack, as a second point of comparison.

Random initialisation on the device in the activation dtype (bf16 on GPU: every weight dequantised
to bf16, routed experts included, as transformers runs the model without FP8 kernels), eager
attention (the only one it supports, docs/model.md §5.2). The cache is filled by a chunked prefill of the
context (chunks of at most `MAX_PREFILL_TOKENS_PER_FORWARD / B` tokens per sequence, so eager
attention's score tensors stay small), then decode steps of one token per sequence are timed one
by one with a device sync (transformers' cache is dynamic: no CUDA graph). transformers is
imported only here.
Legend: B batch, S tokens per sequence in a forward.
"""

from __future__ import annotations

import time

import torch

from moemesh.bench.timing import median, sync

MAX_PREFILL_TOKENS_PER_FORWARD = 8192


def transformers_available() -> bool:
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        return False
    return True


def build_hf_model(config, device: torch.device, dtype: torch.dtype):
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf_config = DeepseekV4Config(**config.to_transformers_dict())
    hf_config._attn_implementation = "eager"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DeepseekV4ForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval(), transformers.__version__


def time_hf_decode(model, vocab_size: int, batch_size: int, context_tokens: int, num_steps: int,
                   device: torch.device, seed: int = 0) -> dict:
    """Fill a B-sequence cache with `context_tokens` tokens, then time `num_steps` decode steps."""
    generator = torch.Generator(device=device).manual_seed(seed)
    chunk = max(1, min(context_tokens, MAX_PREFILL_TOKENS_PER_FORWARD // batch_size))
    cache = None
    filled = 0
    fill_start = time.perf_counter()
    with torch.inference_mode():
        while filled < context_tokens:
            size = min(chunk, context_tokens - filled)
            ids = torch.randint(0, vocab_size, (batch_size, size), generator=generator, device=device)  # [B, S]
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            filled += size
        sync(device)
        fill_s = time.perf_counter() - fill_start
        samples = []
        for step in range(num_steps + 2):  # two warm-up steps
            ids = torch.randint(0, vocab_size, (batch_size, 1), generator=generator, device=device)
            sync(device)
            start = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            sync(device)
            if step >= 2:
                samples.append(time.perf_counter() - start)
    return {"batch_size": batch_size, "context_tokens": context_tokens, "prefill_chunk_tokens": chunk,
            "context_fill_s": fill_s, "step_s": median(samples), "step_min_s": min(samples),
            "num_steps": len(samples)}


def bench_transformers(config, batch_sizes: list[int], context_tokens: int, num_steps: int,
                       device: torch.device, dtype: torch.dtype) -> dict:
    """{"version", "decode": [per batch]} or {"error": ...} when transformers fails to run."""
    try:
        model, version = build_hf_model(config, device, dtype)
    except Exception as error:  # a missing/older transformers or an out-of-memory
        return {"error": f"build failed: {type(error).__name__}: {error}"}
    results = []
    try:
        for batch_size in batch_sizes:
            results.append(time_hf_decode(model, config.vocab_size, batch_size, context_tokens, num_steps, device))
    except Exception as error:
        return {"version": version, "decode": results, "error": f"{type(error).__name__}: {error}"}
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"version": version, "dtype": str(dtype).removeprefix("torch."), "decode": results}
