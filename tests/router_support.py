"""Shared helpers for the router tests (not a test module): a tiny byte-level BPE tokenizer
trained in-process, and a deterministic in-test engine implementing `EngineClient`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moemesh.common.chat import SPECIAL_TOKENS
from moemesh.services.router.engine_client import (
    EngineError,
    FinishReason,
    GenerationRequest,
    HealthReport,
    Rejection,
    SpeculativeStats,
    TokenEvent,
    TopLogprob,
    Usage,
)

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "héllo wörld, ça va? naïve café résumé",
    "日本語のテキストと中文文本 with emoji 😀🎉👍 and more 😀😀",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def f(x):\n    return x * 2\n\n",
] * 20


@functools.cache
def tiny_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer.to_str()


def tiny_tokenizer() -> Tokenizer:
    """A fresh instance each call (a Tokenizer object is not shared across threads here)."""
    return Tokenizer.from_str(tiny_tokenizer_json())


class ScriptedEngine:
    """A real `EngineClient` that 'generates' a fixed token script per request.

    Each sequence emits `script` token by token (every `step_delay_s`), after an initial
    `first_token_delay_s` (think: a long prefill), finishing with LENGTH at max_tokens or
    STOP after the script's EOS. With `fail` it raises EngineError; with `fail_in_stream`
    it ends with an ERROR event after one token.
    """

    def __init__(self, script: list[int], *, eos_id: int, step_delay_s: float = 0.0,
                 first_token_delay_s: float = 0.0, cached_tokens: int = 0) -> None:
        self.script = script
        self.eos_id = eos_id
        self.step_delay_s = step_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.cached_tokens = cached_tokens
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.rejection: Rejection | None = None
        self.healthy = True
        self.fail = False
        self.fail_in_stream = False
        self.admission_calls: list[int] = []

    async def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.fail:
            raise EngineError("attention worker 0 is down", retry_after_s=5.0)
        self.submitted.append(request)
        return self._run(request)

    def tokens_for(self, request: GenerationRequest) -> list[int]:
        """The tokens this request emits: the script rotated by seed % 3 (so fanned-out
        choices differ), cut after the first EOS and at max_tokens."""
        params = request.sampling_params
        offset = (params.seed or 0) % 3
        tokens = self.script[offset:] + self.script[:offset]
        if self.eos_id in tokens and not params.ignore_eos:
            tokens = tokens[: tokens.index(self.eos_id) + 1]
        return tokens[: params.max_tokens]

    async def _run(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        params = request.sampling_params
        num_prompt = len(request.prompt_token_ids)
        tokens = self.tokens_for(request)
        if self.first_token_delay_s:
            await asyncio.sleep(self.first_token_delay_s)
        for position, token_id in enumerate(tokens[: params.max_tokens]):
            if request.request_id in self.aborted:
                return
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            if self.fail_in_stream and position == 1:
                yield TokenEvent(request.request_id, (), finish_reason=FinishReason.ERROR,
                                 error_message="expert worker lost")
                return
            done_stop = token_id == self.eos_id and not params.ignore_eos
            done_length = position + 1 == params.max_tokens
            finish = FinishReason.STOP if done_stop else FinishReason.LENGTH if done_length else None
            logprobs = top = None
            if params.num_logprobs is not None:
                logprobs = (-0.5 - position / 10,)
                top = (tuple(TopLogprob(token_id + k, -0.5 - k) for k in range(params.num_logprobs)),)
            final = finish is not None
            yield TokenEvent(
                request.request_id,
                (token_id,),
                logprobs=logprobs,
                top_logprobs=top,
                finish_reason=finish,
                usage=Usage(num_prompt, position + 1, self.cached_tokens),
                speculative=SpeculativeStats(True, 4, 3, 2.5) if final else None,
            )
            if final:
                return
        yield TokenEvent(request.request_id, (), finish_reason=FinishReason.LENGTH,
                         usage=Usage(num_prompt, len(tokens), self.cached_tokens),
                         speculative=SpeculativeStats(False))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def health(self) -> HealthReport:
        if self.healthy:
            return HealthReport(True, {"attention-0": "ok", "expert-0": "ok"})
        return HealthReport(False, {"attention-0": "ok", "expert-0": "down: no heartbeat for 5.0 s"})

    def admission_check(self, estimated_prompt_tokens: int) -> Rejection | None:
        self.admission_calls.append(estimated_prompt_tokens)
        return self.rejection

    def stats(self) -> dict:
        return {
            "num_waiting": 2,
            "num_running": 3,
            "kv_blocks_used": {"gpu": 10, "cpu": 1},
            "kv_blocks_total": {"gpu": 100, "cpu": 400},
            "prefix_cache_queried_tokens": 50,
            "prefix_cache_hit_tokens": 20,
            "spec_draft_by_position": [10, 8],
            "spec_accepted_by_position": [9, 5],
        }
