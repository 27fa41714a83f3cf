"""Structured outputs' own room, beside `speculative/`: constraints and tool choices, the grammar backends behind
one interface (xgrammar, llguidance; `backend.BACKENDS`), the compiler that picks one per constraint, the tree
walk, and the tool-call formats (`tool_parsers/`). It imports nothing of the engine or the server."""
