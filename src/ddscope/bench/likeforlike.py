"""Like for like: the run settings (max_tokens, workload, temperature, method, backend, model) in which
runs compared side by side differ, each of which moves tok/s or acceptance by itself."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Run settings that move tok/s or acceptance by themselves: (section, key) in results.json.
SETTINGS = {"max_tokens": ("config", "max_tokens"), "workload": ("config", "workload"),
            "temperature": ("config", "temperature"), "method": ("backend", "method"),
            "backend": ("backend", "name"), "model": ("backend", "model")}

Run = tuple[str, dict[str, Any], set[str]]  # (tag, load_rows metadata, curve labels)


def _setting(meta: dict[str, Any], name: str) -> Any:
    section, key = SETTINGS[name]
    return (meta.get(section) or {}).get(key)


def _groups(runs: list[Run]) -> Iterator[tuple[str, list[Run]]]:
    """(setting, the runs compared in it): all of them, but for the workload those that share a curve,
    since padding beside code is the comparison diagnose makes."""
    labels = sorted(set().union(*(labels for *_, labels in runs)))
    for name in SETTINGS:
        if name == "workload":
            yield from ((name, [run for run in runs if label in run[2]]) for label in labels)
        else:
            yield name, runs


def run_differences(runs: list[Run]) -> tuple[list[str], list[str]]:
    """The settings in which runs differ, as "max_tokens (128 vs 600)", and notes naming the settings a
    run does not record (older files, CSV, a server that does not say): unknown, so not compared."""
    differ: dict[str, None] = {}  # dicts as ordered sets
    unknown: dict[str, dict[str, None]] = {}
    for name, group in _groups(runs):
        if len(group) < 2:
            continue
        values = [_setting(meta, name) for _, meta, _ in group]
        known = list(dict.fromkeys(v for v in values if v is not None))
        if len(known) > 1:
            differ[f"{name} ({' vs '.join(map(str, known))})"] = None
        for (tag, *_), value in zip(group, values):
            if value is None:
                unknown.setdefault(tag, {})[name] = None
    notes = [f"{tag} does not record {', '.join(names)}: not compared with the other runs"
             for tag, names in unknown.items()]
    return list(differ), notes
