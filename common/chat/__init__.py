"""DeepSeek-V4 chat encoding and output parsing (torch-free; shared by router, CLI, tools)."""

from moemesh.common.chat.encoding import ChatEncodingError, content_text, encode_messages
from moemesh.common.chat.parser import ChatOutputParser, Delta, ToolCall
from moemesh.common.chat.tokens import SPECIAL_TOKENS

__all__ = [
    "SPECIAL_TOKENS",
    "ChatEncodingError",
    "ChatOutputParser",
    "Delta",
    "ToolCall",
    "content_text",
    "encode_messages",
]
