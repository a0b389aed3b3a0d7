"""Constrained decoding: grammars for JSON output and tool calls, and the token masks that enforce them."""
