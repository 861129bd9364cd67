"""Which way bf16 products go (``specstack.bf16_products``): the bf16 dot products where they do more multiply-adds a
second than FMAs, else widened to float32; measured once per machine and read back after, so that every process
takes the same paths; and both kernels follow it."""

from __future__ import annotations

import json
import shutil

import attrs
import pytest

from specstack import bf16_products, decode_attention, packed_linear
from specstack.bf16_products import ProductRates, dot_products_pay, product_rates
from specstack.decode_attention import load_decode_kernel
from specstack.native import build, find_compiler
from specstack.packed_linear import load_rows_kernel

BUILT = find_compiler() is not None and product_rates() is not None  # the CPU has bf16 dot products, and the timing loops built
needs_dot_products = pytest.mark.skipif(not BUILT, reason="no AVX-512 bf16 dot products here (or no compiler): bf16 is always widened")


def test_the_dot_products_pay_where_they_do_more_multiply_adds_a_second() -> None:
    assert ProductRates(dot_flops=221e9, fma_flops=101e9).dot_products_pay  # the AMD Zen 4 host (oneDNN's GEMMs)
    assert not ProductRates(dot_flops=84e9, fma_flops=174e9).dot_products_pay  # the Intel host with them, no AMX
    assert "widened to float32" in ProductRates(dot_flops=84e9, fma_flops=174e9).describe()
    with pytest.raises(ValueError):
        ProductRates(dot_flops=0.0, fma_flops=1e9)


def test_a_kernel_built_without_them_widens_and_tiles_keep_them() -> None:
    assert not dot_products_pay(built=False, tiles=False)
    assert dot_products_pay(built=True, tiles=True)  # beside AMX tiles, as measured there


@needs_dot_products
def test_the_rates_are_measured_once_and_read_back(tmp_path, monkeypatch) -> None:
    """The first call measures (two loops, milliseconds) and keeps the rates beside the timing library in the cache;
    later calls, in this process or another, read them back and do not measure again."""
    measured = []
    measure = bf16_products.measure_rates
    monkeypatch.setattr(bf16_products, "measure_rates", lambda cache=None: measured.append(1) or measure(cache))
    first = product_rates(tmp_path)
    assert first is not None and first.dot_flops > 0 and first.fma_flops > 0 and measured == [1]
    assert product_rates(tmp_path) == first and measured == [1]
    kept = build(bf16_products.SOURCE, tmp_path).with_suffix(".json")
    assert json.loads(kept.read_text()) == {"dot_flops": first.dot_flops, "fma_flops": first.fma_flops}


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """A kernel cache of this module's own, holding the libraries built in the default one (not its kept rates)."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / "kernels").mkdir()
    for source in (decode_attention.SOURCE, packed_linear.ROWS_SOURCE, bf16_products.SOURCE):
        library = build(source)
        shutil.copy(library, cache / "kernels" / library.name)  # the same name: built from the same source, flags and CPU
    return cache


@needs_dot_products
@pytest.mark.parametrize("pays", [True, False])
def test_both_kernels_follow_the_rates_kept_for_this_machine(kernel_cache, pays) -> None:
    """Rates kept in the cache decide both kernels' bf16 paths (beside AMX tiles the attention's few-row dot products
    stay; the linear kernel's few rows follow the rates there too): rates that favour the dot products give both kernels
    the dot products, rates that favour FMAs give both the widened paths. A rule that ignored the rates, or read them
    the wrong way round, fails one of the two cases; one that kept the linear kernel's dot products beside tiles fails
    the second on a CPU with AMX."""
    kept = build(bf16_products.SOURCE, kernel_cache).with_suffix(".json")
    kept.write_text(json.dumps({"dot_flops": 200e9 if pays else 80e9, "fma_flops": 100e9}))
    attention, rows = load_decode_kernel(kernel_cache), load_rows_kernel(kernel_cache)
    assert attention.dot_products_built and rows.bf16_dots_built
    assert attention.dot_products == (pays or attention.amx)
    assert rows.bf16_dots == pays


def test_a_kernel_built_without_them_cannot_be_told_to_take_them() -> None:
    attention, rows = load_decode_kernel(), load_rows_kernel()
    if attention is None or rows is None:
        pytest.skip("no C++ compiler here")
    if not attention.dot_products_built:
        with pytest.raises(ValueError, match="dot_products=True is not allowed"):
            attrs.evolve(attention, dot_products=True)
    if not rows.bf16_dots_built:
        with pytest.raises(ValueError, match="bf16_dots=True is not allowed"):
            attrs.evolve(rows, bf16_dots=True)
    unbuilt = attrs.evolve(attention, dot_products=False, dot_products_built=False)
    with pytest.raises(ValueError, match="dot_products=True is not allowed"):
        attrs.evolve(unbuilt, dot_products=True)
