"""The compiled kernels' common wrapper (specstack.native.CompiledLibrary): copied or pickled, each kernel travels
as a request to load it again where it lands."""

import copy
import pickle

import attrs
import pytest

from specstack.compiled_layers import load_compiled_layers
from specstack.decode_attention import load_decode_kernel
from specstack.decoder_ops import load_decoder_ops
from specstack.gather_ops import load_gather_ops
from specstack.native import CompiledLibrary
from specstack.packed_linear import load_rows_kernel

LOADERS = [load_compiled_layers, load_decode_kernel, load_decoder_ops, load_gather_ops, load_rows_kernel]


@pytest.mark.parametrize("loader", LOADERS, ids=lambda loader: loader.__name__)
def test_every_kernel_pickles_and_copies_as_itself_loaded_again(loader) -> None:
    kernel = loader()
    if kernel is None:
        pytest.skip("no C++ compiler here")
    assert isinstance(kernel, CompiledLibrary)
    for again in (pickle.loads(pickle.dumps(kernel)), copy.deepcopy(kernel), copy.copy(kernel)):
        assert type(again) is type(kernel) and again.path == kernel.path and again.library is not None


def test_a_kernel_that_does_not_say_how_it_loads_again_refuses_to_pickle() -> None:
    @attrs.frozen(kw_only=True)
    class Unnamed(CompiledLibrary):
        pass

    kernel = load_decoder_ops()
    if kernel is None:
        pytest.skip("no C++ compiler here")
    with pytest.raises(NotImplementedError, match="Unnamed"):
        copy.deepcopy(Unnamed(library=kernel.library, path=kernel.path))
