"""kernels.c against torch's ops: the same values (bf16 within a rounding), each row as it is alone, and the
fallbacks when it can't be built."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ddscope.models import kv_pool, layer_call, native, pages
from ddscope.models.layers import RMSNorm, apply_rope, rope
from ddscope.structured.masks import DraftRows, Mask

pytestmark = pytest.mark.skipif(native.library() is None, reason="kernels.c did not build here")
DTYPES = (torch.float32, torch.bfloat16)
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _reference_norm_rope(x, weight, cos, sin, heads, eps):
    x = x.view(x.shape[0], heads, cos.shape[-1])
    if weight is not None:
        norm = RMSNorm(x.shape[-1], eps).to(x.dtype)
        norm.weight.data.copy_(weight)
        with torch.inference_mode(), _torch_ops():
            x = norm(x)
    return apply_rope(x.transpose(0, 1), cos, sin)


class _torch_ops:
    """Inside: layers run torch's ops, as without the library."""

    def __enter__(self):
        self.before = native.serves
        native.serves = lambda *t: False

    def __exit__(self, *exc):
        native.serves = self.before


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
    torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_torch_and_each_row_alone(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(37, 1024).to(dtype), (1 + 0.1 * torch.randn(1024)).to(dtype)
    with torch.inference_mode():
        got = native.rms_norm(x, w, 1e-6)
        norm = RMSNorm(1024, 1e-6).to(dtype)
        norm.weight.data.copy_(w)
        with _torch_ops():
            want = norm(x)
        _close(got, want, dtype)
        assert torch.equal(native.rms_norm(x[5:6], w, 1e-6), got[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normed", [True, False])
def test_norm_rope_matches_torch_and_each_row_alone(dtype, normed):
    torch.manual_seed(1)
    heads, d, n = 4, 64, 9
    x = torch.randn(n, heads * d).to(dtype)
    w = (1 + 0.1 * torch.randn(d)).to(dtype) if normed else None
    cos, sin = rope(torch.arange(100, 100 + n), d, 1e4, dtype)
    with torch.inference_mode():
        got = native.norm_rope(x, w, cos, sin, heads, 1e-6)
        assert got.shape == (heads, n, d)
        _close(got, _reference_norm_rope(x, w, cos, sin, heads, 1e-6), dtype)
        assert torch.equal(native.norm_rope(x[3:4], w, cos[3:4], sin[3:4], heads, 1e-6), got[:, 3:4])


def test_gradients_and_other_devices_take_torch_ops():
    w = torch.ones(8, requires_grad=True)
    assert not native.serves(torch.ones(2, 8), w)
    assert not native.serves(torch.ones(2, 8, dtype=torch.float16))
    assert not native.serves(torch.ones(8, 2).t())
    with torch.no_grad():
        assert native.serves(torch.ones(2, 8), w)


@pytest.mark.parametrize("env", [{"DDSCOPE_NATIVE": "0"}, {"CC": "/bin/false"}])
def test_without_the_library_torch_ops_run(tmp_path, env):
    """Turned off, or a compiler that fails (a fresh cache, so it must build): None, with a warning for the
    failure, and a layer still computes."""
    code = ("import warnings, torch; warnings.simplefilter('always')\n"
            "from ddscope.models import native\nfrom ddscope.models.layers import RMSNorm\n"
            "with warnings.catch_warnings(record=True) as w:\n    lib = native.library()\n"
            "print(lib is None, any('did not build' in str(x.message) for x in w))\n"
            "with torch.inference_mode():\n    print(RMSNorm(8, 1e-6)(torch.ones(2, 8)).sum().item())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "DDSCOPE_CACHE": str(tmp_path), **env}).stdout.split()
    assert out[0] == "True"
    assert out[1] == ("True" if "CC" in env else "False")
    assert float(out[2]) == pytest.approx(16.0, rel=1e-5)


def _panels(dtype: torch.dtype) -> bool:
    """Whether kernels.c's panels serve `dtype` here (every build serves fp32 and bf16)."""
    return native.paneled(torch.ones(128, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_panelled_products_match_torch_and_each_row_alone(dtype, bias):
    """Every row count a step meets (a decode, a batch, a tree, a prefill block and past it): torch's values,
    and each row the same bits as alone."""
    from ddscope.models.layers import PanelLinear

    if not _panels(dtype):
        pytest.skip(f"no panels for {dtype}: kernels.c did not load")
    torch.manual_seed(2)
    linear = torch.nn.Linear(320, 256, bias=bias).to(dtype)
    panelled = PanelLinear(linear)
    with torch.inference_mode():
        for rows in (1, 2, 7, 16, 17, 33, 65, 300):
            x = torch.randn(rows, 320).to(dtype)
            got = panelled(x)
            if dtype == torch.float32:
                torch.testing.assert_close(got, linear(x), atol=2e-5, rtol=1e-5)
            else:  # bf16 products summed in fp32, rounded once: within a bf16 step of the fp32 result
                exact = x.float() @ linear.weight.float().t() + (0 if linear.bias is None else linear.bias.float())
                torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=8e-3)
            for r in {0, rows // 2, rows - 1}:
                assert torch.equal(panelled(x[r:r + 1]), got[r:r + 1])


def test_huge_memory_is_aligned_to_its_pages_and_holds_what_is_written():
    big = pages.huge((1024, 1024), torch.float32)  # 4 MiB
    small = pages.huge((3, 5), torch.bfloat16)
    assert (big.shape, big.dtype, small.shape, small.dtype) == ((1024, 1024), torch.float32, (3, 5), torch.bfloat16)
    if sys.platform == "linux":
        assert big.data_ptr() % pages.HUGE_PAGE == 0
    values = torch.randn(1024, 1024)
    big.copy_(values)
    torch.randn(4096, 1024).fill_(7)  # memory allocated and freed after it is not the tensor's
    assert torch.equal(big, values)


def _huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not os.path.exists(THP) or "[never]" in open(THP).read(), reason="Linux's THP, not off")
def test_huge_memory_is_on_huge_pages_after_freed_memory_was_kept():
    """Weights loaded after an engine kept its freed memory still get 2 MiB pages: heap memory already touched
    stays in 4 KiB ones (12 of 64 MB were huge when `huge` took it from the heap)."""
    assert pages.keep_freed()
    for _ in range(3):
        touched = [torch.ones(8 << 20) for _ in range(4)]  # 128 MB of activations, touched, then freed
        del touched
    weights = pages.huge((4096, 4096), torch.float32)
    weights.fill_(1)
    assert _huge_kb(weights.data_ptr()) >= 32 << 10  # of 64 MB


@pytest.mark.skipif(not os.path.exists(THP) or "[never]" in open(THP).read(), reason="Linux's THP, not off")
def test_the_kv_pool_is_zeroed_on_huge_pages():
    """The KV pool's storage, zeroed at load, lies on 2 MiB pages: a decode step streams a long context whole."""
    storage = kv_pool.zeroed((4, 2, 4096, 256), "cpu", torch.float32)  # 32 MB
    assert storage.shape == (4, 2, 4096, 256) and not storage.any()
    assert _huge_kb(storage.data_ptr()) >= 16 << 10


def test_panels_serve_only_weights_of_whole_panels():
    assert native.paneled(torch.ones(256, 64))
    assert not native.paneled(torch.ones(200, 64))
    assert native.paneled(torch.ones(96, 64, dtype=torch.bfloat16)) and native.bf16_products() != "none"
    assert not native.paneled(torch.ones(96, 48, dtype=torch.bfloat16))  # k in blocks of 32
    assert not native.paneled(torch.ones(80, 64, dtype=torch.bfloat16))  # outputs in pairs of 16-wide panels
    assert not native.paneled(torch.ones(256, 64, dtype=torch.float16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,keys,d", [(4, 2, 1, 64), (4, 2, 300, 64), (8, 1, 77, 64), (2, 2, 4096, 64),
                                                   (4, 2, 300, 80)])
def test_decode_attention_matches_sdpa(dtype, heads, kv_heads, keys, d):
    """One row over every key, grouped heads included, on K/V heads that sit apart in a larger cache, the row
    one of a batch's (its heads apart by the batch's rows); a head_dim of an odd count of 16s, whose last 16
    a bf16 step reads alone."""
    torch.manual_seed(3)
    q = torch.randn(heads, 3, d).to(dtype)[:, 1:2]
    cache = torch.randn(2, kv_heads, keys + 50, d).to(dtype)
    k, v = cache[0, :, :keys], cache[1, :, :keys]
    with torch.inference_mode():
        assert native.attends(q, k, v, None)
        got = native.attend(q, k, v)
        want = torch.nn.functional.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None],
                                                                enable_gqa=True)[0]
    _close(got, want.transpose(0, 1).reshape(1, -1), dtype)


def _tree_mask(n: int, keys: int, seed: int) -> torch.Tensor:
    """A tree's mask over a context and its n nodes: every context key, its ancestors (a random parent
    earlier in the order) and itself."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, keys, dtype=torch.bool)
    mask[:, :keys - n] = True
    for i in range(n):
        parent = int(torch.randint(0, i, (1,), generator=g)) if i else None
        if parent is not None:
            mask[i, keys - n:] = mask[parent, keys - n:]
        mask[i, keys - n + i] = True
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d,n,keys", [(4, 2, 64, 16, 700), (8, 1, 128, 33, 300), (4, 4, 256, 9, 50),
                                                      (4, 2, 256, 65, 1100), (2, 1, 48, 7, 90)])
def test_tree_attention_matches_sdpa_and_each_row_is_a_decode_step(dtype, heads, kv_heads, d, n, keys):
    """A tree's rows under its ancestor mask: SDPA's values, and each row bitwise what one row alone gets
    over just the keys it sees (a decode step of its token), so a verify changes no bit of a greedy run."""
    torch.manual_seed(5)
    q = torch.randn(heads, n, d).to(dtype)
    k, v = torch.randn(kv_heads, keys, d).to(dtype), torch.randn(kv_heads, keys, d).to(dtype)
    mask = _tree_mask(n, keys, seed=n)
    with torch.inference_mode():
        assert native.attends(q, k, v, mask)
        got = native.attend(q, k, v, mask)
        want = torch.nn.functional.scaled_dot_product_attention(q.float()[None], k.float()[None], v.float()[None],
                                                                attn_mask=mask, enable_gqa=True)[0]
        _close(got, want.transpose(0, 1).reshape(n, -1), dtype)
        for r in range(n):
            seen = mask[r].nonzero().flatten()
            alone = native.attend(q[:, r:r + 1].contiguous(), k[:, seen].contiguous(), v[:, seen].contiguous())
            assert torch.equal(got[r:r + 1], alone), f"row {r}"


@pytest.mark.parametrize("heads,kv_heads,d,n,keys", [(4, 2, 256, 33, 1057), (8, 1, 128, 65, 300), (2, 2, 64, 9, 40),
                                                      (4, 2, 64, 128, 130), (4, 2, 64, 3, 5557)])
def test_tree_products_match_sdpa_and_give_a_row_its_bits_whatever_rows_are_beside_it(heads, kv_heads, d, n, keys):
    """fp32 trees on `tree_attend`: units of vectors split across lanes, panels and threads, keys past a block
    of either pass, rows hidden from keys past the context; a row alone under its own mask gets the same bits."""
    torch.manual_seed(6)
    q = torch.randn(heads, n, d)
    k, v = torch.randn(kv_heads, keys + 7, d)[:, :keys], torch.randn(kv_heads, keys + 7, d)[:, :keys]  # a cache's
    mask = _tree_mask(n, keys, seed=n)
    with torch.inference_mode():
        assert native.attends(q, k, v, mask) and native.tree_rows(torch.float32, heads, kv_heads, d)
        got = native.tree_attend(q, k, v, mask)
        want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                                enable_gqa=True)[0]
        _close(got, want.transpose(0, 1).reshape(n, -1), torch.float32)
        for r in {0, n // 2, n - 1}:
            alone = native.tree_attend(q[:, r:r + 1].contiguous(), k, v, mask[r:r + 1].contiguous())
            assert torch.equal(got[r:r + 1], alone), f"row {r}"
    assert not native.tree_rows(torch.bfloat16, heads, kv_heads, d)  # bf16: `attend`, a decode's bits
    assert not native.tree_rows(torch.float32, 4, 2, 80)


@pytest.mark.parametrize("heads,kv_heads,d,n,prefix", [(4, 2, 256, 300, 0), (8, 1, 128, 97, 45), (2, 2, 64, 41, 0),
                                                        (6, 2, 64, 130, 2100)])
def test_causal_rows_match_sdpa_and_get_a_tree_rows_bits_whatever_the_chunks(heads, kv_heads, d, n, prefix):
    """A prefill's rows (after a prefix, or none) in units of whole rows, the longest first over both threads:
    SDPA's values, and each row the bits `tree_attend` gives it over its keys, so a prompt's K/V are the same
    bits prefilled at once, in chunks or after a cached prefix."""
    torch.manual_seed(7)
    S = prefix + n
    q = torch.randn(heads, n, d)
    k, v = torch.randn(kv_heads, S + 5, d)[:, :S], torch.randn(kv_heads, S + 5, d)[:, :S]  # a cache's views
    mask = torch.ones(n, S, dtype=torch.bool).tril(prefix)
    with torch.inference_mode():
        assert native.causal_rows(q, k, v)
        got = native.causal_attend(q, k, v)
        want = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                                enable_gqa=True)[0]
        _close(got, want.transpose(0, 1).reshape(n, -1), torch.float32)
        cut = n // 3  # the same rows as two chunks, the second after the first's keys
        first = native.causal_attend(q[:, :cut].contiguous(), k[:, :prefix + cut], v[:, :prefix + cut])
        second = native.causal_attend(q[:, cut:].contiguous(), k, v)
        assert torch.equal(torch.cat([first, second]), got)
        rows = slice(n - 5, n)
        tree = native.tree_attend(q[:, rows].contiguous(), k, v, mask[rows].contiguous())
        assert torch.equal(tree, got[rows])
    assert not native.causal_rows(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert not native.causal_rows(q.requires_grad_(), k, v)
    assert not native.causal_rows(torch.randn(4, n, 80), torch.randn(2, S, 80), torch.randn(2, S, 80))


def test_attention_takes_torch_ops_where_kernels_c_cannot():
    q, k = torch.randn(4, 3, 64), torch.randn(2, 10, 64)
    assert not native.attends(q, k, k, torch.zeros(3, 10))  # an additive bias
    assert not native.attends(q, k, k, torch.ones(3, 9, dtype=torch.bool))  # a mask of other keys
    assert not native.attends(torch.randn(4, native.MAX_ROWS + 1, 64), k, k, None)  # a prefill's rows
    assert not native.attends(torch.randn(4, 1, 24), torch.randn(2, 10, 24), torch.randn(2, 10, 24), None)
    assert not native.attends(torch.randn(4, 3, 64).transpose(1, 2).transpose(1, 2)[:, ::2], k, k, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch(dtype):
    """Lengths past a whole vector and far tails of the sigmoid included."""
    torch.manual_seed(4)
    gate, up = (torch.randn(5, 2051) * 8).to(dtype), torch.randn(5, 2051).to(dtype)
    with torch.inference_mode():
        assert native.gates(gate, up)
        _close(native.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,pages", [("qwen3", None), ("llama", None), ("qwen3", [4, 0, 3, 1, 2])])
def test_rows_in_kernels_are_the_modules_bits(tmp_path, arch, pages, dtype):
    """Decode steps' rows, then a tree's rows under its mask, through each layer in kernels.c (one call a layer
    on a cache whose slots lie in a run, which stores the K/V itself; a decode row in two calls around the
    cache's write on a paged table out of order, a tree in the modules) give the logits, captured features
    and K/V the modules give one by one."""
    from ddscope.bench.synthetic_models import make_target
    from ddscope.models.kv_pool import KVPool, Pages
    from ddscope.models.target import Target

    if not (layer_call.decodes(dtype) and _panels(dtype)):
        pytest.skip(f"no decode calls for {dtype}: kernels.c did not load")
    target = Target.load(make_target(tmp_path / arch, arch, hidden=256, layers=3), torch.device("cpu"), dtype)
    prompt, new, tree = torch.randint(4, 200, (50,)), torch.randint(4, 200, (6,)), torch.randint(4, 200, (9,))
    mask = _tree_mask(9, 65, seed=9)
    depth = mask[:, 56:].sum(1) - 1  # a node's position: its parent's plus one
    in_c = []

    def cache():
        if pages is None:
            return target.new_cache(80)
        table = Pages(block=16)
        table.extend(pages)
        return KVPool(target.cfg.geometry, None, 0, len(pages), torch.device("cpu"), dtype, 16).target_cache(table)

    def forward(fused: bool):
        before = target._in_c
        target._in_c = (lambda *args: in_c.append(before(*args)) or in_c[-1]) if fused else (lambda *args: None)
        try:
            with torch.inference_mode():
                c = cache()
                target(prompt, torch.arange(50), c)
                outs = [target(new[i:i + 1], torch.arange(50 + i, 51 + i), c, capture=(0, 2)) for i in range(6)]
                outs.append(target(tree, 56 + depth, c, mask=mask, capture=(0, 2)))
        finally:
            target._in_c = before
        return outs, c

    (fused, a), (plain, b) = forward(True), forward(False)
    assert target._fused, "every layer should take the kernels' calls: the test lost its power"
    assert all(x is not None for x in in_c[1:7]) and (in_c[7] is not None) == (pages is None)
    assert (a.run() is None) == (pages is not None)
    assert all(torch.equal(x.logits, y.logits) and torch.equal(x.features, y.features) for x, y in zip(fused, plain))
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("vocab,density", [(8192, 0.02), (1000, 0.3), (50257, 0.002), (64, 1.0)])
def test_a_small_legal_set_s_likeliest_tokens_are_its_numpy_twin_s(vocab, density):
    """`legal_top_f32` (a grammar's node: its legal set's k best by the drafter, renormalised) against
    `Mask.scanned`, numpy's: the same tokens in the same order (ties: the lower id first), -inf left out, on a
    vocabulary whose last word is partial too."""
    seeded = torch.Generator().manual_seed(vocab)
    legal = torch.rand(vocab, generator=seeded) < density
    logp = (3 * torch.randn(4, vocab, generator=seeded)).log_softmax(-1)
    logp[1, ::7] = float("-inf")  # the drafter's law cut these
    logp[2] = logp[2].round()  # ties
    words = torch.zeros((vocab + 31) // 32 * 32, dtype=torch.bool)
    words[:vocab] = legal
    bits = (words.view(-1, 32).long() << torch.arange(32)).sum(-1).to(torch.int64)
    key = bits.to(torch.int32, copy=True).numpy().astype("<u4").tobytes()
    mask, draft = Mask(key, vocab), DraftRows(logp, 24)
    assert mask.count == int(legal.sum()) and (mask.legal == legal.numpy()).all()
    for depth in range(4):
        for k in (0, 1, 8, 24):
            got_vals, got_ids = draft.legal_top(key, vocab, depth, k)
            want_vals, want_ids = mask.scanned(draft.logp[depth], k)
            assert got_ids == want_ids and got_vals == pytest.approx(want_vals, abs=1e-5)
