"""What `moemesh bench serve` sends and when: prompts (random words or a JSONL file) and the
arrival schedule (Poisson, fixed-rate or all at once).

Everything here is deterministic for a given seed, so two runs with the same flags send the
same prompts at the same offsets. Prompt lengths are targets only: the exact count of every
request is the server's `usage.prompt_tokens`, which the client records and the metrics use.
"""

from __future__ import annotations

import enum
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# Common short English words: in large BPE vocabularies (DeepSeek's included) each one with a
# leading space is almost always a single token, so N words is close to N prompt tokens.
WORDS: tuple[str, ...] = tuple(dict.fromkeys(
    """the of and to in is was for on that with as by at from his it an were are which this be
    or has had not but one their its first after new who they two her she been other when there
    all during into school time may years more most only over city some world would where later
    up such used many can state about national out known university united then made three part
    team no game year than under him out them season well water high these work number house
    film war also people age book each while both line way four since like long back family
    name river group area north south east west day night place small large old early near
    home music party class field power town land life road light hand point case form fact
    light head word side end king story line body term table green black white red blue gold
    open close run walk talk read write sing play build grow keep hold move turn give take
    make find tell ask seem feel try leave call good great little own right big long same
    next last few public bad able""".split()
))


class Arrival(enum.Enum):
    POISSON = "poisson"  # exponential gaps: a memoryless stream of independent users
    FIXED = "fixed"  # equal gaps of 1 / rate


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send. Exactly one of `prompt` (text) and `messages` (chat turns) is set;
    the client converts between them when the endpoint needs the other form."""

    prompt: str | None
    messages: tuple[dict, ...] | None
    max_tokens: int
    target_input_len: int | None  # what the workload aimed for; None when the file gave the text

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be set")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


def arrival_offsets_s(num_requests: int, request_rate: float, arrival: Arrival, seed: int) -> list[float]:
    """Send time of each request in seconds after the start; the first is at 0.

    `request_rate` is in requests per second; `math.inf` sends everything at once. Poisson
    gaps are exponential with mean 1 / rate, drawn from their own seeded generator so the
    schedule does not change when the prompt generator draws more or fewer numbers.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    offsets, now_s = [], 0.0
    for index in range(num_requests):
        if index:
            now_s += rng.expovariate(request_rate) if arrival is Arrival.POISSON else 1.0 / request_rate
        offsets.append(now_s)
    return offsets


def sample_length(rng: random.Random, mean_len: int, range_ratio: float) -> int:
    """A length drawn uniformly from [mean * (1 - r), mean * (1 + r)], at least 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, round(mean_len * (1.0 - range_ratio)))
    high = max(low, round(mean_len * (1.0 + range_ratio)))
    return rng.randint(low, high)


class PromptTrimmer:
    """Cuts word prompts to an exact token count with the model's tokenizer.json (optional:
    without it a prompt has one word per target token, which is close for large vocabularies)."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        from tokenizers import Tokenizer  # only when asked for: the default path needs no tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_path))

    def trim(self, text: str, num_tokens: int) -> str:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        if len(encoding.ids) <= num_tokens:
            return text
        return text[: encoding.offsets[num_tokens - 1][1]]


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def random_requests(num_requests: int, *, input_len: int, output_len: int, range_ratio: float, seed: int,
                    trimmer: PromptTrimmer | None = None) -> list[WorkloadRequest]:
    """Prompts of random words, `input_len` tokens on average, each asking for `output_len`
    tokens on average (both spread by `range_ratio`). Every prompt starts differently, so a
    prefix cache cannot serve one request from another's blocks."""
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be >= 1")
    rng = random.Random(f"prompts-{seed}")
    requests = []
    for _ in range(num_requests):
        num_input = sample_length(rng, input_len, range_ratio)
        num_output = sample_length(rng, output_len, range_ratio)
        # a tokenizer may merge or split words: draw spare words, then cut to the exact count
        prompt = random_prompt(rng, num_input + (num_input // 4 + 8 if trimmer else 0))
        if trimmer is not None:
            prompt = trimmer.trim(prompt, num_input)
        requests.append(WorkloadRequest(prompt, None, num_output, num_input))
    return requests


def _parse_line(line: str, line_number: int, default_max_tokens: int) -> WorkloadRequest:
    try:
        item = json.loads(line)
    except ValueError as error:
        raise ValueError(f"line {line_number}: not JSON: {error}") from None
    if not isinstance(item, dict):
        raise ValueError(f"line {line_number}: expected a JSON object")
    max_tokens = item.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"line {line_number}: max_tokens must be a positive integer")
    if isinstance(item.get("prompt"), str):
        return WorkloadRequest(item["prompt"], None, max_tokens, None)
    messages = item.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return WorkloadRequest(None, tuple(messages), max_tokens, None)
    raise ValueError(f"line {line_number}: needs 'prompt' (a string) or 'messages' (a list of objects)")


def file_requests(path: str | Path, num_requests: int, *, default_max_tokens: int) -> list[WorkloadRequest]:
    """The first `num_requests` lines of a JSONL file, cycling when it has fewer lines.

    A line is `{"prompt": str}` or `{"messages": [...]}`, with an optional `max_tokens`
    (`default_max_tokens` otherwise). Blank lines are skipped.
    """
    lines = [(n, line) for n, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no requests in the file")
    items = [_parse_line(line, n, default_max_tokens) for n, line in lines]
    return [items[index % len(items)] for index in range(num_requests)]
