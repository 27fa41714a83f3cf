"""What a request's tools ask of the output, as a tagged union: the mode is the tag, so a tool literally named
`auto` or `required` is only ever a name (OpenAI sends it as {"type": "function", "function": {"name": ...}})."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["none", "auto", "required", "named"]
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """`none`: calls are neither asked for nor read; `auto`: free text a parser reads; `required`: at least one
    call of any tool; `named`: one call of `name`."""
    mode: Mode
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool choice, and only it, carries a name")

    @classmethod
    def named(cls, name: str) -> ToolChoice:
        return cls("named", name)

    @property
    def forced(self) -> bool:
        """The output is calls only, under a grammar."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name and the JSON schema of its arguments."""
    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))


def call_id() -> str:
    """vLLM's tool-call id: `chatcmpl-tool-` and 16 hex digits (renderers/chat_utils/tool_call.py:27-32)."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
