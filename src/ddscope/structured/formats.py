"""A string `format` both backends enforce. One no draft defines is an annotation (JSON Schema 2020-12 validation,
7.2.1, the default vocabulary; python-jsonschema's FormatChecker ignores it too) and is left out; a defined one a
backend does not know is written as a pattern (or a format it knows) whose strings all have it."""
from __future__ import annotations

from typing import Any

from ddscope.structured.drafts import NARROWED

# Defined by drafts 4 to 2020-12 (validation, section 7.3); draft 3's own (host-name, ...) are only its
DEFINED = {"date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
           "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
           "relative-json-pointer", "regex",
           "color"}  # draft 3's, which python-jsonschema's FormatChecker checks whatever the draft
DRAFT3 = {"style", "phone", "utc-millisec", "host-name", "ip-address"}


def _uri_reference(sub_delims: str) -> str:
    """RFC 3986's URI-reference (section 4.1), its authority's host a reg-name: every string it matches is one."""
    unreserved, pct = "A-Za-z0-9\\-._~", "%[0-9A-Fa-f]{2}"
    pchar = f"(?:[{unreserved}{sub_delims}:@]|{pct})"
    authority = (f"(?:(?:[{unreserved}{sub_delims}:]|{pct})*@)?(?:[{unreserved}{sub_delims}]|{pct})*"
                 "(?::[0-9]*)?")
    rest = f"(?:/{pchar}*)*"
    absolute = f"/(?:{pchar}+{rest})?"
    after_scheme = f"(?://{authority}{rest}|{absolute}|{pchar}+{rest})?"
    relative = f"(?://{authority}{rest}|{absolute}|(?:[{unreserved}{sub_delims}@]|{pct})+{rest})?"
    tail = f"(?:\\?(?:{pchar}|[/?])*)?(?:#(?:{pchar}|[/?])*)?"
    return f"^(?:[A-Za-z][A-Za-z0-9+.\\-]*:{after_scheme}|{relative}){tail}$"


SUB_DELIMS = "!$&'()*+,;="
JSON_POINTER = "(?:/(?:[^~/]|~[01])*)*"
AS_PATTERN = {
    "uri-reference": _uri_reference(SUB_DELIMS),
    "iri-reference": _uri_reference(SUB_DELIMS),  # every URI reference is an IRI reference (RFC 3987, 2.2)
    "uri-template": _uri_reference(SUB_DELIMS.replace("'", "")),  # literals only (RFC 6570, 2.1)
    "json-pointer": f"^{JSON_POINTER}$",  # RFC 6901, 3
    # no 0 after a digit: python-jsonschema 4.26 refuses "10" + "0" (_format.py:490, a leading-zero check)
    "relative-json-pointer": f"^(?:0|[1-9]+)(?:#|{JSON_POINTER})$",
    "regex": "^[^\\\\^$.|?*+()\\[\\]{}]*$",  # a literal: a regex in every dialect
    "color": "^#[0-9a-fA-F]{6}$",  # CSS 2.1's hex form
}
AS_FORMAT = {"iri": "uri", "idn-email": "email"}  # their ASCII subsets, which both backends know


def enforced_format(node: dict[str, Any], draft: str) -> dict[str, Any]:
    """`node` with its format as both backends enforce it: left out where no draft defines it (draft 3's own where
    the document is of another draft), written as a pattern (beside its own: in an allOf) or a known format where
    that can be done, or kept (for a backend to enforce, or refuse)."""
    name = node.get("format")
    if not isinstance(name, str) or name in DEFINED and name not in AS_PATTERN and name not in AS_FORMAT:
        return node
    if name not in DEFINED and not (name in DRAFT3 and "draft-03" in draft):
        return {k: v for k, v in node.items() if k != "format"}
    if name in AS_FORMAT:  # narrower: marked, never complemented
        return {**node, "format": AS_FORMAT[name], "$comment": NARROWED}
    if name in AS_PATTERN:
        rest = {k: v for k, v in node.items() if k != "format"}
        if "pattern" in rest:  # two patterns, both: guidance intersects them
            return {**rest, "allOf": [*(rest.get("allOf") or []), {"pattern": AS_PATTERN[name]}], "$comment": NARROWED}
        return {**rest, "pattern": AS_PATTERN[name], "$comment": NARROWED}
    return node
