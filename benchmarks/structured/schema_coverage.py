"""Real-world JSON schemas per grammar backend: coverage (the schema compiles) and, on a sample, compliance (a
greedy generation on the demo pair finishes and validates with `jsonschema`), as JSONSchemaBench defines them
(epfl-dlab/jsonschemabench, core/evaluator.py). The corpus is read from a path you give, never committed: a clone
of guidance-ai/jsonschemabench (`data/<Subset>/*.json`) or any folder of schemas (searched recursively).

    python benchmarks/structured/schema_coverage.py ~/jsonschemabench/data --backends xgrammar,guidance,auto --sample 40

Prints a Markdown table: per backend, the schemas compiled, those refused (with the most common reason), and of
the sample, the outputs that finished and the finished ones that validate; `--json PATH` writes every row.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

PROMPT = "Write one JSON value that follows the schema.\n"


def corpus(root: Path, subsets: list[str] | None = None) -> list[tuple[str, Any]]:
    """(name, schema) for each readable JSON file under `root` (a subset's folder if `subsets` names it)."""
    out = []
    for path in sorted(root.rglob("*.json")):
        rel = path.relative_to(root)
        if subsets and (len(rel.parts) < 2 or rel.parts[0] not in subsets):
            continue
        try:
            out.append((str(rel), json.loads(path.read_text())))
        except (ValueError, UnicodeDecodeError):
            continue  # not a schema: the corpus' own metadata
    return out


def compile_one(engine: Any, schema: Any, backend: str) -> tuple[Any, str | None]:
    """The compiled grammar and None, or None and why it was refused."""
    from ddscope.structured.constraint import Constraint, ConstraintError

    try:
        return engine.grammars.compile(Constraint("json", json.dumps(schema), any_whitespace=False), backend), None
    except ConstraintError as e:
        return None, str(e)
    except (ValueError, TypeError) as e:  # a schema that is not JSON Schema at all
        return None, f"not a schema: {e}"


def comply(engine: Any, compiled: Any, schema: Any, max_tokens: int) -> tuple[bool, bool]:
    """(finished, valid): a greedy ddtree generation under the grammar, checked independently."""
    import jsonschema

    out = engine.generate(PROMPT, max_new_tokens=max_tokens, method="ddtree", constraint=compiled, temperature=0)
    if out.finish_reason != "stop":
        return False, False
    try:
        jsonschema.validate(json.loads(out.text), schema, format_checker=jsonschema.FormatChecker())
        return True, True
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return True, False


def measure(engine: Any, schemas: list[tuple[str, Any]], backend: str, sample: set[str],
            max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for name, schema in schemas:
        compiled, why = compile_one(engine, schema, backend)
        row: dict[str, Any] = {"backend": backend, "schema": name, "compiled": compiled is not None,
                               "by": getattr(compiled, "backend", None), "refused": why}
        if compiled is not None and name in sample:
            row["finished"], row["valid"] = comply(engine, compiled, schema, max_tokens)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    lines = ["| backend | compiled | refused (most common) | sampled | finished | valid of finished |",
             "|---|---|---|---|---|---|"]
    for b in backends:
        mine = [r for r in rows if r["backend"] == b]
        done = [r for r in mine if "finished" in r]
        finished = [r for r in done if r["finished"]]
        why = collections.Counter(_keyword(r["refused"]) for r in mine if r["refused"])
        top = f"{why.most_common(1)[0][0]} ({why.most_common(1)[0][1]})" if why else "-"
        lines.append(f"| {b} | {sum(r['compiled'] for r in mine)}/{len(mine)} | {top} | {len(done)} | "
                     f"{len(finished)} | {sum(r['valid'] for r in finished)}/{len(finished)} |")
    return "\n".join(lines)


def _keyword(reason: str) -> str:
    """The keyword a refusal names (its first), else its opening words."""
    found = re.search(r"([\w$]+) at \$", reason)
    return found.group(1) if found else reason[:40]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="a folder of schemas (JSONSchemaBench's data/)")
    p.add_argument("--subsets", default=None, help="comma-separated subsets (folders under root); default: all")
    p.add_argument("--backends", default="xgrammar,guidance,auto")
    p.add_argument("--sample", type=int, default=20, help="schemas whose outputs are generated and validated")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    args = p.parse_args(argv)
    from ddscope.engine import Engine

    schemas = corpus(args.root, args.subsets.split(",") if args.subsets else None)
    if not schemas:
        sys.exit(f"no JSON schemas under {args.root}")
    sample = set(random.Random(args.seed).sample([n for n, _ in schemas], min(args.sample, len(schemas))))
    engine = Engine.load()
    backends = args.backends.split(",")
    rows = [r for b in backends for r in measure(engine, schemas, b, sample, args.max_tokens)]
    print(table(rows, backends))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
