"""Target hidden states from the engine that serves the target: `train-drafter --features-url`.

- vLLM (`ddscope features-server`, or any vLLM with `extract_hidden_states` and a hidden-states connector): a
  completion whose prompt is the token ids, `max_tokens` 1, answers `kv_transfer_params.hidden_states_path`, a
  safetensors file of `hidden_states [T, layers, H]` and `token_ids [T]` on a shared filesystem. It is read under
  a shared flock of `PATH.lock` (vLLM writes asynchronously and holds the exclusive lock until done), then both
  files are deleted. vLLM's id k is the input of layer k: z-lab id i is vLLM id i + 1.
- SGLang 0.5.23 (`--enable-return-hidden-states --enable-return-aux-hidden-states --speculative-algorithm DFLASH
  --return-aux-hidden-state-layer-ids IDS --disable-radix-cache`): `/generate` with `input_ids` and
  `return_hidden_states` answers the states in `meta_info["hidden_states"]` as JSON (details in `_sglang_states`).
  SGLang's id k is z-lab's: the output of layer k (sglang/srt/models/qwen3.py:791, "captures before layer i").

Both give fp32 [T, k*H] in the order of the run's `target_layer_ids`, as the in-process capture does. Files whose
reader was killed are listed in a journal of the work dir and deleted by the next run.
"""
from __future__ import annotations

import fcntl
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import SafetensorError, safe_open

from ddscope.util.atomic import atomic_write_text

LAYER_IDS_KEY = "vllm_aux_layer_ids"  # the metadata ddscope's connector writes (assets/vllm_plugin)
START_HINT = ("start one with `ddscope features-server --target DIR` (vLLM), or SGLang with "
              "--enable-return-hidden-states --enable-return-aux-hidden-states --speculative-algorithm DFLASH "
              "--return-aux-hidden-state-layer-ids IDS --disable-radix-cache --chunked-prefill-size N (N above the "
              "longest sequence)")


ATTEMPTS = 4  # per request, against a refused or dropped connection only: a timeout or an HTTP error is final
RETRIED = (httpx.ConnectError, httpx.RemoteProtocolError)


class FeaturesError(ValueError):
    """The features server cannot give what training needs; the message names the fix."""


class Journal:
    """Paths handed out by the server and not yet deleted: a killed run's leftovers are removed on the next
    start, so the server's storage stays bounded."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            for line in path.read_text().splitlines():
                _remove(line)
        atomic_write_text(path, "")
        self.open: set[str] = set()

    def add(self, name: str) -> None:
        with self.lock:
            self.open.add(name)
            self._write()

    def done(self, name: str) -> None:
        _remove(name)
        with self.lock:
            self.open.discard(name)
            self._write()

    def _write(self) -> None:
        atomic_write_text(self.path, "".join(p + "\n" for p in sorted(self.open)))


def _remove(path: str) -> None:
    for p in (path, path + ".lock"):
        Path(p).unlink(missing_ok=True)


class ServedFeatures:
    """A `FeatureSource` (train_drafter.py) over a live vLLM or SGLang server."""

    def __init__(self, url: str, layer_ids: list[int], work_dir: Path, concurrency: int = 8,
                 timeout_s: float = 600.0, rank: int = 0):
        self.url, self.layer_ids, self.concurrency = url.rstrip("/"), list(layer_ids), concurrency
        self.client = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=concurrency))
        self.sglang_layers: list[int] = []
        self.engine, self.model = self._probe()
        self.journal = Journal(work_dir / f"features.rank{rank}.open")

    def _probe(self) -> tuple[str, str]:
        """("sglang" | "vllm", model name). SGLang answers /server_info (0.5.23's deprecated alias
        /get_server_info too) with its resolved server args (entrypoints/http_server.py:853-888); vLLM does not."""
        try:
            for path in ("/server_info", "/get_server_info"):
                info = self.client.get(f"{self.url}{path}")
                # vLLM answers /server_info too, in its dev mode, with its own config
                if info.status_code == 200 and "vllm_config" not in info.json():
                    self.sglang_layers = _sglang_layers(info.json(), self.url)
                    return "sglang", ""
            models = self.client.get(f"{self.url}/v1/models")
            models.raise_for_status()
            return "vllm", models.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            if isinstance(e, FeaturesError):
                raise
            raise FeaturesError(f"--features-url {self.url}: no vLLM or SGLang answers there "
                                f"({type(e).__name__}: {str(e)[:120]}); {START_HINT}") from None

    def features(self, seqs: list[list[int]]) -> list[torch.Tensor]:
        fetch = self._vllm if self.engine == "vllm" else self._sglang
        if len(seqs) <= 1:
            return [fetch(s) for s in seqs]
        with ThreadPoolExecutor(min(self.concurrency, len(seqs))) as pool:
            futures = [pool.submit(fetch, s) for s in seqs]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:  # the first failure ends the batch: no more requests sent for it
                    f.cancel()
                raise

    def close(self) -> None:
        self.client.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in range(ATTEMPTS):
            try:
                r = self.client.post(f"{self.url}{path}", json=body)
                break
            except httpx.TransportError as e:  # e.g. a keep-alive connection the server closed as it was reused
                if attempt == ATTEMPTS - 1 or not isinstance(e, RETRIED):
                    raise FeaturesError(f"--features-url {self.url}: {type(e).__name__} on {path} after "
                                        f"{attempt + 1} attempt(s): {str(e)[:160]} (a timeout: raise "
                                        "--features-timeout)") from None
                time.sleep(0.5 * 2 ** attempt)
        if r.status_code != 200:
            raise FeaturesError(f"--features-url {self.url}{path} answered {r.status_code}: {r.text[:200]}")
        return r.json()

    def _vllm(self, ids: list[int]) -> torch.Tensor:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        params = self._post("/v1/completions", body).get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise FeaturesError(f"--features-url {self.url}: the vLLM there returns no hidden states "
                                f"(no kv_transfer_params.hidden_states_path); {START_HINT}")
        self.journal.add(path)
        try:
            states, tokens, captured = _read_locked(path)
        finally:
            self.journal.done(path)
        _check_tokens(tokens, ids, self.url)
        return self._select(states, captured, offset=1)

    def _sglang(self, ids: list[int]) -> torch.Tensor:
        body = {"input_ids": ids, "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        meta = self._post("/generate", body).get("meta_info") or {}
        states = _sglang_states(meta, len(ids), len(self.sglang_layers), self.url)
        return self._select(states, self.sglang_layers, offset=0)  # SGLang's id k is z-lab's: layer k's output

    def _select(self, states: torch.Tensor, captured: list[int] | None, offset: int) -> torch.Tensor:
        """[T, k*H] for the run's layer ids from [T, layers, H] holding `captured` (engine ids: z-lab + offset;
        None = not recorded, then the server must hold exactly the run's layers)."""
        want = [i + offset for i in self.layer_ids]
        if captured is None:
            if states.shape[1] != len(want):
                raise FeaturesError(f"--features-url {self.url}: the server captures {states.shape[1]} layers and "
                                    f"does not say which; this run needs {len(want)} (--target-layer-ids "
                                    f"{self.layer_ids}): serve exactly those, or use ddscope features-server")
            captured = sorted(want)
        absent = [i - offset for i in want if i not in captured]
        if absent:
            have = [c - offset for c in captured]
            raise FeaturesError(f"--features-url {self.url}: the server does not capture z-lab layer ids {absent} "
                                f"(it captures {have}); restart it with them, or pick --target-layer-ids from {have}")
        return torch.cat([states[:, captured.index(i)] for i in want], dim=-1).to(torch.float32)


def _read_locked(path: str) -> tuple[torch.Tensor, list[int], list[int] | None]:
    """(hidden_states [T, layers, H], token_ids, the vLLM layer ids recorded, if any), once the writer is done."""
    try:
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # sleeps while vLLM still writes
            with safe_open(path, framework="pt") as st:
                recorded = (st.metadata() or {}).get(LAYER_IDS_KEY)
                return st.get_tensor("hidden_states"), st.get_tensor("token_ids").tolist(), \
                    json.loads(recorded) if recorded else None
    except FileNotFoundError:
        raise FeaturesError(f"hidden states file {path} (or its .lock) is not on this machine: the trainer must "
                            "share the server's --storage filesystem, mounted at the same path") from None
    except (SafetensorError, OSError) as e:
        raise FeaturesError(f"hidden states file {path} is unreadable ({type(e).__name__}: {str(e)[:120]}): is "
                            "the server's --storage full, or another trainer deleting its files?") from None


def _check_tokens(got: list[int], sent: list[int], url: str) -> None:
    if got != sent:
        at = next((k for k, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent)))
        raise FeaturesError(f"--features-url {url}: token ids do not round-trip (sent {len(sent)}, the states are "
                            f"for {len(got)}, first difference at {at}): the server must take the prompt as token "
                            "ids unchanged (no BOS added, the same target)")


def _sglang_layers(info: dict[str, Any], url: str) -> list[int]:
    """The layers an SGLang server captures, from its /server_info (sglang/srt/arg_groups/fields/exec_.py:130-157)."""
    ids = info.get("return_aux_hidden_state_layer_ids")
    if not info.get("enable_return_aux_hidden_states") or not ids:
        raise FeaturesError(f"--features-url {url}: this SGLang returns no aux hidden states; start it with "
                            "--enable-return-aux-hidden-states --speculative-algorithm DFLASH "
                            "--return-aux-hidden-state-layer-ids IDS (the layer ids spelled out)")
    return sorted(set(int(i) for i in ids))  # captured in forward order (sglang/srt/models/qwen3.py:524-531)


def _sglang_states(meta: dict[str, Any], n: int, layers: int, url: str) -> torch.Tensor:
    """[n, layers, H] from `meta_info["hidden_states"]`: one entry per completion token, the first the prefill's
    [T][layers*H] block, the aux layers concatenated (managers/scheduler_components/batch_result_processor.py:
    647-661, layers/aux_hidden_states.py:97-102 in sglang 0.5.23). T counts only the tokens this forward ran: a
    radix-cache hit or chunked prefill drops the others (scheduler.py:4885-4888)."""
    entries = meta.get("hidden_states")
    if not entries:
        raise FeaturesError(f"--features-url {url}: SGLang answered no hidden_states; start it with "
                            "--enable-return-hidden-states as well")
    block = torch.tensor(entries[0], dtype=torch.float32)
    if block.dim() != 2 or block.shape[0] != n:
        got = block.shape[0] if block.dim() == 2 else 0
        raise FeaturesError(f"--features-url {url}: SGLang returned states for {got} of {n} prompt tokens (a "
                            "prefix-cache hit or a chunked prefill drops the rest): start it with "
                            "--disable-radix-cache and --chunked-prefill-size above the longest sequence")
    if block.shape[1] % layers:
        raise FeaturesError(f"--features-url {url}: SGLang's rows of {block.shape[1]} values do not split into "
                            f"its {layers} captured layers")
    return block.view(n, layers, -1)
