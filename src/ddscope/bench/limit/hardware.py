"""What one accelerator can read and compute: named cards from their datasheets, `custom:`, or `host`.

Rates are peaks a vendor states, so a step timed against them is a floor: dense (not 2:4 sparse) tensor
FLOPs, and the interconnect per card and per direction (a ring all-reduce sends and receives at once, so
the per-direction rate is what bounds it). A dtype without a stated rate takes the card's bf16 rate,
which is at least as fast (an fp32 model on a GPU): the floor stays a lower bound.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ddscope.util.atomic import atomic_write_text


class HardwareError(ValueError):
    """An unknown or malformed --hardware."""


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_gbps: float                 # memory, GB/s
    tflops: dict[str, float]              # dense peak by dtype: bf16, fp8, fp32
    link_gbps: float | None = None        # to peers, per card and direction, GB/s
    link: str = ""                        # what the link is
    source: str = ""                      # where the numbers come from
    measured: dict[str, Any] = field(default_factory=dict)

    def rate(self, dtype: str) -> float:
        """FLOP/s for matmuls in `dtype`; an unlisted one runs at bf16's (fp16 and int weights dequantized)."""
        return 1e12 * self.tflops.get(dtype, self.tflops["bf16"])

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in ({}, "", None)}


# Dense peaks from each vendor's datasheet ("with sparsity" figures halved); links per card and direction.
# NVLink 4 (H100/H200 SXM) is "900 GB/s" per GPU both ways together, NVLink 5 "1.8 TB/s"; PCIe 5.0 x16 is "128 GB/s"
# both ways, 4.0 x16 "64 GB/s". Where vendors' own pages differ, the higher rate is kept: a floor must stay below.
CARDS: dict[str, Hardware] = {h.name: h for h in (
    # nvidia.com/en-us/data-center/h100/ (SXM): 3.35 TB/s; BF16 1,979 and FP8 3,958 TFLOPS with sparsity; NVLink 900 GB/s
    Hardware("h100", 3350, {"bf16": 989.4, "fp8": 1979}, 450, "NVLink 4", "NVIDIA H100 datasheet, SXM"),
    # same page, H100 PCIe: 2 TB/s; BF16 1,513 and FP8 3,026 TFLOPS with sparsity; PCIe 5.0 x16 (a bridged pair: 600 GB/s)
    Hardware("h100-pcie", 2000, {"bf16": 756, "fp8": 1513}, 64, "PCIe 5.0 x16", "NVIDIA H100 datasheet, PCIe"),
    # nvidia.com/en-us/data-center/h200/ (SXM): 4.8 TB/s; BF16 1,979 and FP8 3,958 TFLOPS with sparsity; NVLink 900 GB/s
    Hardware("h200", 4800, {"bf16": 989.4, "fp8": 1979}, 450, "NVLink 4", "NVIDIA H200 datasheet, SXM"),
    # nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU): 7.7 TB/s there, 8 TB/s in DGX B200's 64 TB/s over 8 GPUs;
    # FP16/BF16 4.5 PFLOPS and FP8 9 PFLOPS with sparsity; NVLink 5 1.8 TB/s
    Hardware("b200", 8000, {"bf16": 2250, "fp8": 4500}, 900, "NVLink 5", "NVIDIA HGX/DGX B200 datasheets, per GPU"),
    # nvidia.com/en-us/data-center/hgx/ (HGX B300, per GPU): 7.7-8 TB/s; BF16 and FP8 as B200's (Blackwell Ultra raises
    # FP4); NVLink 5 1.8 TB/s
    Hardware("b300", 8000, {"bf16": 2250, "fp8": 4500}, 900, "NVLink 5", "NVIDIA HGX B300 datasheet, per GPU"),
    # nvidia.com/en-us/products/workstations/professional-desktop-gpus/rtx-pro-6000/: 1,792 GB/s GDDR7 (the Server
    # Edition's page may list less); 4,000 FP4 TOPS with sparsity, so BF16 ~504 and FP8 ~1,008 dense; PCIe 5.0 x16
    Hardware("rtx-pro-6000", 1792, {"bf16": 503.8, "fp8": 1007.6}, 64, "PCIe 5.0 x16", "NVIDIA RTX PRO 6000 Blackwell"),
    # nvidia.com/en-us/data-center/l40s/: 864 GB/s; BF16 362.05 and FP8 733 TFLOPS dense; PCIe 4.0 x16
    Hardware("l40s", 864, {"bf16": 362.05, "fp8": 733}, 32, "PCIe 4.0 x16", "NVIDIA L40S datasheet"),
    # nvidia.com/.../a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf (80 GB SXM): 2,039 GB/s; BF16 312
    # TFLOPS dense; no FP8; NVLink 3 600 GB/s
    Hardware("a100", 2039, {"bf16": 312}, 300, "NVLink 3", "NVIDIA A100 datasheet, 80 GB SXM"),
    # amd.com/en/products/accelerators/instinct/mi300/mi300x.html: 5.3 TB/s; BF16 1,307.4 and FP8 2,614.9 TFLOPS dense;
    # Infinity Fabric 7 links of 128 GB/s both ways: 64 a direction to one peer, 448 to all seven at once
    Hardware("mi300x", 5300, {"bf16": 1307.4, "fp8": 2614.9}, 448, "Infinity Fabric", "AMD Instinct MI300X datasheet"),
    # amd.com/en/products/accelerators/instinct/mi300/mi325x.html: 6 TB/s; compute and links as MI300X's
    Hardware("mi325x", 6000, {"bf16": 1307.4, "fp8": 2614.9}, 448, "Infinity Fabric", "AMD Instinct MI325X datasheet"),
    # nvidia.com/en-us/geforce/graphics-cards/50-series/rtx-5090/ and NVIDIA's RTX Blackwell GPU architecture paper:
    # 1,792 GB/s; BF16 209.5 TFLOPS dense (FP32 accumulate, GeForce's half rate); FP8 419; PCIe 5.0 x16
    Hardware("rtx-5090", 1792, {"bf16": 209.5, "fp8": 419}, 64, "PCIe 5.0 x16", "NVIDIA RTX Blackwell architecture"),
)}


def parse_custom(spec: str) -> Hardware:
    """`custom:bw=GBps,flops=TFLOPS[,fp8=TFLOPS][,link=GBps]`."""
    fields: dict[str, float] = {}
    for item in spec.split(":", 1)[1].split(","):
        key, _, value = item.partition("=")
        try:
            fields[key.strip()] = float(value)
        except ValueError:
            raise HardwareError(f"--hardware {spec!r}: {item!r} is not KEY=NUMBER") from None
    unknown = set(fields) - {"bw", "flops", "fp8", "link"}
    if unknown or not {"bw", "flops"} <= set(fields) or min(fields.values(), default=0) <= 0:
        raise HardwareError(f"--hardware {spec!r}: expected custom:bw=GBps,flops=TFLOPS[,fp8=TFLOPS][,link=GBps], "
                            f"each > 0")
    tflops = {"bf16": fields["flops"], **({"fp8": fields["fp8"]} if "fp8" in fields else {})}
    return Hardware("custom", fields["bw"], tflops, fields.get("link"), "custom", "--hardware " + spec)


def hardware_named(name: str) -> Hardware:
    """A card by name, `custom:...`, or `host[:THREADS]` (this machine, measured once and cached)."""
    if name == "host" or name.startswith("host:"):
        threads = name.partition(":")[2]
        if threads and not (threads.isdigit() and int(threads) >= 1):
            raise HardwareError(f"--hardware {name!r}: expected host or host:THREADS (an integer >= 1)")
        return host(int(threads) if threads else None)
    if name.startswith("custom:"):
        return parse_custom(name)
    if name not in CARDS:
        raise HardwareError(f"unknown hardware {name!r}; known: {', '.join(CARDS)}, host[:THREADS], "
                            f"custom:bw=GBps,flops=TFLOPS[,link=GBps]")
    return CARDS[name]


# ---- this machine, measured -----------------------------------------------------------------------

LOOP_SECONDS = 0.05  # each timed run of a peak loop
PRODUCT_SECONDS = 1.0  # the most a product timed for the host's FLOPs takes, where kernels.c has no loop
HOST_METHOD = "units-or-sized-product-read-best"  # in the cache's key: a host measured another way is measured again


def _best_s(fn, repeats: int) -> float:
    """The least time of `repeats` runs after one warm-up: other load only adds time."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _loop_tflops(kind: str, threads: int) -> float:
    """The peak of `kind`'s units on `threads` threads, from kernels.c's register-only loop run about
    LOOP_SECONDS; 0 where kernels.c has none here (ddscope.models.peaks.units)."""
    from ddscope.models import peaks

    loop = peaks.units(kind)
    if loop is None:
        return 0.0
    run, flops = loop
    probe = 10_000
    steps = max(probe, int(probe * LOOP_SECONDS / _best_s(lambda: run(probe, threads), 1)))
    return threads * steps * flops / _best_s(lambda: run(steps, threads), 5) / 1e12


def _product_tflops(dtype: Any) -> float:
    """A library's square matmul in `dtype`, sized from a 256-cube's time to take about PRODUCT_SECONDS (at most
    2048): torch emulates bf16 products on CPUs without bf16 instructions, where a 2048-cube takes minutes."""
    import torch

    def rate(n: int, repeats: int) -> tuple[float, float]:
        a = torch.ones(n, n, dtype=dtype)
        s = _best_s(lambda: torch.mm(a, a), repeats)
        return 2 * n ** 3 / s / 1e12, s
    small, seconds = rate(256, 1)
    n = min(2048, int(256 * (PRODUCT_SECONDS / seconds) ** (1 / 3)) // 256 * 256)
    return max(small, rate(n, 3)[0]) if n > 256 else small


def cpu_model() -> str:
    """The CPU's model name, as lscpu prints it (x86 Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _say(message: str) -> None:
    print(f"measuring the host: {message}", file=sys.stderr, flush=True)


def measure_host(threads: int, say: Callable[[str], None] = _say) -> Hardware:
    """Memory bandwidth and fp32/bf16 FLOPs on `threads` torch threads, each unit measured the fastest way there
    is here, with `say` told each step. Bandwidth: the fastest of a batch-1 matrix-vector product (a decode step's
    weight read), a plain sum and kernels.c's read alone, over 1 GiB, far past any cache (minutes apart on one VM,
    a matrix-vector product read 19.6 GB/s and a sum 30.4). FLOPs: kernels.c's register-only loop on the units
    each dtype's products run on (ddscope.models.peaks: at least a library's rate, and a floor must stay below
    every kernel; on an Emerald Rapids VM, oneMKL's fp32 measured a median 0.84 of the FMA loop and its bf16 0.40
    of AMX's), else a library's matmul sized to take about a second; for widened bf16, the faster of the two."""
    import torch

    from ddscope.models import builds, native, peaks

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        say(f"memory bandwidth over 1 GiB, {threads} thread(s)")
        matrix = torch.ones(32768, 8192)  # 1 GiB of fp32, past any cache; written once, so no page fault is timed
        vector, read = torch.ones(8192), peaks.read()
        reads = {"mv": _best_s(lambda: torch.mv(matrix, vector), 5), "sum": _best_s(lambda: matrix.sum(), 5)}
        if read is not None:
            reads["read"] = _best_s(lambda: read(matrix, threads), 5)
        flops, how = {}, {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            loop = 0.0
            if peaks.units(name) is not None:
                say(f"{name} FLOPs, kernels.c's {builds.isa()} loop")
                loop, how[name] = round(_loop_tflops(name, threads), 4), f"kernels.c {builds.isa()} loop"
            if loop == 0.0 or (name == "bf16" and native.bf16_products() == "widened"):
                # bf16 widened runs on the FMA units, and torch's bf16 may run on faster ones (a lower ISA forced
                # on a CPU with AVX512-BF16 or AMX): the floor takes the faster of the two
                say(f"{name} FLOPs, torch's matmul sized to about {PRODUCT_SECONDS:g} s")
                product = round(_product_tflops(dtype), 4)
                if product > loop:
                    loop, how[name] = product, "torch matmul"
            flops[name] = loop
    finally:
        torch.set_num_threads(before)
    gbps = {name: round(matrix.numel() * 4 / s / 1e9, 2) for name, s in reads.items()}
    return Hardware("host", max(gbps.values()), flops, None, "", f"measured on {cpu_model()}, {threads} thread(s)",
                    {"cpu": cpu_model(), "threads": threads, "torch": torch.__version__, "read_gbps": gbps,
                     "tflops_by": how, "at": time.strftime("%Y-%m-%dT%H:%M:%S")})


def faster(a: Hardware, b: Hardware) -> Hardware:
    """`a` with the higher bandwidth and FLOP rates of two measurements of one machine: the stricter floor."""
    return replace(a, bandwidth_gbps=max(a.bandwidth_gbps, b.bandwidth_gbps),
                   tflops={k: max(v, b.tflops.get(k, 0.0)) for k, v in a.tflops.items()})


def host(threads: int | None = None, remeasure: bool = False) -> Hardware:
    """This machine, measured on `threads` torch threads; by default on every CPU this process may use, the
    most a step of `ddscope serve` takes (a long prefill or a batch takes the idle CPUs), so the floor bounds
    every step. The best rates ever measured for this CPU model and thread count, kept in DDSCOPE_CACHE: a
    measurement taken while the machine was busy reads low, and a floor must not be set by it. `remeasure`
    (when a step beat the floor) measures again and keeps the better of each rate."""
    threads = threads or len(os.sched_getaffinity(0))
    path = _host_cache(threads)
    try:
        best = Hardware(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        best = None
    if best is not None and not remeasure:
        return best
    hw = measure_host(threads) if best is None else faster(measure_host(threads), best)
    with contextlib.suppress(OSError):  # an unwritable cache costs a re-measure next time, nothing else
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(asdict(hw), indent=1))
    return hw


def _host_cache(threads: int) -> Path:
    root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
    from ddscope.models import builds, native

    build = builds.isa() if native.library() is not None else "torch"  # a forced lower ISA has lower peaks
    key = hashlib.sha1(f"{cpu_model()}|{threads}|{HOST_METHOD}|{build}".encode()).hexdigest()[:16]
    return root / f"host-floor-{key}.json"
