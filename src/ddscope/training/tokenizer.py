"""Train the demo pair's byte-level BPE tokenizer and save it in Hugging Face layout.

    python -m ddscope.training.tokenizer --out runs/demo/tokenizer
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ddscope.training.corpus import EOS_TOKEN, SPECIAL_TOKENS, sample_texts

VOCAB_SIZE = 8192
# Same string as corpus.render_chatml produces; HF applies it via apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Characters per domain in the training sample (~26 MB; about a minute on two cores).
DEFAULT_SAMPLE_CHARS = {"code": 9_000_000, "docs": 7_000_000, "chat": 10_000_000}


def train_bpe(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE; special tokens get ids 0..3 in SPECIAL_TOKENS order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_hf(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """HF wrapper: <|endoftext|> doubles as bos/eos/pad; ChatML chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        chat_template=CHAT_TEMPLATE,
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )


def build_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    hf = wrap_hf(train_bpe(texts, vocab_size))
    hf.save_pretrained(out_dir)
    return hf


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m ddscope.training.tokenizer",
        description="Train the demo byte-level BPE tokenizer on a sample of the offline corpus "
                    "(stdlib code, Python docs, ShareGPT chat) and save it in HF layout.")
    p.add_argument("--out", type=Path, required=True, help="output folder (tokenizer.json etc.)")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="total vocab incl. specials")
    p.add_argument("--sample-mb", type=float, default=None,
                   help="total sample size in MB of text, split like the default "
                        f"{ {k: v // 1_000_000 for k, v in DEFAULT_SAMPLE_CHARS.items()} } MB")
    args = p.parse_args(argv)

    budget = dict(DEFAULT_SAMPLE_CHARS)
    if args.sample_mb:
        scale = args.sample_mb * 1e6 / sum(budget.values())
        budget = {k: int(v * scale) for k, v in budget.items()}
    start = time.time()
    hf = build_tokenizer(sample_texts(budget), args.out, args.vocab_size)
    ids = {t: hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    print(f"tokenizer: vocab={len(hf)} specials={ids} -> {args.out} ({time.time() - start:.0f}s)")


if __name__ == "__main__":
    main()
