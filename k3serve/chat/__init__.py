"""K3 chat program: prompt renderer (messages -> token ids) and output parsers (text -> reasoning,
content, tool calls). The exact token format is documented in docs/chat-format.md."""

from k3serve.chat.parsers import (
    DeltaToolCall,
    ParsedDelta,
    ParsedOutput,
    StreamingParser,
    ToolCall,
    parse_output,
)
from k3serve.chat.reasoning import count_reasoning_tokens, is_reasoning_end
from k3serve.chat.renderer import RenderedPrompt, render_chat, resolve_thinking

__all__ = [
    "DeltaToolCall",
    "ParsedDelta",
    "ParsedOutput",
    "RenderedPrompt",
    "StreamingParser",
    "ToolCall",
    "count_reasoning_tokens",
    "is_reasoning_end",
    "parse_output",
    "render_chat",
    "resolve_thinking",
]
