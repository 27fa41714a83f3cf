"""Side-by-side decoding speed on one machine: HF generate (plain and prompt lookup) vs ddscope ar,
dflash, ddtree at fixed budgets and ddtree with the adaptive budget.

Arms run interleaved in a shuffled order per (repeat, prompt), so load drift hits all arms alike;
speedups are medians of per-pair ratios against HF generate measured in the same pass.

    python benchmarks/engine/speed.py                    # full run on the bundled demo pair (long)
    python benchmarks/engine/speed.py --quick            # smoke run, under 2 minutes
    python benchmarks/engine/speed.py --compare-drafter src/ddscope/assets/demo/drafter-short   # two drafters, one run

With `--compare-drafter DIR`, the same target also runs with a second drafter, whose arms are
prefixed `B:` and interleaved with the first's. At T=0 every engine arm's output is checked against
`ar` token for token; mismatches are counted in the output.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers: benchmarks/common/
from engine_args import load_engine, parser
from transformers import AutoModelForCausalLM

from ddscope import Engine
from ddscope.bench.running.workloads import fit_ids, load_workload
from ddscope.policy.cost import VerifyCost


@dataclass
class Sample:
    workload: str
    temperature: float
    context: int     # prompt tokens
    requested: int   # the --contexts entry it was fitted to; 0 = the prompt as it is
    repeat: int
    prompt: int
    arm: str
    tok_per_s: float
    tau: float | None = None
    step_ms: float | None = None
    phase_ms: dict | None = None
    overhead_ms: float | None = None
    nodes: float | None = None
    matches_ar: bool | None = None   # T=0 engine arms: output equal to ar's


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--workloads", default="code,math,chat")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--contexts", default="0,1024,4096", help="prompt tokens; 0 = the prompt as it is")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    p.add_argument("--budgets", default="4,8,16,32,64")
    p.add_argument("--no-hf", action="store_true", help="skip the two HF transformers arms")
    p.add_argument("--compare-drafter", help="a second drafter for the same target: its arms run as B:ARM")
    p.add_argument("--arms", help="only these arms (comma list of names as printed, e.g. ar,ddtree-auto,B:ddtree-auto)")
    p.add_argument("--quick", action="store_true", help="code, T=0, context 0, 32 tokens, 1 repeat, 2 budgets")
    p.add_argument("--out", type=Path, default=Path("bench-out/speed.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.workloads, args.temperatures, args.contexts = "code", "0", "0"
        args.max_tokens, args.repeats, args.prompts, args.budgets = 32, 1, 1, "8,32"
    return args


def arms(budgets: list[int], with_hf: bool, compare: bool) -> list[str]:
    base = ["hf", "hf-lookup"] if with_hf else []
    drafted = ["dflash"] + [f"ddtree-{b}" for b in budgets] + ["ddtree-auto"]
    return base + ["ar"] + drafted + ([f"B:{a}" for a in drafted] if compare else [])


def run_hf(model, ids: list[int], arm: str, max_tokens: int, temperature: float, seed: int) -> float:
    torch.manual_seed(seed)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    kw |= dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    if arm == "hf-lookup":
        kw["prompt_lookup_num_tokens"] = 10
    t0 = time.perf_counter()
    out = model.generate(torch.tensor([ids]), **kw)
    return (out.shape[1] - len(ids)) / (time.perf_counter() - t0)


def run_engine(engine: Engine, ids: list[int], arm: str, max_tokens: int, temperature: float, seed: int
               ) -> tuple[dict, list[int]]:
    method, _, budget = arm.removeprefix("B:").partition("-")
    budget = budget if budget == "auto" else (int(budget) if budget else None)
    t0 = time.perf_counter()
    out = engine.generate(ids, max_new_tokens=max_tokens, method=method, budget=budget, temperature=temperature,
                          seed=seed, ignore_eos=True)
    wall = time.perf_counter() - t0
    s = out.stats.to_dict(rounds=False)
    steps = s["verify_steps"]
    return dict(tok_per_s=len(out.token_ids) / wall, tau=s["avg_commit"], step_ms=s["mean_step_ms"],
                phase_ms={k: v / steps for k, v in s["phase_ms"].items()},
                overhead_ms=(1000 * s["decode_s"] - s["model_ms"]) / steps,
                nodes=s["nodes_verified"] / steps), out.token_ids


def measure(args: argparse.Namespace, engines: dict[str, Engine], hf, names: list[str]) -> list[Sample]:
    """`engines` maps an arm prefix ("" or "B:") to its engine; arms run in a shuffled order per prompt."""
    rng = random.Random(0)
    samples: list[Sample] = []
    engine = engines[""]
    for wl_name in args.workloads.split(","):
        workload = load_workload(wl_name)
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            for context in [int(c) for c in args.contexts.split(",")]:
                for rep in range(args.repeats):
                    for i in range(args.prompts):
                        natural = len(engine.encode(workload.prompts[i]))
                        ids = fit_ids(workload, i, context or natural, engine.tokenizer)
                        outputs: dict[str, list[int]] = {}
                        for arm in rng.sample(names, len(names)):
                            seed = 1000 * rep + i
                            key = dict(workload=wl_name, temperature=temperature, context=len(ids),
                                       requested=context, repeat=rep, prompt=i, arm=arm)
                            if arm.startswith("hf"):
                                samples.append(Sample(**key, tok_per_s=run_hf(hf, ids, arm, args.max_tokens,
                                                                               temperature, seed)))
                                continue
                            prefix = "B:" if arm.startswith("B:") else ""
                            stats, outputs[arm] = run_engine(engines[prefix], ids, arm, args.max_tokens,
                                                             temperature, seed)
                            samples.append(Sample(**key, **stats))
                        if temperature == 0 and "ar" in outputs:
                            for s in samples[-len(names):]:
                                if s.arm in outputs:
                                    s.matches_ar = outputs[s.arm] == outputs["ar"]
                        print(f"  {wl_name} T={temperature:g} ctx={len(ids)} rep {rep + 1}/{args.repeats} "
                              f"prompt {i + 1}/{args.prompts}", file=sys.stderr, flush=True)
    return samples


def summarize(samples: list[Sample], cost: VerifyCost) -> list[dict]:
    """Per (workload, T, requested context, arm): the prompt set's throughput per pass, median over passes.

    A pass's tok/s is total tokens over total time across its prompts (the harmonic mean: prompts
    of one set differ several-fold in speed, and a median over them would pick one prompt);
    speedups are ratios within a pass; per-step figures are weighted by steps.
    """
    passes: dict[tuple, list[Sample]] = {}
    for s in samples:
        passes.setdefault((s.workload, s.temperature, s.requested, s.arm, s.repeat), []).append(s)
    throughput = {key: statistics.harmonic_mean([s.tok_per_s for s in group]) for key, group in passes.items()}
    rows = []
    for group_key in sorted({key[:4] for key in passes}):
        wl, temp, ctx, arm = group_key
        reps = sorted(key[4] for key in passes if key[:4] == group_key)
        tps = [throughput[(*group_key, r)] for r in reps]

        def paired(ref_arm: str) -> list[float]:
            ref = [throughput.get((wl, temp, ctx, ref_arm, r)) for r in reps]
            return [t / rt for t, rt in zip(tps, ref) if rt]

        row = dict(workload=wl, temperature=temp, context=ctx, arm=arm, n=len(reps),
                   tok_per_s=statistics.median(tps), tok_per_s_min=min(tps), tok_per_s_max=max(tps))
        vs_hf, vs_ar = paired("hf"), paired("ar")
        row["speedup_vs_hf"] = statistics.median(vs_hf) if vs_hf else None
        if arm != "ddtree-auto" and (auto_over := [1 / r for r in paired("ddtree-auto")]):
            row["auto_over_arm"] = [statistics.median(auto_over), min(auto_over), max(auto_over)]
        group = [s for r in reps for s in passes[(*group_key, r)]]
        if group[0].tau is not None:
            steps = [1.0 / s.tau for s in group]  # per committed token: the samples' token counts are equal
            mean = lambda xs: sum(w * x for w, x in zip(steps, xs)) / sum(steps)  # noqa: E731
            row |= dict(tau=len(group) / sum(steps), step_ms=mean(s.step_ms for s in group),
                        overhead_ms=mean(s.overhead_ms for s in group),
                        phase_ms={k: mean(s.phase_ms[k] for s in group) for k in group[0].phase_ms},
                        nodes=mean(s.nodes for s in group))
            curve = cost.curve(statistics.fmean(s.context for s in group))
            ideal = row["tau"] * curve[0] / curve[min(int(round(row["nodes"])), len(curve) - 1)]
            row["efficiency"] = statistics.median(vs_ar) / ideal if vs_ar else None
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| workload | T | ctx | arm | tok/s (min-max) | vs HF | tau | ms/step draft/tree/verify/commit "
            "| overhead % | efficiency |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["workload"], r["temperature"], r["context"], r["arm"])):
        vs = f"{r['speedup_vs_hf']:.2f}x" if r.get("speedup_vs_hf") else "-"
        if "tau" in r:
            ph = r["phase_ms"]
            phases = f"{r['step_ms']:.2f} = {ph['draft']:.2f}/{ph['tree']:.2f}/{ph['verify']:.2f}/{ph['commit']:.2f}"
            rest = (f"{r['tau']:.2f} | {phases} | {100 * r['overhead_ms'] / r['step_ms']:.1f} | "
                    f"{r['efficiency']:.2f}" if r.get("efficiency") else f"{r['tau']:.2f} | {phases} | - | -")
        else:
            rest = "- | - | - | -"
        lines.append(f"| {r['workload']} | {r['temperature']:g} | {r['context']} | {r['arm']} | "
                     f"{r['tok_per_s']:.1f} ({r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f}) | {vs} | {rest} |")
    return "\n".join(lines)


def auto_table(rows: list[dict]) -> str:
    """`ddtree` auto against each other engine arm: median per-pass ratio, the side-by-side measure."""
    lines = ["| workload | T | ctx | arm | auto / arm, median per pass (min-max) |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["temperature"], r["context"], r["arm"])):
        if "auto_over_arm" in r and not r["arm"].startswith("hf"):
            med, lo, hi = r["auto_over_arm"]
            lines.append(f"| {r['workload']} | {r['temperature']:g} | {r['context']} | {r['arm']} | "
                         f"{med:.3f} ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = load_engine(args)
    engines = {"": engine}
    if args.compare_drafter:
        engines["B:"] = engine.with_drafter(args.compare_drafter)
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(engine.source, dtype=torch.float32).eval()
    names = arms([int(b) for b in args.budgets.split(",")], hf is not None, "B:" in engines)
    if args.arms:
        unknown = set(args.arms.split(",")) - set(names)
        if unknown:
            raise SystemExit(f"speed.py: unknown arms {sorted(unknown)}; choose from {','.join(names)}")
        names = [a for a in names if a in args.arms.split(",")]
    cost = VerifyCost.cached(engine.target, engine.max_model_len, engine.source)
    samples = measure(args, engines, hf, names)
    rows = summarize(samples, cost)
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(machine=platform.machine(), processor=platform.processor(), threads=args.threads,
               torch=torch.__version__, python=platform.python_version(), argv=sys.argv[1:])
    args.out.write_text(json.dumps(dict(env=env, summary=rows, samples=[asdict(s) for s in samples]), indent=1))
    print(table)
    print("\n" + auto_table(rows))
    checked = [s for s in samples if s.matches_ar is not None]
    print(f"\ngreedy lossless check: {sum(not s.matches_ar for s in checked)} mismatches against ar "
          f"in {len(checked)} generations")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
