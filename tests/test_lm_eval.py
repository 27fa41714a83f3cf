"""A real client nobody here wrote: lm-eval 0.4.13 (`local-completions`, unchanged) against `ddscope serve`,
with one generate_until task and one loglikelihood task on local data. Its generations equal the engine's
own, and its loglikelihoods (from `echo` + `logprobs`) equal the target's log-probs computed in-process.

lm-eval lives in a cached venv of its own (ddscope.peers.venvs, about 1 GB, a few minutes the first time); under
CI=true a failed install fails the test, elsewhere it skips, saying why.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from ddscope.peers.venvs import InstallFailed, cache_root, ensure_venv, in_ci
from ddscope.server.launch import serve_in_background

LM_EVAL = "lm-eval[api]==0.4.13"
INSTALL_S = 900
# (context, continuation): no context ends in whitespace, so lm-eval's split of the pair is the plain one
DOCS = [("def add(a, b):", " return"), ("The quick brown fox", " jumps"), ("Hello, how are", " you today"),
        ("for i in range(10):", "\n    print(i)")]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_S + 300)]


@pytest.fixture(scope="module")
def lm_eval_python() -> Path:
    try:
        return ensure_venv(cache_root() / "lm-eval-0.4.13", [LM_EVAL, "transformers==5.23.0"], "import lm_eval",
                           timeout_s=INSTALL_S)
    except InstallFailed as e:
        if in_ci():
            pytest.fail(f"CI=true, but lm-eval is not available: {e}", pytrace=False)
        pytest.skip(f"lm-eval is not available here: {e}")


def write_tasks(directory: Path, docs: list[tuple[str, str]]) -> None:
    data = directory / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"q": q, "a": a}) for q, a in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{q}}\"\ndoc_to_target: \"{{a}}\"\n")
    (directory / "ddscope_gen.yaml").write_text(
        f"task: ddscope_gen\n{common}output_type: generate_until\n"
        "generation_kwargs:\n  until: [\"\\n\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    (directory / "ddscope_ll.yaml").write_text(
        f"task: ddscope_ll\n{common}output_type: loglikelihood\nmetric_list:\n  - metric: acc\n")


def samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def loglikelihood(engine, context: str, continuation: str) -> tuple[float, bool]:
    """As lm-eval splits the pair (the whole encoded, the context's tokens cut off), scored in one forward."""
    whole = engine.tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(engine.tokenizer.encode(context, add_special_tokens=False))
    cache = engine.target.new_cache(len(whole))
    lp = engine.target(torch.tensor(whole), torch.arange(len(whole)), cache).logits.float().log_softmax(-1)
    rows, tokens = lp[n - 1:-1], torch.tensor(whole[n:])
    return rows.gather(-1, tokens[:, None]).sum().item(), bool((rows.argmax(-1) == tokens).all())


def greedy_doc(engine) -> tuple[str, str]:
    """A context and the target's own greedy continuation, whose text tokenizes back to the same tokens."""
    for q, _ in DOCS:
        out = engine.generate(q, max_new_tokens=2, method="ar", ignore_eos=True)
        if engine.tokenizer.encode(q + out.text, add_special_tokens=False) == engine.encode(q) + out.token_ids:
            return q, out.text
    raise AssertionError("no greedy continuation of DOCS round-trips through the tokenizer")


def test_lm_eval_generate_until_and_loglikelihood(lm_eval_python, tiny_engine, tiny_pair, tmp_path):
    docs = DOCS + [greedy_doc(tiny_engine)]  # one continuation the target itself would choose: is_greedy
    write_tasks(tmp_path, docs)
    out = tmp_path / "out"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with serve_in_background(engine=tiny_engine) as url:
        args = (f"base_url={url}/v1/completions,model={tiny_engine.model_name},tokenizer={tiny_pair[0]},"
                "tokenizer_backend=huggingface,max_retries=1")
        done = subprocess.run([str(lm_eval_python), "-m", "lm_eval", "--model", "local-completions",
                               "--model_args", args, "--tasks", "ddscope_gen,ddscope_ll", "--include_path",
                               str(tmp_path), "--log_samples", "--output_path", str(out)],
                              capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]

    for sample, (q, _) in zip(samples(out, "ddscope_gen"), docs):
        ours = tiny_engine.generate(q, max_new_tokens=12, method="ddtree", temperature=0,
                                    stop=["\n\n", "<|endoftext|>"])
        assert sample["resps"][0][0] == ours.text
    scored = samples(out, "ddscope_ll")
    assert len(scored) == len(docs)
    for sample, (q, a) in zip(scored, docs):
        value, is_greedy = sample["resps"][0][0]
        expected, expected_greedy = loglikelihood(tiny_engine, q, a)
        assert float(value) == pytest.approx(expected, abs=1e-4)
        assert (is_greedy == "True") == expected_greedy
    assert scored[-1]["resps"][0][0][1] == "True"  # the greedy continuation was seen as greedy
