"""The grammar's share of a step, and whether the tree pays under a grammar: `ar` against `ddtree` at budget 32 and
`auto`, on the real-world-like JSON schemas of tests/fixtures/schemas (compiled as the server compiles them: backend
`auto`, free whitespace bounded by MAX_WHITESPACE; one no backend enforces is listed as refused), a forced hermes tool
call and an EBNF grammar, on the demo pair by default.

Greedy, 128 tokens; the arms run in turn for each workload, their order rotating each pass, and the outputs must be
equal (lossless, asserted). tok/s is committed tokens over the engine's decode time, the median over passes; the
grammar's share is its time (matcher, masks and masked candidates: RoundStats.grammar_ms) over the steps' time,
summed over ddtree's passes; masks/step against nodes/step shows how many nodes shared a grammar state's mask.
Prints a Markdown table:

    python benchmarks/structured/grammar_share.py --rounds 3
"""
from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

from engine_args import load_engine, parser  # noqa: E402

from ddscope.engine import Engine  # noqa: E402
from ddscope.engine.limits import MAX_WHITESPACE  # noqa: E402
from ddscope.structured.constraint import Constraint, ConstraintError  # noqa: E402
from ddscope.structured.tool_choice import Tool, ToolChoice  # noqa: E402
from ddscope.structured.tool_parsers import Whitespace, parser_for  # noqa: E402

SCHEMAS = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "schemas"
TOOLS = [Tool("get_weather", {"type": "object", "properties": {
             "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city", "unit"]}),
         Tool("get_time", {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]})]
EBNF = ('root ::= call (";" " " call){0,2}\ncall ::= name "(" args? ")"\nname ::= [a-z_]{1,12}\n'
        'args ::= arg ("," " " arg){0,2}\narg ::= [a-z]{1,8} | [0-9]{1,4} | "\\"" [a-z ]{0,12} "\\""')
PROMPT = "Answer in the format asked:\n"
ARMS = (("ar", None), ("ddtree", 32), ("ddtree", "auto"))


def workloads() -> dict[str, Constraint]:
    """Each fixture schema as the server's defaults constrain it, the forced tool call and the EBNF grammar."""
    out = {p.stem: Constraint("json", p.read_text(), max_whitespace=MAX_WHITESPACE)
           for p in sorted(SCHEMAS.glob("*/*.json"))}
    tag = parser_for("hermes", TOOLS, ToolChoice("required")).grammar(Whitespace(bound=MAX_WHITESPACE))
    out["tool-call (hermes)"] = Constraint("structural_tag", json.dumps(tag))
    out["ebnf-calls"] = Constraint("grammar", EBNF)
    return out


def run(engine: Engine, method: str, budget: int | str | None, c: Constraint, tokens: int) -> dict:
    out = engine.generate(PROMPT, max_new_tokens=tokens, method=method, budget=budget, constraint=c)
    s = out.stats
    return {"ids": out.token_ids, "committed": s.committed_tokens, "steps": s.verify_steps, "decode_s": s.decode_s,
            "step_ms": sum(r.step_ms for r in s.rounds), "grammar_ms": sum(r.grammar_ms for r in s.rounds),
            "masks": sum(r.grammar_masks for r in s.rounds), "nodes": sum(r.nodes for r in s.rounds)}


def measure(engine: Engine, c: Constraint, rounds: int, tokens: int) -> dict[str, list[dict]]:
    """Every arm `rounds` times, in turn, the order rotating each pass; outputs equal across arms."""
    got: dict[str, list[dict]] = {f"{m}:{b}" if b else m: [] for m, b in ARMS}
    for r in range(rounds):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
        for method, budget in order:
            got[f"{method}:{budget}" if budget else method].append(run(engine, method, budget, c, tokens))
    ref = got["ar"][0]["ids"]
    assert all(x["ids"] == ref for runs in got.values() for x in runs), "every arm must commit ar's tokens"
    return got


def rate(runs: list[dict]) -> float:
    return statistics.median(x["committed"] / x["decode_s"] for x in runs)


def row(name: str, got: dict[str, list[dict]]) -> str:
    ar = rate(got["ar"])
    cells = [name, str(got["ar"][0]["committed"] + 1), f"{ar:.0f}"]
    for arm in ("ddtree:32", "ddtree:auto"):
        runs = got[arm]
        steps = sum(x["steps"] for x in runs)
        share = sum(x["grammar_ms"] for x in runs) / sum(x["step_ms"] for x in runs)
        cells += [f"{rate(runs):.0f} ({rate(runs) / ar:.2f}x)", f"{sum(x['committed'] for x in runs) / steps:.2f}",
                  f"{100 * share:.0f}%", f"{sum(x['masks'] for x in runs) / steps:.1f} / "
                  f"{sum(x['nodes'] for x in runs) / steps:.1f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=3, help="passes over the arms (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="max new tokens (default: %(default)s)")
    args = p.parse_args()
    engine = load_engine(args)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {model} ({platform.machine()}), {args.threads} thread(s), greedy, {args.tokens} tokens at most, "
          f"median of {args.rounds}\n")
    head = ["workload", "tokens", "ar tok/s"] + [f"{arm} {col}" for arm in ("ddtree:32", "auto")
                                                 for col in ("tok/s", "avg_commit", "grammar share", "masks / nodes a step")]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, c in workloads().items():
        try:
            engine.grammars.compile(c)
        except ConstraintError as e:
            print(f"| {name} | refused: {str(e)[:80]} |" + " |" * (len(head) - 2))
            continue
        run(engine, "ddtree", 32, c, 16)  # warm: the grammar's first masks, the calibration `auto` reads
        print(row(name, measure(engine, c, args.rounds, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
