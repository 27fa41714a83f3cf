"""kernels.c on every ISA this CPU runs: one source, a build per ISA (ddscope.models.builds), chosen at load
and forced by DDSCOPE_ISA. Every build gives fp32 the same bits (vec.h's ops are the same arithmetic lane by
lane), and the lower builds pass the kernel, bf16 and lossless tests in a process of their own, so a CPU
without AVX-512 runs paths CI has run. In C alone (tests/support/kernels_check.c: a scalar reference, and each row
the same bits alone as among others), every build here and the generic build for aarch64, run under qemu-user for
correctness (never for time)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddscope.models import builds, native
from ddscope.peers.venvs import announce, in_ci

TESTS = Path(__file__).resolve().parent
CHECK = TESTS / "support" / "kernels_check.c"
C_FLAGS = tuple(f for f in builds.FLAGS if f not in ("-shared", "-fPIC"))
AARCH64 = {"gcc-aarch64-linux-gnu": "aarch64-linux-gnu-gcc", "qemu-user": "qemu-aarch64"}  # Debian package: tool
BUILDS = builds.runnable_isas()
pytestmark = pytest.mark.skipif(native.library() is None, reason="kernels.c did not build here")


def _on(build: str, monkeypatch: pytest.MonkeyPatch, op: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`op` run on kernels.c's `build`."""
    lib = builds.load(build)
    assert lib is not None and lib.kernels_isa().decode() == build
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: lib)
        return op()


def _ops() -> dict[str, Callable[[], torch.Tensor]]:
    """fp32 calls of every kernel family at shapes that take their tails and several tiles."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 320, generator=g), torch.randn(256, 320, generator=g)
    q = torch.randn(8, 9, 128, generator=g)
    k, v = torch.randn(2, 700, 128, generator=g), torch.randn(2, 700, 128, generator=g)
    mask = torch.rand(9, 700, generator=g) < 0.7
    mask[:, :600] = True
    cos, sin = torch.randn(37, 64, generator=g), torch.randn(37, 64, generator=g)
    gate, up = torch.randn(3, 1000, generator=g), torch.randn(3, 1000, generator=g)
    return {"linear, one row": lambda: native.linear(x[:1], native.panels(w)),
            "linear, a tree's rows": lambda: native.linear(x, native.panels(w)),
            "attend, a decode row": lambda: native.attend(q[:, :1], k, v),
            "attend, a tree under its mask": lambda: native.attend(q, k, v, mask),
            "tree_attend": lambda: native.tree_attend(q, k, v, mask),
            "causal_attend": lambda: native.causal_attend(q, k, v),
            "rms_norm": lambda: native.rms_norm(x, x[0].clone(), 1e-6),
            "norm_rope": lambda: native.norm_rope(x, x[0, :64].clone(), cos, sin, 5, 1e-6),
            "silu_mul": lambda: native.silu_mul(gate, up)}


@pytest.mark.parametrize("build", BUILDS[1:] or ["(no lower build here)"])
def test_every_build_gives_fp32_the_same_bits(build, monkeypatch):
    """A lower build's fp32 products, attention, norms and gate equal the best build's bit for bit."""
    if build not in BUILDS:
        pytest.skip("this CPU runs one build only")
    for name, op in _ops().items():
        best, lower = _on(BUILDS[0], monkeypatch, op), _on(build, monkeypatch, op)
        assert torch.equal(best, lower), f"{name}: {build} differs from {BUILDS[0]}"


@pytest.mark.parametrize("build", BUILDS)
def test_a_build_passes_the_kernel_bf16_and_lossless_tests(build):
    """DDSCOPE_ISA=build in a process of its own: the start-up line names the build, and test_native,
    test_bfloat16 and test_lossless's greedy and seeded cases pass with nothing skipped for want of an ISA
    (the best build runs them in this suite itself)."""
    env = {**os.environ, "DDSCOPE_ISA": build}
    probe = subprocess.run([sys.executable, "-c", "from ddscope.models import native; print(native.kernels())"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0 and probe.stdout.startswith(f"{build} (bf16 "), probe.stderr
    if build == BUILDS[0]:
        return
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           str(TESTS / "test_native.py"), str(TESTS / "test_bfloat16.py"),
                           f"{TESTS / 'test_lossless.py'}::test_greedy_equals_ar"],
                          env=env, capture_output=True, text=True, timeout=900, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    assert not any(word in done.stdout for word in ("AVX", "ISA", "AMX")), done.stdout[-2000:]


def test_ddscope_isa_names_a_build_the_cpu_runs(monkeypatch):
    monkeypatch.setenv("DDSCOPE_ISA", "sse9")
    with pytest.raises(ValueError, match="not a build of kernels.c .one of avx512, avx2, generic"):
        builds.isa()
    monkeypatch.setenv("DDSCOPE_ISA", "AVX512")
    monkeypatch.setattr(builds, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "bmi2"}))
    monkeypatch.setattr(builds.platform, "machine", lambda: "x86_64")
    with pytest.raises(ValueError, match="this CPU lacks avx512bw, avx512dq, avx512f, avx512vl .it runs avx2, generic"):
        builds.isa()
    monkeypatch.setenv("DDSCOPE_ISA", "")
    assert builds.isa() == "avx2"  # the best this CPU runs


def test_low_precision_without_exact_products_is_refused():
    """Without kernels.c, torch's bf16 products give a row other bits among others: the engine refuses bf16
    rather than serve speculation that is not lossless, and says what to do."""
    env = {**os.environ, "DDSCOPE_NATIVE": "0"}
    code = ("from ddscope import Engine\n"
            "for dtype in ('bfloat16', 'float16'):\n"
            "    try:\n        Engine.load(dtype=dtype)\n    except ValueError as e:\n        print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and len(lines) == 2, run.stderr
    assert "bfloat16 on the CPU needs kernels.c's products and kernels.c is not loaded" in lines[0]
    assert all("not be lossless. Use float32." in line for line in lines)


def _c_check(compiler: str, flags: tuple[str, ...], out: Path, *runner: str) -> str:
    """kernels_check.c built with `flags` and run (through `runner`): its output, having passed."""
    subprocess.run([compiler, *C_FLAGS, *flags, f"-I{builds.SOURCE.parent}", str(CHECK), "-o", str(out), "-lm"],
                   check=True, capture_output=True, text=True, timeout=300)
    run = subprocess.run([*runner, str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.rstrip().endswith(" passed, 0 failed"), run.stdout + run.stderr
    return run.stdout


@pytest.mark.parametrize("build", BUILDS)
def test_the_c_checks_pass_on_every_build_here(build, tmp_path):
    out = _c_check(shutil.which("cc") or "gcc", builds.ISAS[build][0], tmp_path / "check")
    assert out.startswith(f"kernels.c's {build} build") and "10 passed" in out


def _aarch64_tools() -> list[str]:
    """The cross compiler and qemu-user, installed from Debian's packages where they are missing and this process
    may (root, with apt-get); the names of those still missing."""
    missing = [package for package, tool in AARCH64.items() if shutil.which(tool) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        announce(f"installing {', '.join(missing)} from Debian's packages, for the aarch64 build's C checks")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], env=env, capture_output=True, timeout=900)
    return [package for package, tool in AARCH64.items() if shutil.which(tool) is None]


def test_the_generic_build_passes_the_c_checks_on_aarch64_under_qemu(tmp_path):
    """The generic build as Arm servers and Apple silicon would compile it (NEON, vectorised by the compiler)."""
    missing = _aarch64_tools()
    if missing:
        why = f"Debian's {', '.join(missing)} could not be installed here"
        if in_ci():
            pytest.fail(f"CI=true, but {why}", pytrace=False)
        pytest.skip(why)
    out = _c_check(AARCH64["gcc-aarch64-linux-gnu"], ("-march=armv8-a",), tmp_path / "check",
                   AARCH64["qemu-user"], "-L", "/usr/aarch64-linux-gnu")
    assert out.startswith("kernels.c's generic build") and "10 passed" in out
