"""Command-line surface: every option's --help names its default; --threads and --prefill-threads parsing and defaults."""
import argparse
import os

import pytest

from ddscope.cli import build_parser
from ddscope.util.options import default_threads


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "serve", "train-drafter", "eval-acceptance"])
def test_help_names_every_default(command):
    parser = _subparser(command)
    silent = [a.dest for a in parser._actions
              if a.option_strings and not a.required and a.nargs != 0 and "default" not in (a.help or "")]
    assert silent == []
    help_text = parser.format_help()
    assert "%(default)" not in help_text and "(default: None)" not in help_text


def test_threads_default_keeps_a_cpu_free_and_rejects_bad_values():
    assert default_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
    parser = _subparser("serve")
    assert parser.parse_args([]).threads == default_threads()
    assert parser.parse_args(["--threads", "3"]).threads == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--threads", bad])


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_prefill_threads_are_auto_or_a_positive_integer(command):
    parser, prompt = _subparser(command), ["a prompt"] if command == "generate" else []
    assert parser.parse_args(prompt).prefill_threads is None
    assert parser.parse_args([*prompt, "--prefill-threads", "2"]).prefill_threads == 2
    for bad in ("0", "all", "-2"):
        with pytest.raises(SystemExit):
            parser.parse_args([*prompt, "--prefill-threads", bad])
