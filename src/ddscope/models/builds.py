"""kernels.c's builds: one source (with vec.h) compiled per ISA, which of them this CPU runs, and loading one.
The choice is made here, from /proc/cpuinfo, never inside ISA-flagged code (ggml's lesson: link-time
optimisation once put newer instructions into its detector). AVX-512 (with AMX or AVX512-BF16 for bf16 where the
CPU has them), AVX2 with FMA, or generic C that the compiler vectorises (NEON on aarch64); DDSCOPE_ISA names
another build the CPU runs (a lower one, to test its path). Each build is cached under DDSCOPE_CACHE by its
source, compiler, flags and CPU."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
HEADERS = (Path(__file__).with_name("vec.h"),)
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
# Each ISA's build: the compiler's target flags, and the /proc/cpuinfo flags a CPU needs to run it, best first.
ISAS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512": (("-march=native",), frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    # generic tuning: -mtune=native (Zen 5) scheduled the AVX2 tiles at 0.64 of the FMA peak, generic at 0.88
    "avx2": (("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2"})),
    "generic": (("-mcpu=native",) if platform.machine() in ("aarch64", "arm64") else (), frozenset()),
}
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int  # _T: the threads to run on
_ROW = {"rms_norm": (_P, _P, _P, _I, _I, _F, _T), "norm_rope": (_P, _P, _P, _P, _P, _I, _I, _I, _F, _T),
        "pack": (_P, _P, _I, _I, _T), "linear": (_P, _P, _P, _I, _I, _I, _T), "silu_mul": (_P, _P, _P, _I, _T),
        "attend": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _T),
        "decode_qkv": (_P, _P, _F, _P, _P, _P, _F, *[_P] * 6, *[_I] * 4, _T),
        "decode_rest": (*[_P] * 4, _I, _I, _P, _P, _F, *[_P] * 6, *[_I] * 5, _F, _T),
        "rows_layer": (_P, _P, _F, _P, _P, _P, _F, *[_P] * 4, _I, _I, _P, _P, _P, _F, _P, _P, *[_I] * 6, _F, _T)}
_SIGNATURES = {**{f"{name}_{s}": args for name, args in _ROW.items() for s in DTYPES.values()},
               "tree_attend_f32": (_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _T),
               "causal_attend_f32": (_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F, _T),
               "fma_peak_f32": (_I, _P, _T), "read_peak_f32": (_P, _I, _P, _T),
               "legal_top_f32": (_P, _P, _I, _I, _P, _P)}
_COUNTS = ("legal_top_f32",)  # these return how many they wrote
_RETURNS = {"kernels_isa": ctypes.c_char_p, "fma_peak_flops": ctypes.c_int64, "bf16_products": ctypes.c_int}
_OPTIONAL = {"amx_peak_bf16": (_I, _P, _T), "dp_peak_bf16": (_I, _P, _T), "amx_ready": ()}  # AMX, AVX512-BF16 builds


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, as Linux lists them (empty where it does not)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def runnable_isas() -> list[str]:
    """The builds this CPU can run, best first (generic always)."""
    flags = cpu_flags()
    x86 = platform.machine() in ("x86_64", "AMD64")
    return [isa for isa, (_, needs) in ISAS.items() if (needs <= flags and x86) or not needs]


def isa() -> str:
    """The build this process loads: DDSCOPE_ISA where set (an ISA this CPU runs), else the best it runs."""
    runnable, wanted = runnable_isas(), os.environ.get("DDSCOPE_ISA", "").strip().lower()
    if not wanted:
        return runnable[0]
    if wanted not in ISAS:
        raise ValueError(f"DDSCOPE_ISA={wanted!r}: not a build of kernels.c (one of {', '.join(ISAS)})")
    if wanted not in runnable:
        raise ValueError(f"DDSCOPE_ISA={wanted}: this CPU lacks {', '.join(sorted(ISAS[wanted][1] - cpu_flags()))} "
                         f"(it runs {', '.join(runnable)})")
    return wanted


def _build(compiler: str, flags: tuple[str, ...], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        built = Path(tmp) / out.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(built, out)  # atomic: a concurrent loader sees the old file or the whole new one


@cache
def load(build: str) -> ctypes.CDLL | None:
    """kernels.c's `build` (one of ISAS) as loaded, built if its cache entry is missing; None where it can't be,
    with a warning saying why."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        warnings.warn("no C compiler: ddscope runs kernels.c's ops as torch ops (slower on CPU)", stacklevel=2)
        return None
    flags = (*FLAGS, *ISAS[build][0])
    sources = "|".join(f.read_text() for f in (SOURCE, *HEADERS))
    key = hashlib.sha256("|".join((sources, compiler, *flags, " ".join(sorted(cpu_flags())))).encode()).hexdigest()
    root = Path(os.environ.get("DDSCOPE_CACHE", Path.home() / ".cache" / "ddscope"))
    path = root / "kernels" / f"kernels-{build}-{key[:16]}.so"
    try:
        if not path.is_file():
            _build(compiler, flags, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        warnings.warn(f"kernels.c ({build}) did not build or load ({detail.strip()[:500]}): torch ops run instead",
                      stacklevel=2)
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
    for name in _COUNTS:
        getattr(lib, name).restype = ctypes.c_int64
    for name, restype in _RETURNS.items():
        if hasattr(lib, name):  # an older kernels.c (benchmarks/floor/kernels_ab.py's A) may lack one
            getattr(lib, name).restype, getattr(lib, name).argtypes = restype, ()
    for name, args in _OPTIONAL.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes = args
    return lib
