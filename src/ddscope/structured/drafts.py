"""What a schema's draft leaves out, and the mark of a part served narrower than the schema says. A keyword its
draft does not define (`const` under draft 4, `dependencies` under 2020-12) is ignored by a validator of that
draft; ddscope applies it, as its author meant, which only narrows what is served. Such a part, like every part a
rewrite narrows, is marked (`NARROWED`, its `$comment`) and never complemented: the complement of a narrower set
is a looser one."""
from __future__ import annotations

from typing import Any

from ddscope.structured.schema import rebuild

NARROWED = "ddscope: narrowed"  # the $comment of a part served narrower than the schema, never complemented
LATER = {"if", "then", "else", "dependentRequired", "dependentSchemas", "prefixItems", "unevaluatedProperties",
         "unevaluatedItems", "minContains", "maxContains"}  # not in draft 6 (2019-09 and 2020-12: not dependencies)
UNDEFINED = {"draft-03": LATER | {"const", "contains", "propertyNames", "dependencies"},
             "draft-04": LATER | {"const", "contains", "propertyNames"},
             "draft-06": LATER,
             "draft-07": LATER - {"if", "then", "else"}}
NEWEST = {"dependencies"}  # 2019-09, 2020-12, and a document that names no draft


def undefined(draft: str) -> set[str]:
    """The keywords the draft a `$schema` names does not define (among those ddscope applies)."""
    return next((keys for name, keys in UNDEFINED.items() if name in draft), NEWEST)


def marked(schema: Any) -> Any:
    """`schema` with each subschema that holds a keyword its draft does not define marked `NARROWED`."""
    draft = str(schema.get("$schema", "")) if isinstance(schema, dict) else ""
    keys = undefined(draft)
    return rebuild(schema, lambda n: {**n, "$comment": NARROWED} if set(n) & keys else n)


def is_narrowed(node: Any) -> bool:
    return isinstance(node, dict) and node.get("$comment") == NARROWED
