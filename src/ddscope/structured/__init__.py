"""Structured outputs' own room, beside `speculative/`: the tool-choice types and the tool-call formats
(`tool_parsers/`, one module a format, chosen by name). It imports nothing of the engine or the server: a
parser renders its forced calls as an xgrammar structural tag (plain JSON) and reads text back."""
