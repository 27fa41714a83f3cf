"""The prefix cache is the pool's block index: whole blocks of committed tokens, shared by reference, found
by a key that stands for their whole prefix, kept while free until the pool needs them."""
from __future__ import annotations

from ddscope.engine.block_manager import BlockManager, block_key
from ddscope.models.kv_pool import BLOCK, Pages


def _held(manager: BlockManager, tokens: list[int], length: int, features_from: int | None = 0,
          features_to: int | None = None) -> Pages:
    """Pages that computed `length` positions of `tokens` and registered them."""
    pages = Pages()
    manager.grow(pages, len(tokens) + 1)
    manager.register(pages, tokens, length, None if features_from is None else (features_from, features_to))
    return pages


def test_a_prompt_head_is_shared_block_for_block_and_diverging_blocks_are_not():
    m = BlockManager(16)
    tokens = list(range(3 * BLOCK + 10))
    first = _held(m, tokens, 2 * BLOCK + 5)  # two whole blocks are final
    other = tokens[:BLOCK + 3] + [9999] + tokens[BLOCK + 4:]  # diverges inside the second block
    a, b = Pages(), Pages()
    assert m.match(a, other, 0) == BLOCK and a.table == first.table[:1]
    assert m.match(b, tokens, 0) == 2 * BLOCK and b.table == first.table[:2]
    assert m.refs[first.table[0]] == 3 and m.refs[first.table[1]] == 2  # shared, not copied


def test_one_token_is_always_left_to_prefill():
    m = BlockManager(16)
    tokens = list(range(2 * BLOCK))
    _held(m, tokens + [1], 2 * BLOCK)
    assert m.match(Pages(), tokens, 0) == BLOCK  # the last block would leave nothing


def test_target_only_blocks_serve_ar_not_a_drafter():
    m = BlockManager(16)
    tokens = list(range(2 * BLOCK + 1))
    plain = _held(m, tokens, 2 * BLOCK, None)  # an `ar` request: no drafter features
    assert m.match(Pages(), tokens, 0) == 0  # a drafter reading from position 0 needs them
    assert m.match(Pages(), tokens, BLOCK) == BLOCK  # one reading from the second block: the first serves
    assert m.match(Pages(), tokens, None) == 2 * BLOCK
    m.release(plain)
    drafted = _held(m, tokens, 2 * BLOCK)  # now with the drafter's
    assert m.match(Pages(), tokens, 0) == 2 * BLOCK and m.index[block_key(b"", tokens[:BLOCK])] == drafted.table[0]


def test_blocks_past_a_pause_of_the_features_serve_ar_not_a_drafter():
    """`auto` paused the drafter's features inside the third block: the two before it hold them, the third and
    fourth (their K/V final) are the target's only, as an `ar` request's."""
    m = BlockManager(16)
    tokens = list(range(4 * BLOCK + 1))
    _held(m, tokens, 4 * BLOCK, 0, 2 * BLOCK + 3)
    assert m.match(Pages(), tokens, 0) == 2 * BLOCK
    assert m.match(Pages(), tokens, None) == 4 * BLOCK


def test_freed_blocks_stay_cached_until_needed_least_recently_freed_first():
    m = BlockManager(4)
    a, b = list(range(BLOCK + 1)), list(range(1000, 1000 + BLOCK + 1))
    m.release(_held(m, a, BLOCK))
    m.release(_held(m, b, BLOCK))
    assert m.free == 4 and len(m.cached) == 2
    m.grow(Pages(), 3 * BLOCK)  # two empty blocks, then the least recently freed cached one (a's)
    assert m.match(Pages(), a, 0) == 0 and m.match(Pages(), b, 0) == BLOCK


def test_a_pool_without_room_gives_nothing():
    m = BlockManager(2)
    pages = Pages()
    try:
        m.grow(pages, 3 * BLOCK)
    except RuntimeError as e:
        assert "3 blocks needed, 2 free" in str(e)
    assert pages.table == [] and m.free == 2


def test_keys_are_exact_over_the_whole_prefix():
    """Equal blocks after different heads are different blocks: the key covers every earlier token."""
    x = list(range(BLOCK))
    assert block_key(block_key(b"", [1] * BLOCK), x) != block_key(block_key(b"", [2] * BLOCK), x)
    assert block_key(b"", x) == block_key(b"", list(x))


def test_engine_outputs_are_the_same_with_and_without_the_cache():
    """Demo pair, drafts really accepted: a repeated prompt and one sharing its head are served from the
    cache, and every method's output equals a cache-less engine's."""
    from ddscope.bench.running.workloads import fit_ids, load_workload
    from ddscope.engine import Engine

    cached, plain = Engine.load(), Engine.load(prefix_cache=False)
    head = fit_ids(load_workload("padding"), 0, 700, cached.tokenizer)
    # `other` shares 10 whole blocks; its first draft reads none of the two that `head` saved without features
    other = head[:640] + cached.encode(" Something else entirely, then continue:")
    for method, budget in (("dflash", None), ("ddtree", 32), ("ar", None)):
        for prompt in (head, head, other):
            got = cached.generate(prompt, max_new_tokens=48, method=method, budget=budget, ignore_eos=True)
            want = plain.generate(prompt, max_new_tokens=48, method=method, budget=budget, ignore_eos=True)
            assert got.token_ids == want.token_ids, (method, len(prompt))
            assert want.stats.cached_tokens == 0
            if method != "ar":
                assert got.stats.to_dict()["avg_commit"] > 1.5  # drafts were accepted
        assert got.stats.cached_tokens == 640
    assert cached.generate(head, max_new_tokens=4, method="ar").stats.cached_tokens == 640


def test_server_reports_cached_tokens_in_usage_and_metrics():
    import httpx

    from ddscope.bench.running.workloads import fit_ids, load_workload
    from ddscope.engine import Engine
    from ddscope.server.launch import serve_in_background

    engine = Engine.load()
    prompt = fit_ids(load_workload("padding"), 0, 300, engine.tokenizer)
    with serve_in_background(engine=engine, method="dflash") as url, httpx.Client(timeout=120) as client:
        usages = [client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
                  .json()["usage"] for _ in range(2)]
        metrics = client.get(f"{url}/metrics").text
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 256]
    assert 'ddscope:cached_prompt_tokens_total{model_name="target"} 256.0' in metrics




def test_a_slot_map_lives_on_the_pools_device():
    """A table that is no run of blocks maps positions through an index tensor, made beside the pool (CUDA's
    index_copy_ refuses a CPU index for a GPU pool)."""
    import torch

    pages = Pages(device="meta")
    pages.extend([3, 1])
    assert pages.slots(0, 2 * BLOCK).device == torch.device("meta")


def test_a_matched_head_grows_in_a_row_over_a_divergent_cached_tail():
    """The block after a shared run is taken even when a diverging earlier request left it registered: the
    table stays one run, read as a view every step instead of gathered."""
    m = BlockManager(8)
    tokens = list(range(3 * BLOCK + 1))
    m.release(_held(m, tokens, 3 * BLOCK))  # blocks 0-2 registered, 3 empty
    other = tokens[:2 * BLOCK] + [9999] * (BLOCK + 1)
    pages = Pages()
    assert m.match(pages, other, 0) == 2 * BLOCK
    m.grow(pages, len(other) + 1)
    assert pages.table == [0, 1, 2, 3] and pages.contiguous
    assert m.match(Pages(), tokens, 0) == 2 * BLOCK  # the divergent third block is no longer served
