"""Synthetic models for measuring an engine without trained weights: random checkpoints of a chosen shape on disk
(no hub, seconds to build) and an oracle drafter whose acceptance is chosen. Nothing in `ddscope bench` uses them:
the tests' fixtures and the benchmarks that time an engine do (docs/engine-api.md, Test fixtures)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM)

from ddscope.config import DrafterConfig
from ddscope.engine import Engine
from ddscope.models.drafter import Draft, Drafter
from ddscope.models.drafter_ckpt import drafter_config, pick_layer_ids, save_drafter
from ddscope.models.target import Target

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
_CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. ",
           "Distributed systems require careful reasoning about consistency and failure. ",
           "for i in range(10):\n    print(i * i)\n", "Hello, how are you today? I am fine, thanks!"]


def save_tiny_tokenizer(directory: Path, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return fast


def make_target(directory: Path, arch: str = "qwen3", seed: int = 0, hidden: int = 64, layers: int = 4,
                vocab_size: int | None = None, max_len: int = 2048, init_std: float = 0.2) -> Path:
    """A random Qwen3, Llama or DeepSeek-V3 (MoE + MLA attention) checkpoint in HF layout, with a tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tok = save_tiny_tokenizer(directory)
    geometry = dict(vocab_size=vocab_size or len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                    max_position_embeddings=max_len, initializer_range=init_std, eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id,
                    tie_word_embeddings=arch == "qwen3")
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**geometry, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**geometry, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    elif arch == "deepseek_v3":  # no native path: served through transformers (ddscope.models.hf_target)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(
            **{**geometry, "num_key_value_heads": 4, "head_dim": 8}, moe_intermediate_size=hidden // 2,
            first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=hidden // 4, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model.save_pretrained(str(directory))
    return directory


def make_drafter(directory: Path, target_dir: Path, seed: int = 1, layers: int = 1, block_size: int = 8,
                 nested_block_size: bool = False, prefix: str = "", sliding_window: int | None = None) -> Path:
    tcfg = json.loads((target_dir / "config.json").read_text())
    mask_id = PreTrainedTokenizerFast.from_pretrained(str(target_dir)).convert_tokens_to_ids("<|mask|>")
    ids = pick_layer_ids(tcfg["num_hidden_layers"], layers)
    cfg = drafter_config(tcfg, layers, block_size, mask_id, ids, nested_block_size, sliding_window=sliding_window)
    torch.manual_seed(seed)
    model = Drafter(DrafterConfig.from_dict(cfg))
    return save_drafter(directory, cfg, model.state_dict(), prefix)


def make_tiny_pair(directory: Path, arch: str = "qwen3", block_size: int = 8) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of a tiny random pair, for tests of every layer above the engine."""
    directory = Path(directory)
    target = make_target(directory / f"{arch}-target", arch)
    return target, make_drafter(directory / f"{arch}-drafter", target, block_size=block_size)


class OracleDrafter:
    """A drafter with controlled acceptance, for tests: its logits at each depth of the block are the
    target's own (sharpened), along the target's greedy continuation of the committed prefix. So at T=0
    every draft token is accepted, and under sampling the tree holds the target's likeliest tokens. With
    `accuracy` below 1, each depth's two best tokens are swapped with probability 1 - accuracy: the top-1
    is right that often (a tree can still find the target's choice among the siblings).

    The real drafter still drafts each block (its logits unused), so its context cache is exercised as
    in real runs. The continuation is read off each sequence's own target cache, which holds the committed
    prefix up to the block start; the slots written past it are overwritten by the verify.
    """

    def __init__(self, drafter: Drafter, target: Target, accuracy: float = 1.0, seed: int = 0):
        self.drafter, self.target = drafter, target
        self.accuracy, self.rng = accuracy, random.Random(seed)

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    @torch.inference_mode()
    def draft_many(self, target: Target, drafts: list[Draft]) -> list[torch.Tensor]:
        self.drafter.draft_many(target, drafts)
        out = []
        for d in drafts:
            logits = self._greedy_path(d.root, d.start, d.target_cache)
            for row in logits:
                if self.rng.random() >= self.accuracy:
                    top2 = row.topk(2).indices
                    row[top2] = row[top2.flip(0)]
            out.append(logits)
        return out

    def _greedy_path(self, token: int, start: int, cache) -> torch.Tensor:
        """[block_size - 1, vocab]: the target's logits for positions start+1 .. as it decodes greedily."""
        dev = self.target.lm_head.weight.device
        rows = []
        for pos in range(start, start + self.drafter.block_size - 1):
            out = self.target(torch.tensor([token], device=dev), torch.tensor([pos], device=dev), cache)
            rows.append(out.logits[0] * 3)  # sharpened: a confident drafter, so best-first trees go deep
            token = int(rows[-1].argmax())
        cache.length = start
        return torch.stack(rows)


def oracle_engine(engine: Engine, accuracy: float = 1.0, seed: int = 0, max_model_len: int | None = None,
                  **engine_kw) -> Engine:
    """Another engine over `engine`'s target and drafter (weights shared, caches its own) that drafts with
    an OracleDrafter: accuracy 1.0 is accepted in full at T=0, 0.5 about half the time per token."""
    oracle = Engine(engine.target, engine.drafter, engine.tokenizer, Path(engine.source), engine.config,
                    max_model_len=max_model_len or engine.max_model_len, **engine_kw)
    oracle.drafter = oracle.runner.drafter = OracleDrafter(engine.drafter, oracle.target, accuracy, seed)
    return oracle
