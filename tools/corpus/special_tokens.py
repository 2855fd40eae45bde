"""The fixed special-token table of the kjv-dsv4-mini tokenizer.

Ids 0..NUM_SPECIAL_SLOTS-1 are reserved for these tokens, in this order, so they never move
when the BPE part is retrained: BOS 0 and EOS 1 as in DeepSeek, then padding, the chat
markers of `common.chat.tokens`, the drafter's mask token, and unused `<｜reserved_N｜>`
slots that a later encoding can claim without shifting any id. The BPE vocabulary starts
at id NUM_SPECIAL_SLOTS.

`special` is what transformers calls a special token: dropped by
`decode(skip_special_tokens=True)`. `<think>`, `</think>` and `｜DSML｜` are added tokens
that are *not* special (as in DeepSeek's own tokenizer): they are still one id each, but
they stay in decoded text because the chat output parser reads them there.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.common.chat import tokens as chat_tokens

PAD = "<｜▁pad▁｜>"
MASK = "<｜mask｜>"  # DSpark drafter's mask/noise token (docs/speculation.md: `dspark_noise_token_id`)
NUM_SPECIAL_SLOTS = 32


@dataclass(frozen=True)
class SpecialToken:
    token_id: int
    content: str
    special: bool


def _build_table() -> tuple[SpecialToken, ...]:
    named: list[tuple[str, bool]] = [
        (chat_tokens.BOS, True),
        (chat_tokens.EOS, True),
        (PAD, True),
        (chat_tokens.USER, True),
        (chat_tokens.ASSISTANT, True),
        (chat_tokens.THINK_START, False),
        (chat_tokens.THINK_END, False),
        (chat_tokens.DSML, False),
        (chat_tokens.LATEST_REMINDER, True),
        *((task_token, True) for task_token in chat_tokens.TASK_TOKENS.values()),
        (MASK, True),
    ]
    contents = [content for content, _ in named]
    missing = [token for token in chat_tokens.SPECIAL_TOKENS if token not in contents]
    if missing:  # the chat encoding grew a token: give it a slot here (append, never reorder)
        raise RuntimeError(f"special tokens of common.chat.tokens without a fixed id: {missing}")
    if len(named) > NUM_SPECIAL_SLOTS:
        raise RuntimeError(f"{len(named)} special tokens do not fit {NUM_SPECIAL_SLOTS} slots")
    table = [SpecialToken(token_id, content, special) for token_id, (content, special) in enumerate(named)]
    table += [SpecialToken(i, f"<｜reserved_{i}｜>", True) for i in range(len(named), NUM_SPECIAL_SLOTS)]
    return tuple(table)


SPECIAL_TOKEN_TABLE: tuple[SpecialToken, ...] = _build_table()
SPECIAL_TOKEN_IDS: dict[str, int] = {token.content: token.token_id for token in SPECIAL_TOKEN_TABLE}

BOS_ID = SPECIAL_TOKEN_IDS[chat_tokens.BOS]
EOS_ID = SPECIAL_TOKEN_IDS[chat_tokens.EOS]
PAD_ID = SPECIAL_TOKEN_IDS[PAD]
MASK_ID = SPECIAL_TOKEN_IDS[MASK]
