"""xgrammar, compiled as vLLM 0.33 compiles it (v1/structured_output/backend_xgrammar.py:144-189): JSON schemas
in strict mode (no properties beyond those named), with `any_whitespace` and, without it, the separators (",",
":"); `json_object` as {"type": "object"}; choices as an EBNF of quoted alternatives (utils.py:441-458); EBNF
grammars, or Lark where the text has no `::=` (utils.py:409-438); regexes; structural tags.

xgrammar 0.2.9 logs and drops what it does not enforce (its json_schema_converter.cc and fsm_builder.cc, tried
here schema by schema): `gaps` names each of those before a compile, so that nothing is loosened silently."""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from ddscope.structured.backend import Backend, Compiled, Matcher
from ddscope.structured.constraint import Constraint, ConstraintError, first_line
from ddscope.structured.exclusive import exclusive
from ddscope.structured.merge import distributed, impossible, narrowed
from ddscope.structured.rewrite import portable
from ddscope.structured.schema import (Gap, combined_beside, inside, is_object, loose_values, names_refused, rebuild,
                                       ref_beside, refs_alone, resources, subschemas, types)

# Accepted by xgrammar and not enforced: an output that breaks them is served as valid.
IGNORED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
           "dependencies", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
           "$recursiveRef")
# Formats a validator checks that xgrammar lets any string through for (others it enforces, or nobody checks).
LOOSE_FORMATS = ("idn-email", "idn-hostname", "iri", "iri-reference", "regex")
PASSES = 4  # of `prepared` at most
LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")  # fsm_builder.cc: "Lookahead assertion ... is ignored"


def schema_gaps(schema: Any) -> list[Gap]:
    """Every keyword of `schema` xgrammar would drop, with its path."""
    nested, alone = resources(schema), refs_alone(schema)
    return [gap for node, path in subschemas(schema) for gap in _node_gaps(node, path, schema, nested, alone)]


def _node_gaps(node: dict[str, Any], path: str, root: Any, nested: list[str], alone: bool) -> list[Gap]:
    if "$ref" in node and alone:  # draft 7 and before: the $ref alone, as xgrammar reads it
        node = {"$ref": node["$ref"]}
    out = [Gap(k, path) for k in IGNORED if k in node]
    if "propertyNames" in node and node.get("properties") and names_refused(node, "") != []:
        out.append(Gap("propertyNames", path, "is not applied to the properties named beside it"))
    if ref_beside(node):  # xgrammar follows the $ref and drops them
        out.append(Gap("$ref", path, "beside other keywords is followed alone"))
    if (branched := combined_beside(node)) is not None:  # xgrammar reads the branches and drops the rest
        out.append(Gap(branched, path, "beside other keywords is read alone"))
    branches = node.get("oneOf")
    if isinstance(branches, list) and len(branches) > 1 and not exclusive(branches, root, not nested, types(node)):
        out.append(Gap("oneOf", path, "is read as anyOf, and its branches may overlap"))
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        out.append(Gap("allOf", path, "is only partly enforced"))
    if loose_values(node) and "$ref" not in node:  # xgrammar takes the values and drops every keyword beside
        out.append(Gap("const" if "const" in node else "enum", path,
                       "holds a value its type or the keywords beside it may refuse"))
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        out.append(Gap("$ref", path, f"{ref!r} is external and is not fetched"))
    elif isinstance(ref, str) and any(inside(path, r) for r in nested):
        out.append(Gap("$ref", path, "inside a resource with its own $id is read against the document's root"))
    text = not types(node) or "string" in types(node)
    shaped = "pattern" in node or "format" in node
    out += [Gap(k, path, "beside pattern or format is not enforced") for k in ("minLength", "maxLength")
            if text and shaped and k in node]
    if "multipleOf" in node and types(node) != {"integer"}:
        out.append(Gap("multipleOf", path, "on a number is not enforced"))
    if text and node.get("format") in LOOSE_FORMATS:
        out.append(Gap("format", path, f"{node['format']!r} is not enforced"))
    if isinstance(node.get("pattern"), str) and LOOKAROUND.search(node["pattern"]):
        out.append(Gap("pattern", path, "with a lookaround is not enforced"))
    if is_object(node) and node.get("additionalProperties", False) is not False:
        out += [Gap("false", f"{path}.properties.{name}", "in an object open to other properties is not enforced")
                for name, s in (node.get("properties") or {}).items() if s is False]
    return out


@functools.lru_cache(maxsize=8)  # read by the gaps, then by the compile: a large schema's takes a second
def prepared_text(spec: str) -> Any:
    return prepared(json.loads(spec))


def prepared(schema: Any) -> Any:
    """The schema as xgrammar is given it: what a subschema asserts beside its combinators written into them
    (`schema.distributed`), since xgrammar reads a combinator alone, and a const or enum beside other assertions as
    the values that pass them (`schema.narrowed`), since xgrammar takes the values alone."""
    local, draft = not resources(schema), schema.get("$schema") if isinstance(schema, dict) else None

    def one(node: dict[str, Any]) -> Any:
        out = distributed(node, schema, local)
        return narrowed(out, draft) if isinstance(out, dict) else out
    for _ in range(PASSES):  # a merge can leave a combinator beside keywords one level down: the next pass takes it
        done = rebuild(schema, one)
        if done == schema:
            break
        schema = done
    return schema


def without_false_properties(schema: Any) -> Any:
    """Closed objects without their optional `false` properties, which xgrammar refuses ("Schema 'false' cannot
    accept any value") though leaving them out is exactly what they say."""
    def drop(n: dict[str, Any]) -> dict[str, Any]:
        props, needed = n.get("properties"), set(n.get("required") or ())
        if not is_object(n) or not isinstance(props, dict) or n.get("additionalProperties", False) is not False:
            return n
        return {**n, "properties": {k: s for k, s in props.items() if s is not False or k in needed}}
    return rebuild(schema, drop)


class XGrammarCompiled(Compiled):
    def __init__(self, constraint: Constraint, grammar: Any):
        super().__init__(constraint, "xgrammar")
        self.grammar = grammar  # xgrammar.CompiledGrammar

    def matcher(self) -> Matcher:
        return XGrammarMatcher(self.grammar)


class XGrammarMatcher:
    def __init__(self, grammar: Any):
        import xgrammar as xgr

        self.m = xgr.GrammarMatcher(grammar)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def rollback(self, tokens: int) -> None:
        self.m.rollback(tokens)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def fill(self, bitmask: Any) -> None:
        self.m.fill_next_token_bitmask(bitmask)

    def forces(self) -> bool:  # xgrammar raises where asked past its stop token
        return not self.m.is_terminated() and bool(self.m.find_jump_forward_string())


class XGrammarBackend(Backend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]):
        super().__init__(tokenizer, vocab_size, stop_ids)
        self._compiler: Any = None

    def ready(self) -> None:
        self.compiler  # noqa: B018  (built on first use)

    def gaps(self, c: Constraint) -> list[Gap]:
        if c.kind == "json":
            return schema_gaps(prepared_text(c.spec))
        if c.kind == "regex" and LOOKAROUND.search(c.spec):
            return [Gap("regex", "$", "with a lookaround is not enforced")]
        if c.kind == "structural_tag":
            return [Gap(g.keyword, where + g.path[1:], g.why) for s, where in _tag_schemas(tag_prepared(c.spec), "$")
                    for g in schema_gaps(s)]
        return []

    def compile(self, c: Constraint) -> Compiled:
        try:
            return XGrammarCompiled(c, self._compile(c))
        except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own InvalidJSONError
            where = impossible(prepared_text(c.spec)) if c.kind == "json" else None
            why = f" (nothing matches {where}: its values or branches and the keywords beside them exclude each " \
                "other)" if where else ""
            raise ConstraintError(f"the {c.kind} constraint does not compile: {first_line(e)}{why}") from None

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, c: Constraint) -> Any:
        comp = self.compiler
        if c.kind in ("json", "json_object"):
            schema = json.dumps(without_false_properties(prepared_text(c.spec))) if c.kind == "json" \
                else '{"type": "object"}'
            if c.whitespace is not None:
                return comp.compile_grammar(json_with_whitespace(schema, c.whitespace))
            separators = None if c.any_whitespace else (",", ":")
            return comp.compile_json_schema(schema, any_whitespace=c.any_whitespace, separators=separators,
                                            max_whitespace_cnt=c.max_whitespace)
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        if c.kind == "choice":
            return comp.compile_grammar(choice_grammar(json.loads(c.spec)))
        if c.kind == "grammar":
            return comp.compile_grammar(c.spec) if "::=" in _uncommented(c.spec) else comp.compile_lark(c.spec)
        return compile_structural_tag(comp, c.spec)


def _tag_schemas(tag: Any, path: str) -> list[tuple[Any, str]]:
    """The JSON schemas inside a structural tag (`json_schema` of the current format, `schema` of the legacy)."""
    if isinstance(tag, list):
        return [s for i, v in enumerate(tag) for s in _tag_schemas(v, f"{path}[{i}]")]
    if not isinstance(tag, dict):
        return []
    found = [(tag[k], f"{path}.{k}") for k in ("json_schema", "schema") if isinstance(tag.get(k), (dict, bool))]
    return found + [s for k, v in tag.items() if k not in ("json_schema", "schema")
                    for s in _tag_schemas(v, f"{path}.{k}")]


@functools.lru_cache(maxsize=8)
def tag_prepared(spec: str) -> Any:
    """A structural tag with each of its schemas as xgrammar is given them (`prepared`, after the rewrites both
    backends read: rewrite.portable)."""
    def walk(tag: Any) -> Any:
        if isinstance(tag, list):
            return [walk(v) for v in tag]
        if not isinstance(tag, dict):
            return tag
        return {k: without_false_properties(prepared(portable(v))) if k in ("json_schema", "schema") and isinstance(
            v, (dict, bool)) else walk(v) for k, v in tag.items()}
    return walk(json.loads(spec))


def compile_structural_tag(comp: Any, spec: str) -> Any:
    """The current format as xgrammar reads it, or the legacy {"structures": [{begin, schema, end}], "triggers"}
    as vLLM converts it (backend_xgrammar.py:173-189)."""
    import xgrammar as xgr

    tag = tag_prepared(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return comp.compile_structural_tag(items, tag["triggers"])
    return comp.compile_structural_tag(json.dumps(tag))


FREE_SPACE = "[ \\n\\r\\t]*"  # JSON's whitespace, as xgrammar writes it with any_whitespace


def json_with_whitespace(schema: str, pattern: str) -> str:
    """The schema's EBNF with every stretch of free whitespace matching `pattern` instead (the lookaheads that
    end strings keep theirs: they only test what may follow)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=True))
    space = re.sub(r"\broot(\w*)", r"ddscope_space\1", str(xgr.Grammar.from_regex(pattern)))
    body = re.sub(r"(?<!\(=\()" + re.escape(FREE_SPACE), "ddscope_space", text)
    return body + "\n" + space


def choice_grammar(choices: list[str]) -> str:
    """An EBNF whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(f'"{_escape(s)}"' for s in choices)


def _escape(s: str) -> str:
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"\\u{ord(m.group()):04x}", out)


def _uncommented(text: str) -> str:
    return "\n".join(re.sub(r"(#|//).*$", "", line) for line in text.splitlines())
