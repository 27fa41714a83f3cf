"""Every sampling field's default and check, in one place: the server's schema, `engine.request.Request`, the
`generate` command and `speculative.sampling.SamplingParams` read them from here. Imports no torch."""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddscope.config import read_json

# Below this temperature sampling is greedy, as in vLLM (_SAMPLING_EPS, vllm/sampling_params.py): logits / T
# overflows to inf for T under about 1e-36, and log_softmax then gives NaN and an arbitrary token.
GREEDY_BELOW = 1e-5
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class Knob:
    """One sampling field: its default where a request leaves it unset, and the check every value passes (`rule`
    says it in a 400's words)."""
    default: Any
    ok: Callable[[Any], bool]
    rule: str

    def check(self, name: str, value: Any) -> str | None:
        """Why `value` cannot be this field's, or None."""
        return None if self.ok(value) else f"{name} must be {self.rule}, got {value!r:.100}"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(v: Any) -> bool:
    """An int, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


# Every sampling field, with the target's law's penalties (ddscope.speculative.law), in vLLM's ranges.
# temperature: the library's default is 0.0, greedy, so that `Engine.generate(prompt)` gives the target's own argmax,
# the same under every method and with no seed (what the tests and benchmarks compare token by token). The server's
# default is `served_temperature`: the model's generation_config.json where it sets one, as vLLM reads it
# (`--generation-config auto`), else the OpenAI API's 1.0.
SAMPLING: dict[str, Knob] = {
    "temperature": Knob(0.0, lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "top_p": Knob(1.0, lambda v: _number(v) and 0 < v <= 1, "in (0, 1]"),
    "top_k": Knob(0, lambda v: integer(v) and v >= -1, "an integer >= -1 (0 or -1: off, as vLLM)"),
    "min_p": Knob(0.0, lambda v: _number(v) and 0 <= v <= 1, "in [0, 1]"),
    "seed": Knob(None, lambda v: v is None or integer(v) and 0 <= v <= MAX_SEED, f"None or in [0, {MAX_SEED}]"),
    "repetition_penalty": Knob(1.0, lambda v: _number(v) and v > 0, "greater than zero"),
    "presence_penalty": Knob(0.0, lambda v: _number(v) and -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": Knob(0.0, lambda v: _number(v) and -2 <= v <= 2, "in [-2, 2]"),
}
API_TEMPERATURE = 1.0  # OpenAI's default, the server's where the model's generation_config.json sets none


def served_temperature(model_dir: str | Path) -> float:
    """The server's temperature for a request that sends none: the model's generation_config.json `temperature`
    where it has one (vLLM's default, `--generation-config auto`), else the API's 1.0."""
    found = _generation_temperature(str(model_dir))
    return API_TEMPERATURE if found is None else found


@functools.lru_cache(maxsize=8)
def _generation_temperature(model_dir: str) -> float | None:
    path = Path(model_dir) / "generation_config.json"
    value = read_json(path).get("temperature") if path.is_file() else None
    return float(value) if _number(value) and value >= 0 else None


def default(name: str) -> Any:
    return SAMPLING[name].default
