"""The fallback path (torch's ops for everything: a CPU without AVX-512, or `DDSCOPE_NATIVE=0`) against the native
kernels, side by side: each arm a process of its own (the kernels are chosen when the library loads), alternating
`--rounds` times; each process decodes the same prompts greedily and reports the engine's own decode tok/s.

    python benchmarks/engine/fallback_speed.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ARM = r"""
import json, sys, torch
from pathlib import Path
from ddscope import Engine
from ddscope.models import native
torch.set_num_threads(1)
target = sys.argv[1]
engine = Engine.load() if target == "demo" else Engine.load(Path(target), Path(sys.argv[2]))
out = {"native": native.library() is not None}
for method in ("ar", "ddtree"):
    engine.generate("def fib(n):", max_new_tokens=16, method=method, budget=32, ignore_eos=True)  # warm-up
    rates = []
    for prompt in ("def fib(n):", "The history of distributed systems", "import os\nimport sys\n"):
        s = engine.generate(prompt, max_new_tokens=96, method=method, budget=32, ignore_eos=True).stats
        rates.append(s.committed_tokens / s.decode_s)
    out[method] = sorted(rates)[1]
print(json.dumps(out))
"""


def arm(native: bool, target: str, drafter: str) -> dict:
    env = {**os.environ, "DDSCOPE_NATIVE": "1" if native else "0"}
    done = subprocess.run([sys.executable, "-c", ARM, target, drafter], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from ddscope.bench.limit.hardware import cpu_model
    from ddscope.bench.synthetic_models import make_drafter, make_target

    tmp = Path(tempfile.mkdtemp(prefix="fallback-"))
    big = make_target(tmp / "target", hidden=1024, layers=8)  # about 300 MB of fp32: past the caches
    models = {"demo pair": ("demo", ""), "random Qwen3, 1024 x 8 layers": (str(big), str(make_drafter(tmp / "d", big)))}
    print(f"CPU: {cpu_model()}; 1 thread, fp32, greedy, 96 tokens, median of 3 prompts a process, "
          f"{args.rounds} alternations\n")
    print("| model | method | native tok/s | fallback tok/s | fallback / native |")
    print("|---|---|---|---|---|")
    for name, (target, drafter) in models.items():
        runs = {True: [], False: []}
        for r in range(args.rounds):
            for native in ((True, False) if r % 2 == 0 else (False, True)):
                got = arm(native, target, drafter)
                assert got["native"] == native, "the arm did not run the path it was asked for"
                runs[native].append(got)
        for method in ("ar", "ddtree"):
            n, f = (statistics.median(x[method] for x in runs[k]) for k in (True, False))
            print(f"| {name} | {method} | {n:.0f} | {f:.0f} | {f / n:.2f}x |")


if __name__ == "__main__":
    main()
