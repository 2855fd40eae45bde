"""Configuration of the HTTP gateway (one frozen object, built once in main())."""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.services.router.prompt_tokens import PromptTokens

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_JSON_DEPTH = 64
DEFAULT_MAX_CONCURRENT_TOKENIZATIONS = 2


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
    max_num_prompts: int = 256  # prompts in one /v1/completions request
    default_temperature: float = 1.0
    default_thinking: bool = False
    keep_alive_interval_s: float = 5.0
    request_timeout_s: float | None = None  # deadline per request; None: no deadline
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies: 413, refused before reading them
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH  # deeper nesting: 400, found before parsing
    max_concurrent_tokenizations: int = DEFAULT_MAX_CONCURRENT_TOKENIZATIONS  # worker threads parsing / tokenizing
    num_chars_tokenized_inline: int = 4096  # longer prompts are tokenized in a worker thread
    num_bytes_parsed_inline: int = 256 * 1024  # larger bodies are parsed in a worker thread
    prompt_tokens: PromptTokens | None = None  # None: from the tokenizer's post-processor (prompt_tokens.py)
    retry_after_draining_s: int = 5  # Retry-After of the 503 answered while the server stops

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.keep_alive_interval_s <= 0:
            raise ValueError("keep_alive_interval_s must be > 0")
        if self.max_num_choices < 1:
            raise ValueError("max_num_choices must be >= 1")
        if self.max_body_bytes < 1024 or not 2 <= self.max_json_depth <= 512 or self.max_concurrent_tokenizations < 1:
            raise ValueError("max_body_bytes must be >= 1024, max_json_depth in [2, 512] (Python's own JSON "
                             "recursion stays below its limit), max_concurrent_tokenizations >= 1")

    def serves(self, model: str | None) -> bool:
        return model is None or model == self.model_name or model in self.model_aliases
