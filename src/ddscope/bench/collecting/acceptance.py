"""Choosing one acceptance source per sweep from the probe, then reading it for every request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddscope.bench.collecting.acceptance_sources import NONE, ORDER, SOURCES, Acceptance, AcceptanceSource
from ddscope.bench.collecting.backends import Reading, Scrape, Server, counter_delta, per_request
from ddscope.bench.collecting.server_log import WindowReading

# Sources read on another route than the OpenAI one the sweep uses by default.
SOURCE_ROUTE = {"sglang.generate": "generate"}
GAUGE = "sglang:spec_accept_length"
SCRAPED_AFTER = {"counter_delta", "windowed_gauge"}  # kinds that read /metrics after the request


@dataclass
class Observation:
    """One request as the sources see it: its body, the /metrics scrapes around it, its log window."""
    body: dict[str, Any]
    completion_tokens: int
    before: Scrape | None
    after: Scrape | None
    log: WindowReading | None = None  # None: no server log followed


class NoValue(str):
    """Why a source that is there gave no value for this request (a gauge still at 0, a log window
    without a line): the probe accepts the source, a request records the reason."""


class AcceptanceReader:
    """Per backend, the first source in `ORDER` the probe shows working; why each earlier one was
    refused is kept for the results and the printed header."""

    def __init__(self, backend: str, server: Server):
        self.backend, self.server = backend, server
        self.source = NONE
        self.refused: dict[str, str] = {}

    @property
    def route(self) -> str:
        return SOURCE_ROUTE.get(self.source.name, "openai")

    def _reading(self, source: AcceptanceSource, obs: Observation) -> Reading:
        """`source`'s acceptance for one observed request, or why it gives none."""
        match source.kind:
            case "per_request":
                return per_request(source.name, obs.body, obs.completion_tokens)
            case "counter_delta":
                return counter_delta(source.name, obs.before, obs.after, obs.completion_tokens)
            case "log":
                if obs.log is None:
                    return "no --server-log or --log-cmd given"
                if obs.log.avg_commit is None:
                    return NoValue(f"no log line lies wholly in the request's window "
                                   f"({obs.log.straddling} straddling)")
                return Acceptance(obs.log.avg_commit, None, source)
            case "windowed_gauge":
                if obs.after is None or GAUGE not in obs.after.values:
                    return f"/metrics has no {GAUGE}"
                values = [v for v in obs.after.values[GAUGE] if v > 0]
                return Acceptance(sum(values) / len(values), None, source) if values else NoValue("the gauge reads 0")
            case "lifetime":
                value = self.server.lifetime_accept_length()
                return Acceptance(value, None, source) if value else "no internal_states[].avg_spec_accept_length"
        return "no acceptance source"

    def _check(self, name: str, seen: dict[str, Observation | str]) -> str | None:
        """None when the source works on the probe, else why not. `seen` maps a route to its probe
        observation, or to why that route was not probed."""
        obs = seen.get(SOURCE_ROUTE.get(name, "openai"), "not probed")
        if isinstance(obs, str):
            return obs
        got = self._reading(SOURCES[name], obs)
        return None if isinstance(got, (Acceptance, NoValue)) else got

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
             log: WindowReading | None) -> Reading:
        """This request's acceptance, or why there is none; `log` is its window's reading."""
        after = self.server.metrics() if self.source.kind in SCRAPED_AFTER else None
        return self._reading(self.source, Observation(body, completion_tokens, before, after, log))
