"""One measured run of `moemesh bench speculation` against a running server, over HTTP.

`measure_run` sends the run's completions at once, streamed (`streamed_completion` keeps the times of each
request's first and last text chunk), reads the router's engine counters (`/status.json`) before and after,
and returns the run's figures: output tokens/s over the wall clock, decode tokens/s (the tokens after each
request's first over first token .. last token), TTFT, the accepted length from each response's
usage.speculative, the texts and their hash, and the engine's steps, step time and drafter round trips.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time


async def engine_counters(client, base_url: str) -> dict:
    reply = await client.get(f"{base_url}/status.json")
    reply.raise_for_status()
    return reply.json().get("engine", {})


def counter_delta(before: dict, after: dict, key: str) -> float:
    return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)


async def measure_run(base_url: str, prompts: list[str], temperature: float, max_tokens: int, seed: int,
               ignore_eos: bool, timeout_s: float = 600.0) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async def one(index: int, prompt: str) -> dict:
            body = {"model": "moemesh", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": seed + index, "ignore_eos": ignore_eos, "stream": True,
                    "stream_options": {"include_usage": True}}
            return await streamed_completion(client, f"{base_url}/v1/completions", body)

        before = await engine_counters(client, base_url)
        start_s = time.perf_counter()
        replies = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        elapsed_s = time.perf_counter() - start_s
        after = await engine_counters(client, base_url)
    first_s = min(r["first_token_s"] for r in replies) - start_s
    decode_s = max(r["last_token_s"] for r in replies) - min(r["first_token_s"] for r in replies)
    num_decoded = sum(max(0, r["usage"]["completion_tokens"] - 1) for r in replies)
    num_tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    spec = [r["usage"].get("speculative") or {} for r in replies]
    accepted_lengths = [s["mean_accepted_length"] for s in spec if s.get("ran")]
    num_steps = counter_delta(before, after, "num_steps")
    step_s = counter_delta(before, after, "step_seconds_total")
    num_draft_requests = counter_delta(before, after, "spec_num_draft_requests")
    draft_s = counter_delta(before, after, "spec_draft_round_trip_s_total")
    policy = {key.removeprefix("spec_policy_"): counter_delta(before, after, key)
              for key in after if key.startswith("spec_policy_num_")}
    return {
        "num_requests": len(prompts), "num_output_tokens": num_tokens, "elapsed_s": elapsed_s,
        "tokens_per_s": num_tokens / elapsed_s if elapsed_s > 0 else 0.0,
        # decode alone: the tokens after each request's first, over first token .. last token (TTFT left out)
        "decode_tokens_per_s": num_decoded / decode_s if decode_s > 0 else 0.0,
        "time_to_first_token_s": first_s,
        "speculation_ran": any(s.get("ran") for s in spec),
        "draft_tokens": sum(s.get("draft_tokens", 0) for s in spec),
        "accepted_tokens": sum(s.get("accepted_tokens", 0) for s in spec),
        "mean_accepted_length": sum(accepted_lengths) / len(accepted_lengths) if accepted_lengths else 0.0,
        "cached_tokens": sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in replies),
        "finish_reasons": [r["choices"][0]["finish_reason"] for r in replies],
        "completion_tokens": [r["usage"]["completion_tokens"] for r in replies],
        "output_hash": hashlib.sha256("\x00".join(r["choices"][0]["text"] for r in replies).encode()).hexdigest(),
        "texts": [r["choices"][0]["text"] for r in replies],
        # where the time goes (router's view), per engine step
        "num_steps": num_steps,
        "step_ms_mean": 1e3 * step_s / num_steps if num_steps else 0.0,
        "num_draft_requests": num_draft_requests,
        "draft_round_trip_ms_mean": 1e3 * draft_s / num_draft_requests if num_draft_requests else 0.0,
        "other_ms_per_step": 1e3 * (elapsed_s - step_s - draft_s) / num_steps if num_steps else 0.0,
        "tokens_per_step": num_tokens / num_steps if num_steps else 0.0,
        "policy": policy,  # the router's cost-aware width policy in this run (adaptive mode)
    }


async def streamed_completion(client, url: str, body: dict) -> dict:
    """One streamed completion -> {"choices": [{"text", "finish_reason"}], "usage", "first_token_s",
    "last_token_s"} (perf_counter times of the first and the last chunk that carried text)."""
    text, finish_reason, usage = [], None, None
    first_s = last_s = None
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code >= 400:
            await reply.aread()
            reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    last_s = time.perf_counter()
                    first_s = first_s or last_s
                    text.append(choice["text"])
                finish_reason = choice.get("finish_reason") or finish_reason
    if usage is None or first_s is None:
        raise RuntimeError(f"stream ended without {'usage' if usage is None else 'text'}")
    return {"choices": [{"text": "".join(text), "finish_reason": finish_reason}], "usage": usage,
            "first_token_s": first_s, "last_token_s": last_s}
