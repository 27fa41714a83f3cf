"""Leaves every room may use: atomic file writes, the CLI's shared option parsers, a server in a process of its own."""
