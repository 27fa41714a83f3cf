"""Real acceptance: tau (tokens committed per verify step, bonus included) from running the engine.

Prompt sets are the bench's offline workloads (code = HumanEval, math = GSM8K test, chat = MT-Bench
first turns). Math and chat prompts go through the tokenizer's chat template when it has one (the
demo target learned chat in ChatML); code prompts stay raw, since HumanEval is a completion task.
At T=0, when `ar` is among the methods, every method's output is checked against ar's token for token.
Each method first runs `warmup` untimed generations per context, so one-off costs (allocations, kernel
selection) do not land in whichever method happens to run first.
With `contexts`, each prompt is also fitted to those token counts the way the bench and
benchmarks/speed.py build long contexts (earlier prompts of the set prepended, no chat template),
so tau per context bucket shows how a drafter holds up at long context.
Every ddtree tree gets a prompt-lookup branch (ddscope.speculative.lookup), which on repetitive text commits much of
what ddtree does however weak the drafter: so each ddtree generation is run again without that branch,
and `tau_drafter` is the drafter's own figure beside the combined `tau`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from ddscope.bench.running.workloads import fit_ids, load_workload

TEMPLATED = ("math", "chat")
DRAFTER_ALONE = "no lookup"  # how the lossless check names a ddtree run without the lookup branch
LEGEND = "tau: drafter + prompt lookup; tau_drafter: the drafter alone (no lookup branch)"


@dataclass(frozen=True)
class Method:
    label: str            # as written on the command line, e.g. "ddtree:32"
    name: str             # engine method
    budget: int | str | None   # None = the engine default; "auto" = the adaptive budget


@dataclass(frozen=True)
class EvalSpec:
    workloads: tuple[str, ...] = ("code", "math", "chat")
    methods: tuple[Method, ...] = ()
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompts: int = 20
    max_new_tokens: int = 128
    chat_template: str = "auto"   # "auto" | "never"
    contexts: tuple[int, ...] = (0,)  # prompt tokens; 0 = each prompt as it is
    warmup: int = 1                   # untimed generations per method and context


def parse_methods(text: str) -> tuple[Method, ...]:
    """`ar,dflash,ddtree:8,ddtree:auto` -> Methods; ddtree without a budget uses the engine default."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, budget = item.partition(":")
        if name not in ("ar", "dflash", "ddtree") or (budget and name != "ddtree"):
            raise ValueError(f"unknown method {item!r}: use ar, dflash or ddtree[:BUDGET]")
        try:
            out.append(Method(item, name, None if not budget else budget if budget == "auto" else int(budget)))
        except ValueError:
            raise ValueError(f"ddtree budget must be an integer or auto, got {item!r}") from None
    if not out:
        raise ValueError("no methods given")
    return tuple(out)


def workload_prompts(engine: Any, workload: str, n: int, chat_template: str, max_new_tokens: int,
                     context: int = 0) -> list[list[int]]:
    """The first `n` prompts of a workload as token ids: as they are (templated where chosen, clipped to
    fit) for context 0, else fitted to exactly `context` tokens."""
    tok = engine.tokenizer
    room = engine.max_model_len - max_new_tokens
    if room < max(1, context):
        raise ValueError(f"--max-tokens {max_new_tokens} leaves room for {room} prompt tokens (max_model_len "
                         f"{engine.max_model_len}), fewer than context {context}")
    spec = load_workload(workload)
    if context:
        return [fit_ids(spec, i, context, tok) for i in range(min(n, len(spec.prompts)))]
    use_template = chat_template == "auto" and workload in TEMPLATED and getattr(tok, "chat_template", None)
    out = []
    for text in spec.prompts[:n]:
        if use_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False)[-room:])
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


Key = tuple[str, int, float, str]  # (workload, context, temperature, method label)


def warm_up(engine: Any, spec: EvalSpec, prompts: dict[tuple[str, int], list[list[int]]]) -> None:
    """`spec.warmup` untimed greedy generations per method on the first prompt of each context."""
    firsts: dict[int, list[int]] = {}
    for (_, context), ids_list in prompts.items():
        if ids_list:
            firsts.setdefault(context, ids_list[0])
    runs = [(ids, m) for ids in firsts.values() for m in spec.methods for _ in range(spec.warmup)]
    for ids, m in tqdm(runs, desc="warm-up", unit="gen", dynamic_ncols=True, disable=not runs):
        engine.generate(ids, max_new_tokens=spec.max_new_tokens, method=m.name, budget=m.budget, temperature=0.0)


def evaluate(engine: Any, spec: EvalSpec) -> dict[str, Any]:
    """Run every workload x context x temperature x prompt x method; return results and lossless mismatches."""
    missing = sorted({m.name for m in spec.methods} - set(engine.methods))
    if missing:
        raise ValueError(f"methods {missing} need a drafter; this engine offers {', '.join(engine.methods)}")
    prompts = {(w, c): workload_prompts(engine, w, spec.prompts, spec.chat_template, spec.max_new_tokens, c)
               for w in spec.workloads for c in spec.contexts}
    warm_up(engine, spec, prompts)
    totals: dict[Key, dict[str, float]] = {}
    alone_totals: dict[Key, dict[str, float]] = {}
    mismatches: list[dict[str, Any]] = []
    checked = 0
    per_prompt = len(spec.methods) + sum(m.name == "ddtree" for m in spec.methods)
    runs = sum(len(p) for p in prompts.values()) * len(spec.temperatures) * per_prompt
    with tqdm(total=runs, desc="eval-acceptance", unit="gen", dynamic_ncols=True) as bar:
        for (workload, context), ids_list in prompts.items():
            for temp in spec.temperatures:
                for i, ids in enumerate(ids_list):
                    outputs = {}
                    for m in spec.methods:
                        key = (workload, context, temp, m.label)
                        kwargs = dict(max_new_tokens=spec.max_new_tokens, method=m.name, budget=m.budget,
                                      temperature=temp, seed=i)
                        out = engine.generate(ids, **kwargs)
                        _add(totals.setdefault(key, {}), out.stats)
                        outputs[m.label] = out.token_ids
                        bar.update(1)
                        if m.name == "ddtree":
                            out = engine.generate(ids, **kwargs, lookup=False)
                            _add(alone_totals.setdefault(key, {}), out.stats)
                            outputs[f"{m.label} ({DRAFTER_ALONE})"] = out.token_ids
                            bar.update(1)
                    if temp == 0 and "ar" in outputs:
                        checked += len(outputs) - 1
                        for label, ids_out in outputs.items():
                            if ids_out != outputs["ar"]:
                                mismatches.append({"workload": workload, "context": context, "prompt": i,
                                                   "method": label, "first_diff": _first_diff(ids_out, outputs["ar"])})
                                bar.write(f"MISMATCH: {workload} ctx {context} prompt {i}: {label} differs from ar "
                                          f"at token {mismatches[-1]['first_diff']}")
    return {"model": engine.model_name, "spec": {**asdict(spec), "methods": [m.label for m in spec.methods]},
            "results": _summarise(totals, alone_totals), "legend": LEGEND, "lossless_checked": checked,
            "mismatches": mismatches}


def _add(total: dict[str, float], stats: Any) -> None:
    for key, value in (("prompts", 1), ("tokens", stats.committed_tokens), ("steps", stats.verify_steps),
                       ("decode_s", stats.decode_s)):
        total[key] = total.get(key, 0.0) + value


def _tau(total: dict[str, float]) -> float:
    return total["tokens"] / total["steps"] if total["steps"] else 0.0


def _summarise(totals: dict[Key, dict[str, float]], alone: dict[Key, dict[str, float]]) -> list[dict[str, Any]]:
    """A row per key; `tau_drafter` is the ddtree run's without lookup, dflash's own tau (it has no
    lookup branch), and None for ar (no drafter)."""
    rows = []
    for key, t in totals.items():
        workload, context, temp, label = key
        tok_s = t["tokens"] / t["decode_s"] if t["decode_s"] else 0.0
        ar = totals.get((workload, context, temp, "ar"))
        ar_tok_s = ar["tokens"] / ar["decode_s"] if ar and ar["decode_s"] else None
        tau_drafter = _tau(alone[key]) if key in alone else _tau(t) if label == "dflash" else None
        rows.append({"workload": workload, "context": context, "temperature": temp, "method": label,
                     "tau": _tau(t), "tau_drafter": tau_drafter, "tok_per_s": tok_s,
                     "speedup_vs_ar": tok_s / ar_tok_s if ar_tok_s else None, "prompts": int(t["prompts"]),
                     "tokens": int(t["tokens"]), "verify_steps": int(t["steps"])})
    return rows


def print_table(report: dict[str, Any]) -> None:
    from rich import box
    from rich.table import Table

    from ddscope.util.options import stdout_console

    # Compact, so that a row holds on one line of an 80-column terminal.
    table = Table(title=f"acceptance: {report['model']} (tau = tokens per verify step, bonus included)",
                  box=box.SIMPLE_HEAD, padding=(0, 0))
    for col in ("workload", "ctx", "T", "method", "tau", "tau_drafter", "tok/s", "vs ar", "prompts", "tokens"):
        table.add_column(col, justify="left" if col in ("workload", "method") else "right", no_wrap=col != "workload")
    for r in report["results"]:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        alone = f"{r['tau_drafter']:.2f}" if r["tau_drafter"] is not None else "-"
        table.add_row(r["workload"], str(r["context"] or "as is"), f"{r['temperature']:g}", r["method"],
                      f"{r['tau']:.2f}", alone, f"{r['tok_per_s']:.1f}", speedup, str(r["prompts"]), str(r["tokens"]))
    console = stdout_console()
    console.print(table)
    console.print(report["legend"], highlight=False)
    checked, failed = report["lossless_checked"], len(report["mismatches"])
    if failed:
        console.print(f"[bold red]LOSSLESS CHECK FAILED: {failed} of {checked} greedy output(s) differ "
                      "from ar[/bold red]")
    elif checked:
        console.print(f"lossless check (T=0): all {checked} greedy outputs equal ar's, token for token")
    else:
        console.print("lossless check: not run (needs ar and another method, and temperature 0)")
