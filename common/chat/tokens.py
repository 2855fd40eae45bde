"""Special-token strings of the DeepSeek-V4 chat encoding.

These are the literal strings the encoder writes into prompts and the output parser looks
for in generated text. The tokenizer maps each of them to one token (they are "added
tokens" in the checkpoint's `tokenizer.json`); a tokenizer built for tests must do the same,
which is why `SPECIAL_TOKENS` lists every one of them.
"""

from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"

# DSML ("DeepSeek markup language") tags are built from this marker: `<｜DSML｜invoke ...>`.
DSML = "｜DSML｜"

# The tool-call block. DeepSeek-V4's published encoding names the block `tool_calls`;
# V3.2 named it `function_calls`. We write `tool_calls` and accept both when parsing.
TOOL_CALLS_BLOCK = "tool_calls"
LEGACY_TOOL_CALLS_BLOCK = "function_calls"
TOOL_CALLS_OPEN = f"<{DSML}{TOOL_CALLS_BLOCK}>"
TOOL_CALLS_CLOSE = f"</{DSML}{TOOL_CALLS_BLOCK}>"
LEGACY_TOOL_CALLS_OPEN = f"<{DSML}{LEGACY_TOOL_CALLS_BLOCK}>"
LEGACY_TOOL_CALLS_CLOSE = f"</{DSML}{LEGACY_TOOL_CALLS_BLOCK}>"
INVOKE_OPEN_PREFIX = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_OPEN_PREFIX = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# Task tokens of DeepSeek's internal quick-instruction tasks. We never emit them, but they
# are part of the vocabulary the encoding defines, so the tokenizer must keep them whole.
TASK_TOKENS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# Every special-token string the encoding uses. The DSML marker is listed on its own:
# the real tokenizer holds `｜DSML｜` as one token inside the tags.
SPECIAL_TOKENS: list[str] = [
    BOS,
    EOS,
    USER,
    ASSISTANT,
    LATEST_REMINDER,
    THINK_START,
    THINK_END,
    DSML,
    *TASK_TOKENS.values(),
]
