"""Per-choice output pipeline: token events -> text -> stop strings -> (chat parsing).

One `SequenceOutput` per generated sequence. It turns each `TokenEvent` into a
`ChoiceDelta` that is safe to send: no half characters (detokenizer), no text that could
still become a stop string (StopStringMatcher), no partial chat markers (ChatOutputParser).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.common.chat import ChatOutputParser, ToolCall
from moemesh.services.router.detokenizer import IncrementalDetokenizer, TokenBytes
from moemesh.services.router.engine_client import FinishReason, SpeculativeStats, TokenEvent, Usage


class StopStringMatcher:
    """Cuts text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stop_strings: tuple[str, ...]) -> None:
        self._stop_strings = stop_strings
        self._pending = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self._stop_strings:
            return text
        self._pending += text
        # A stop string that starts before the first complete hit but is still incomplete may
        # yet win (the earliest occurrence in the final text is the cut), so decide only when
        # no such partial match remains; never release text that may start a stop string.
        partial_start = self._earliest_partial_start()
        hits = [(self._pending.find(s), s) for s in self._stop_strings if s in self._pending]
        if hits and (partial_start is None or min(hits)[0] <= partial_start):
            position, self.matched = min(hits)
            released, self._pending = self._pending[:position], ""
            return released
        keep_from = len(self._pending) if partial_start is None else partial_start
        released, self._pending = self._pending[:keep_from], self._pending[keep_from:]
        return released

    def _earliest_partial_start(self) -> int | None:
        """First index q where pending[q:] is a proper prefix of some stop string, if any."""
        longest = max(len(stop) for stop in self._stop_strings)
        for start in range(max(0, len(self._pending) - longest + 1), len(self._pending)):
            tail = self._pending[start:]
            if any(len(tail) < len(stop) and stop.startswith(tail) for stop in self._stop_strings):
                return start
        return None

    def finish(self) -> str:
        """End of text: held partial matches can no longer complete, so a complete hit wins."""
        rest, self._pending = self._pending, ""
        if self.matched is not None:
            return ""
        hits = [(rest.find(s), s) for s in self._stop_strings if s in rest]
        if hits:
            position, self.matched = min(hits)
            return rest[:position]
        return rest


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[tuple[int, str, bytes, float], ...]  # (token_id, token, bytes, logprob)


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""  # completion text, or chat content
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # OpenAI string: stop, length, tool_calls, abort, error
    error_message: str | None = None

    def has_payload(self) -> bool:
        return bool(self.text or self.reasoning or self.tool_calls or self.logprobs)


class SequenceOutput:
    """State of one choice. `apply(event)` returns what to send; `stop_matched` tells the
    caller to abort the engine sequence (the engine does not know about stop strings)."""

    def __init__(self, index: int, *, detokenizer: IncrementalDetokenizer, token_bytes: TokenBytes,
                 stop_strings: tuple[str, ...], chat_parser: ChatOutputParser | None,
                 hidden_token_ids: frozenset[int] = frozenset()) -> None:
        """hidden_token_ids: tokens whose text is never shown (they still count and keep their
        logprobs): an EOS that `ignore_eos` generated past, in chat, where the detokenizer keeps
        special tokens and the parser would end the message at EOS."""
        self.index = index
        self._hidden_token_ids = hidden_token_ids
        self._detokenizer = detokenizer
        self._token_bytes = token_bytes
        self._stop = StopStringMatcher(stop_strings)
        self._parser = chat_parser
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.speculative: SpeculativeStats | None = None
        self.num_tokens = 0
        self.error_message: str | None = None
        # accumulated for non-streaming responses
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[TokenLogprob] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_matched(self) -> bool:
        return self._stop.matched is not None

    def apply(self, event: TokenEvent) -> ChoiceDelta:
        delta = ChoiceDelta(self.index)
        if self.finished:
            return delta
        self.num_tokens += len(event.new_token_ids)
        if event.usage is not None:
            self.usage = event.usage
        if event.logprobs is not None:
            delta.logprobs = self._logprobs(event)
        shown_ids = event.new_token_ids
        if self._hidden_token_ids:
            shown_ids = [token_id for token_id in shown_ids if token_id not in self._hidden_token_ids]
        text = self._stop.feed(self._detokenizer.add(shown_ids))
        if self.stop_matched:
            self._finish(delta, text, FinishReason.STOP.value)
        elif event.finish_reason is not None:
            text += self._stop.feed(self._detokenizer.finish())
            text += self._stop.finish()
            self.speculative = event.speculative
            delta.error_message = event.error_message
            self._finish(delta, text, event.finish_reason.value)
        else:
            self._route(delta, text)
        self._accumulate(delta)
        return delta

    def fail(self, reason: FinishReason, message: str | None = None) -> ChoiceDelta:
        """End the choice without a final engine event (engine error, abort, deadline)."""
        delta = ChoiceDelta(self.index)
        if not self.finished:
            self._finish(delta, "", reason.value)
            delta.error_message = message
            self._accumulate(delta)
        return delta

    def _finish(self, delta: ChoiceDelta, text: str, reason: str) -> None:
        self._route(delta, text)
        if self._parser is not None:
            tail = self._parser.finish()
            delta.text += tail.content
            delta.reasoning += tail.reasoning_content
            delta.tool_calls += tail.tool_calls
            if reason == FinishReason.STOP.value and self._parser.num_tool_calls:
                reason = "tool_calls"
        self.finish_reason = delta.finish_reason = reason

    def _route(self, delta: ChoiceDelta, text: str) -> None:
        if self._parser is None:
            delta.text += text
            return
        parsed = self._parser.feed(text)
        delta.text += parsed.content
        delta.reasoning += parsed.reasoning_content
        delta.tool_calls += parsed.tool_calls

    def _accumulate(self, delta: ChoiceDelta) -> None:
        self.error_message = self.error_message or delta.error_message
        self.text += delta.text
        self.reasoning += delta.reasoning
        self.tool_calls.extend(delta.tool_calls)
        self.logprobs.extend(delta.logprobs)

    def _describe(self, token_id: int) -> tuple[str, bytes]:
        data = self._token_bytes(token_id)
        return data.decode("utf-8", errors="replace"), data

    def _logprobs(self, event: TokenEvent) -> list[TokenLogprob]:
        entries = []
        for position, token_id in enumerate(event.new_token_ids):
            token, data = self._describe(token_id)
            top = ()
            if event.top_logprobs is not None:
                top = tuple((alt.token_id, *self._describe(alt.token_id), alt.logprob) for alt in event.top_logprobs[position])
            entries.append(TokenLogprob(token_id, token, data, event.logprobs[position], top))
        return entries
