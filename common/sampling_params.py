"""Sampling parameters of one request: plain data, shared by router, attention worker and drafter.

No torch here: the router builds these from the HTTP body, the wire layer carries them,
the attention worker's sampler reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler. Defaults are greedy decoding of one sequence.

    temperature 0 means greedy (argmax); top_k None or top_p 1.0 / min_p 0.0 disable those
    filters. seed None means the worker draws a seed; a given seed makes sampling reproducible.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_logprobs: int | None = None  # None: no logprobs; 0: the chosen token's only; k: plus top k
    # (token id, bias) pairs added to the raw logits before penalties, temperature and filters;
    # sorted by token id, each id once, each bias in [-100, 100] (OpenAI's logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0.0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"top_k must be >= 1 or None, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            problems.append(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            problems.append(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.num_logprobs is not None and not 0 <= self.num_logprobs <= 20:
            problems.append(f"num_logprobs must be in [0, 20], got {self.num_logprobs}")
        token_ids = [token_id for token_id, _ in self.logit_bias]
        if token_ids != sorted(set(token_ids)) or any(token_id < 0 for token_id in token_ids):
            problems.append("logit_bias must list distinct non-negative token ids in ascending order")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            problems.append("logit_bias values must be in [-100, 100]")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def to_wire(self) -> dict:
        """A msgpack-friendly dict (tuples become lists)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "num_logprobs": self.num_logprobs,
            "logit_bias": [[token_id, bias] for token_id, bias in self.logit_bias],
        }

    @classmethod
    def from_wire(cls, fields: dict) -> "SamplingParams":
        known = {name for name in cls.__dataclass_fields__}
        unknown = set(fields) - known
        if unknown:
            raise ValueError(f"unknown sampling fields: {sorted(unknown)}")
        values = dict(fields)
        if "stop_token_ids" in values:
            values["stop_token_ids"] = tuple(int(t) for t in values["stop_token_ids"])
        if "logit_bias" in values:
            try:
                values["logit_bias"] = tuple((int(token_id), float(bias)) for token_id, bias in values["logit_bias"])
            except (TypeError, ValueError):
                raise ValueError("logit_bias must be [token id, bias] pairs") from None
        return cls(**values)
