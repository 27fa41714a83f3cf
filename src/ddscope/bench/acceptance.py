"""Choosing one acceptance source per sweep from the probe, then reading it for every request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddscope.bench.backends import Reading, Scrape, Server, counter_delta, per_request
from ddscope.bench.serverlog import ServerLog
from ddscope.bench.sources import LOG, NONE, ORDER, SOURCES, Acceptance

# Sources read on another route than the OpenAI one the sweep uses by default.
SOURCE_ROUTE = {"sglang.generate": "generate"}


@dataclass
class Observation:
    """One probe request on one route: its body and the /metrics scrapes around it."""
    body: dict[str, Any]
    completion_tokens: int
    before: Scrape | None
    after: Scrape | None


class AcceptanceReader:
    """Per backend, the first source in `ORDER` the probe shows working; why each earlier one was
    refused is kept for the results and the printed header."""

    def __init__(self, backend: str, server: Server, log: ServerLog | None = None):
        self.backend, self.server, self.log = backend, server, log
        self.source = NONE
        self.refused: dict[str, str] = {}

    @property
    def route(self) -> str:
        return SOURCE_ROUTE.get(self.source.name, "openai")

    def _check(self, name: str, seen: dict[str, Observation | str]) -> str | None:
        """None when the source works on the probe, else why not. `seen` maps a route to its probe
        observation, or to why that route was not probed."""
        if name == LOG.name:
            return None if self.log is not None else "no --server-log or --log-cmd given"
        obs = seen.get(SOURCE_ROUTE.get(name, "openai"), "not probed")
        if isinstance(obs, str):
            return obs
        kind = SOURCES[name].kind
        if kind == "per_request":
            got = per_request(name, obs.body, obs.completion_tokens)
        elif kind == "counter_delta":
            got = counter_delta(name, obs.before, obs.after)
        elif kind == "windowed_gauge":
            ok = obs.after is not None and "sglang:spec_accept_length" in obs.after.values
            return None if ok else "/metrics has no sglang:spec_accept_length"
        elif kind == "lifetime":
            return None if self.server.lifetime_accept_length() else "no internal_states[].avg_spec_accept_length"
        else:
            return f"unknown source kind {kind}"
        return None if isinstance(got, Acceptance) else got

    def choose(self, seen: dict[str, Observation | str]) -> None:
        self.source, self.refused = NONE, {}
        for name in ORDER.get(self.backend, []):
            reason = self._check(name, seen)
            if reason is None:
                self.source = SOURCES[name]
                return
            self.refused[name] = reason

    def snapshot(self) -> Scrape | None:
        """Counters before a request, when the source is a counter difference."""
        return self.server.metrics() if self.source.kind == "counter_delta" else None

    def read(self, body: dict[str, Any], completion_tokens: int, before: Scrape | None,
             window: int | None) -> Reading:
        """This request's acceptance, or why there is none; `window` indexes the log's windows."""
        kind, name = self.source.kind, self.source.name
        if kind == "per_request":
            return per_request(name, body, completion_tokens)
        if kind == "counter_delta":
            return counter_delta(name, before, self.server.metrics())
        if kind == "log" and self.log is not None and window is not None:
            got = self.log.read(window)
            if got.avg_commit is None:
                return f"no log line lies wholly in the request's window ({got.straddling} straddling)"
            return Acceptance(got.avg_commit, None, self.source)
        if kind == "windowed_gauge":
            scrape = self.server.metrics()
            values = [v for v in (scrape.values if scrape else {}).get("sglang:spec_accept_length", []) if v > 0]
            return Acceptance(sum(values) / len(values), None, self.source) if values else "the gauge reads 0"
        if kind == "lifetime":
            value = self.server.lifetime_accept_length()
            return Acceptance(value, None, self.source) if value else "no lifetime average"
        return "no acceptance source"
