"""Configuration of the HTTP gateway (one frozen object, built once in main())."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    """`max_model_len` bounds prompt + completion tokens; `eos_token_ids` are added to each
    request's stop ids (the engine also knows them; this keeps the gateway honest when it
    reports finish_reason "stop")."""

    model_name: str
    max_model_len: int
    model_aliases: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    default_max_tokens: int | None = None  # None: up to the context length
    max_num_choices: int = 16
    default_temperature: float = 1.0
    default_thinking: bool = False
    keep_alive_interval_s: float = 5.0
    request_timeout_s: float | None = None  # deadline per request; None: no deadline
    max_body_bytes: int = 32 * 1024 * 1024
    num_chars_tokenized_inline: int = 4096  # longer prompts are tokenized in a worker thread

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.keep_alive_interval_s <= 0:
            raise ValueError("keep_alive_interval_s must be > 0")
        if self.max_num_choices < 1:
            raise ValueError("max_num_choices must be >= 1")

    def serves(self, model: str | None) -> bool:
        return model is None or model == self.model_name or model in self.model_aliases
