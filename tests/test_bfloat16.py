"""bf16 as a first-class dtype on CPU: greedy `dflash` and `ddtree` commit greedy `ar`'s tokens in bf16, with
drafts accepted; the projections run on kernels.c's panels (AMX, vdpbf16ps, or bf16 widened to fp32: every
build), whose rows do not depend on how many are computed together; and the CLI serves it."""
import json
from pathlib import Path

import pytest
import torch

from ddscope import Engine
from ddscope.bench.synthetic_models import oracle_engine
from ddscope.cli import main
from ddscope.models import native
from ddscope.models.layers import PanelLinear
from ddscope.models.weights import read_state_dict


@pytest.fixture(scope="module")
def bf16_engine(tiny_pair):
    return Engine.load(*tiny_pair, dtype="bfloat16")


@pytest.fixture(scope="module")
def references(bf16_engine):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, bf16_engine.vocab_size, (n,), generator=g).tolist() for n in (1, 5, 17, 33)]
    return [(p, bf16_engine.generate(p, max_new_tokens=96, method="ar", ignore_eos=True).token_ids) for p in prompts]


def _accepted(out) -> float:
    return out.stats.committed_tokens / out.stats.verify_steps


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 16)])
def test_bf16_speculation_is_token_identical_to_ar(bf16_engine, references, method, budget):
    """A verify's rows get the bits a decode step of their tokens gets (row-invariant projections, norms and
    attention: kernels.c's over the keys each row sees, in order), so greedy speculation in bf16 commits
    exactly `ar`'s tokens, with drafts accepted."""
    oracle = oracle_engine(bf16_engine, accuracy=0.7)
    for prompt, ref in references:
        out = oracle.generate(prompt, max_new_tokens=96, method=method, budget=budget, ignore_eos=True)
        assert _accepted(out) > 1.5, "drafts were hardly accepted: the test lost its power"
        assert out.token_ids == ref


def test_bf16_projections_are_panelled_or_packed_and_row_invariant(bf16_engine):
    target = bf16_engine.target
    attn = target.model.layers[0].self_attn
    weight = read_state_dict(Path(bf16_engine.source))["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16)
    assert native.paneled(weight), native.kernels()  # every build of kernels.c has bf16 products
    assert type(attn.q_proj) is PanelLinear and type(target.model.layers[0].mlp.down_proj) is PanelLinear
    x = torch.randn(9, attn.q_proj.in_features, dtype=torch.bfloat16)
    together = attn.q_proj(x)
    alone = torch.cat([attn.q_proj(x[i:i + 1]) for i in range(9)])
    assert torch.equal(together, alone)
    plain = torch.nn.functional.linear(x, weight)  # the same product, from the checkpoint's own weight
    assert together.dtype == torch.bfloat16 and torch.allclose(together.float(), plain.float(), rtol=2e-2, atol=2e-2)


def test_cli_generates_in_bf16(tiny_pair, capsys):
    target, drafter = tiny_pair
    assert main(["generate", "hello", "--target", str(target), "--drafter", str(drafter), "--dtype", "bfloat16",
                 "--max-tokens", "12", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["completion_tokens"] == 12 and len(out["token_ids"]) == 12
