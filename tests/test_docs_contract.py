"""The docs a user reads say what the code does: every `ddscope serve` flag is in docs/server.md's table,
every request field is listed there as honoured, refused or ignored, and the README's bundled target path
for `train-drafter --target` exists."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from ddscope.server import cli
from ddscope.server.schemas import IGNORED, REFUSED, ChatCompletionRequest, CompletionRequest, StreamOptions

ROOT = Path(__file__).resolve().parents[1]
SERVER_MD = (ROOT / "docs" / "server.md").read_text()


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end >= 0 else None]


def test_every_serve_flag_is_in_the_flags_table():
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values())
    flags = {o for a in serve._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    table = SERVER_MD[:SERVER_MD.index("## ")]  # the flags table opens the page
    missing = sorted(f for f in flags if f"`{f}" not in table)
    assert not missing, f"docs/server.md's flags table lacks {missing}"


def test_every_request_field_is_listed_as_honoured_refused_or_ignored():
    """Each row of the table names exactly its class of fields: the schema's, REFUSED and IGNORED."""
    listed = section(SERVER_MD, "### Every request field")
    rows = {line.split("|")[1].strip().split()[0]: set(re.findall(r"`([\w.]+)`", line.split("|")[2]))
            for line in listed.splitlines() if line.startswith("| ") and line.split("|")[1].strip()}
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    fields = (fields - {"stream_options"}) | {f"stream_options.{f}" for f in StreamOptions.model_fields}
    assert rows["honoured"] == fields, f"honoured, not in the schema: {rows['honoured'] - fields}; " \
                                       f"in the schema, not listed: {fields - rows['honoured']}"
    assert rows["refused"] == set(REFUSED), rows["refused"] ^ set(REFUSED)
    assert rows["accepted"] == set(IGNORED), rows["accepted"] ^ set(IGNORED)


def test_the_readmes_train_drafter_target_path_exists():
    readme = (ROOT / "README.md").read_text()
    paths = re.findall(r"ddscope train-drafter --target (\S+)", readme)
    assert any((ROOT / p / "config.json").is_file() for p in paths), paths
