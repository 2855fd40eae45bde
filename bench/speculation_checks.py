"""The deterministic decode checks of `bench/speculation.py` (in the manner of Lucebox's
bench_ds4_decode.py), kept apart so they can be tested on hand-made runs.

`run_problems` flags one run: a short request (no token, or fewer than max_tokens without EOS; with
ignore_eos any request below max_tokens), a finish other than length / stop, a cached prefix, zero
throughput, or a speculative run in which speculation did not run. `speedups` gives spec / off
tokens/s per configuration (end to end, and the decode alone when the runs have it) and flags greedy outputs that differ from the `off` server's (per
repeat, with the request and the texts' tails where they part).
"""

from __future__ import annotations

from statistics import median


def run_problems(name: str, run: dict, max_tokens: int, speculative: bool, ignore_eos: bool) -> list[str]:
    problems = []
    for reason, count in zip(run["finish_reasons"], run["completion_tokens"]):
        if count == 0 or (reason == "length" and count != max_tokens) or (ignore_eos and count != max_tokens):
            problems.append(f"{name}: short request ({count} tokens, finish {reason})")
    if any(reason not in ("length", "stop") for reason in run["finish_reasons"]):
        problems.append(f"{name}: finish reasons {run['finish_reasons']}")
    if run["cached_tokens"]:
        problems.append(f"{name}: hit a cached prefix ({run['cached_tokens']} tokens)")
    if run["tokens_per_s"] <= 0:
        problems.append(f"{name}: zero throughput")
    if speculative and not run["speculation_ran"] and not policy_chose_plain(run):
        problems.append(f"{name}: speculation did not run")
    return problems


def policy_chose_plain(run: dict) -> bool:
    """No request verified a draft, but the router's cost-aware policy was at work: it asked the
    drafter and cut every proposal, or skipped the drafter because plain steps paid better."""
    policy = run.get("policy") or {}
    consulted = run.get("num_draft_requests", 0) > 0 and policy.get("num_cut_drafts", 0) > 0
    return consulted or policy.get("num_skipped_steps", 0) > 0


def speedups(results: dict[str, dict], problems: list[str]) -> dict[str, float]:
    """results: `_summarise` output (key "<mode>/temperature=T/streams=S", each with repeat_ids and
    repeat_texts). Greedy texts are compared repeat by repeat (the same nonce on both servers); a
    repeat that failed on one server is skipped, not misaligned."""
    ratios = {}
    for key, spec in results.items():
        mode, suffix = key.split("/", 1)
        plain = results.get(f"off/{suffix}")
        if mode == "off" or plain is None:
            continue
        ratios[f"speedup/{mode}/{suffix}"] = spec["tokens_per_s"] / plain["tokens_per_s"] if plain["tokens_per_s"] else 0.0
        if plain.get("repeat_decode_tokens_per_s") and spec.get("repeat_decode_tokens_per_s"):
            # the decode alone (first token .. last, TTFT left out): medians over the repeats
            plain_decode, spec_decode = median(plain["repeat_decode_tokens_per_s"]), median(spec["repeat_decode_tokens_per_s"])
            ratios[f"decode_speedup/{mode}/{suffix}"] = spec_decode / plain_decode if plain_decode else 0.0
        if not suffix.startswith("temperature=0/"):
            continue
        plain_by_repeat = dict(zip(plain["repeat_ids"], plain["repeat_texts"]))
        for repeat, spec_texts in zip(spec["repeat_ids"], spec["repeat_texts"]):
            plain_texts = plain_by_repeat.get(repeat)  # same prompts (the repeat's nonce) on both servers
            if plain_texts is None or plain_texts == spec_texts:
                continue
            first = next((i for i, (a, b) in enumerate(zip(plain_texts, spec_texts)) if a != b),
                         min(len(plain_texts), len(spec_texts)) - 1)
            problems.append(f"greedy output hash differs with speculation {mode} ({suffix}, repeat {repeat}): "
                            f"request {first}, off {plain_texts[first][-80:]!r} vs {mode} {spec_texts[first][-80:]!r}")
    return ratios
