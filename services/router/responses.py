"""OpenAI-shaped response bodies and stream chunks (plain dicts, JSON-ready)."""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.services.router.engine_client import SpeculativeStats
from moemesh.services.router.sequence_output import ChoiceDelta, SequenceOutput, TokenLogprob


@dataclass(frozen=True)
class UsageTotals:
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    speculative: SpeculativeStats | None

    def to_json(self) -> dict:
        body = {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }
        if self.speculative is not None:
            body["speculative"] = self.speculative.to_json()
        return body


def combine_usage(outputs: list[SequenceOutput], prompt_lengths: list[int], num_choices_per_prompt: int) -> UsageTotals:
    """Prompt tokens count once per prompt (not per choice); completion tokens per choice.

    Speculative stats of several choices add up; their mean accepted length is the mean
    of the choices that ran speculation.
    """
    num_cached = 0
    for prompt_index in range(len(prompt_lengths)):
        group = outputs[prompt_index * num_choices_per_prompt : (prompt_index + 1) * num_choices_per_prompt]
        num_cached += max((o.usage.num_cached_prompt_tokens for o in group if o.usage), default=0)
    num_completion = sum(o.usage.num_completion_tokens if o.usage else o.num_tokens for o in outputs)
    stats = [o.speculative for o in outputs if o.speculative is not None]
    speculative = None
    if stats:
        ran = [s for s in stats if s.ran]
        speculative = SpeculativeStats(
            ran=bool(ran),
            num_draft_tokens=sum(s.num_draft_tokens for s in stats),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in stats),
            mean_accepted_length=sum(s.mean_accepted_length for s in ran) / len(ran) if ran else 0.0,
        )
    return UsageTotals(sum(prompt_lengths), num_completion, num_cached, speculative)


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": e.token,
                "logprob": e.logprob,
                "bytes": list(e.token_bytes),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for _, t, b, lp in e.top],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset_start: int) -> dict:
    offsets, offset = [], text_offset_start
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for _, t, _, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_message(output: SequenceOutput) -> dict:
    message: dict = {"role": "assistant", "content": output.text}
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [{k: v for k, v in c.to_openai().items() if k != "index"} for c in output.tool_calls]
    return message


def chat_completion(response_id: str, created: int, model: str, outputs: list[SequenceOutput],
                    usage: UsageTotals, with_logprobs: bool) -> dict:
    choices = [
        {
            "index": o.index,
            "message": chat_message(o),
            "logprobs": chat_logprobs(o.logprobs) if with_logprobs else None,
            "finish_reason": o.finish_reason,
        }
        for o in outputs
    ]
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage.to_json()}


def chat_chunk(response_id: str, created: int, model: str, delta: ChoiceDelta, *, first: bool,
               with_logprobs: bool) -> dict:
    body: dict = {}
    if first:
        body["role"] = "assistant"
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.text or first:
        body["content"] = delta.text
    if delta.tool_calls:
        body["tool_calls"] = [c.to_openai() for c in delta.tool_calls]
    choice = {
        "index": delta.index,
        "delta": body,
        "logprobs": chat_logprobs(delta.logprobs) if with_logprobs and delta.logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [choice]}


def completion(response_id: str, created: int, model: str, outputs: list[SequenceOutput],
               usage: UsageTotals, with_logprobs: bool, echo_texts: list[str] | None = None) -> dict:
    """echo_texts: per choice, the prompt text put before the completion (`echo`)."""
    choices = [
        {
            "index": o.index,
            "text": (echo_texts[o.index] if echo_texts else "") + o.text,
            "logprobs": completion_logprobs(o.logprobs, 0) if with_logprobs else None,
            "finish_reason": o.finish_reason,
        }
        for o in outputs
    ]
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage.to_json()}


def completion_chunk(response_id: str, created: int, model: str, delta: ChoiceDelta, *,
                     with_logprobs: bool, text_offset: int) -> dict:
    choice = {
        "index": delta.index,
        "text": delta.text,
        "logprobs": completion_logprobs(delta.logprobs, text_offset) if with_logprobs and delta.logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(response_id: str, created: int, model: str, usage: UsageTotals, *, chat: bool) -> dict:
    return {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage.to_json()}


def stream_error(message: str) -> dict:
    """The event that tells a streaming client why its choices ended with finish_reason "error"
    (sent after their final chunks, before [DONE])."""
    return {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": None}}
