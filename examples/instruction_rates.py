"""How fast this CPU issues AVX-512's bf16 dot product (``vdpbf16ps``), alone and beside the other instructions
the decode-attention kernel runs between its products.

Each figure is a loop of twelve independent chains (no chain waits on its own latency) of one 512-bit
``vdpbf16ps`` plus, where named, one other instruction, unrolled, on one core; it prints nanoseconds per
dot product, best of ``--repeats``. On a CPU that issues one ``vdpbf16ps`` a cycle the first line reads one
cycle; an instruction that shares its execution ports raises it, one that does not leaves it. Built with the
project's compiler flags (``specstack.native``); needs AVX-512 bf16.

    python examples/instruction_rates.py
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

from specstack import native

CHAINS = 12
# name -> the statements one chain i runs per iteration (j: the next chain, so that no statement waits on itself)
BESIDE = {
    "vdpbf16ps alone": [],
    "+ vfmadd (the exponential's polynomial)": ["S{i} = _mm512_fmadd_ps(S{i}, S{j}, S{i});"],
    "+ vmulps": ["S{i} = _mm512_mul_ps(S{i}, S{j});"],
    "+ vaddps": ["S{i} = _mm512_add_ps(S{i}, S{j});"],
    "+ vshuff32x4 (a 16 x 16 transpose's last stages)": ["S{i} = _mm512_shuffle_f32x4(S{i}, S{j}, 0x88);"],
    "+ vunpcklps (its first stages)": ["S{i} = _mm512_unpacklo_ps(S{i}, S{j});"],
    "+ vpermt2w every other product (values by key pairs)": ["if ({i} % 2 == 0) P{i} = _mm512_permutex2var_epi16(P{i}, idx, P{j});"],
    "+ vcvtne2ps2bf16 (weights to bf16)": ["P{i} = (__m512i)_mm512_cvtne2ps_pbh(S{i}, S{j});"],
    "+ vpbroadcastd from memory (a query word)": ["B{i} = _mm512_set1_epi32(words[{i}]);", "A{i} = _mm512_dpbf16_ps(A{i}, a, (__m512bh)B{i});"],
    "+ 512-bit store": ["_mm512_storeu_ps(spill + 16 * {i}, S{i});"],
}


def source() -> str:
    """One C++ function per test, ``rate_<k>(iterations)`` -> seconds, and a dispatcher ``rates``."""
    lines = ["#include <immintrin.h>", "#include <time.h>",
             "static double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }",
             "int words[64]; float spill[16 * 16];"]
    for k, extra in enumerate(BESIDE.values()):
        lines.append(f"static double rate_{k}(long iterations) {{")
        for i in range(CHAINS):
            lines.append(f"  __m512 A{i} = _mm512_set1_ps({i}), S{i} = _mm512_set1_ps(0.5f * {i}); __m512i P{i} = _mm512_set1_epi16({i}), B{i} = P{i};")
        lines.append("  __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a; const __m512i idx = _mm512_set1_epi16(3);")
        lines.append("  const double began = now();")
        lines.append("  for (long n = 0; n < iterations; ++n) {")
        for i in range(CHAINS):
            body = [s.format(i=i, j=(i + 1) % CHAINS) for s in extra]
            if not any(s.startswith(f"A{i} =") for s in body):
                body.insert(0, f"A{i} = _mm512_dpbf16_ps(A{i}, a, b);")
            lines.extend("    " + s for s in body)
        lines.append('    __asm__ volatile("" : "+v"(a));  // a fresh operand each iteration: the loop is not folded')
        lines.append("  }")
        lines.append("  const double seconds = now() - began;")
        sink = " + ".join(f"_mm512_reduce_add_ps(A{i}) + _mm512_reduce_add_ps(S{i}) + _mm512_reduce_add_epi32(_mm512_add_epi32(P{i}, B{i}))" for i in range(CHAINS))
        lines.append(f"  volatile float keep = {sink}; (void)keep;")
        lines.append("  return seconds;")
        lines.append("}")
    lines.append('extern "C" int rates(int test, long iterations, double *seconds) {')
    lines.append("  switch (test) {")
    for k in range(len(BESIDE)):
        lines.append(f"    case {k}: *seconds = rate_{k}(iterations); return 0;")
    lines.append("  }")
    lines.append("  return -1;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "instruction_rates.cpp"
        path.write_text(source())
        built = native.load(path, "rates", [ctypes.c_int, ctypes.c_long, ctypes.POINTER(ctypes.c_double)], cache=Path(scratch))
        if built is None:
            raise SystemExit("the loops did not build here (they need a C++ compiler and AVX-512 bf16)")
        library, _ = built
        seconds = ctypes.c_double()
        for k, name in enumerate(BESIDE):
            best = min((library.rates(k, args.iterations, ctypes.byref(seconds)), seconds.value)[1] for _ in range(args.repeats))
            print(f"{name:55s} {1e9 * best / (args.iterations * CHAINS):.3f} ns per vdpbf16ps")


if __name__ == "__main__":
    main()
