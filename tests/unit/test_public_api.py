"""The public surface (``modelpar.__all__``): every name resolves, the pure parts import no torch, internals stay private."""

import importlib
import inspect

import pytest

import modelpar


def test_every_public_name_resolves():
    for name in modelpar.__all__:
        assert getattr(modelpar, name) is not None, name
    assert set(modelpar.__all__) <= set(dir(modelpar))
    with pytest.raises(AttributeError, match="no_such_name"):
        modelpar.no_such_name


def test_reference_call_forms():
    assert list(modelpar.clock_cycles(2, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    assert list(inspect.signature(modelpar.Pipe).parameters)[:3] == ["stages", "devices", "split_size"]
    assert modelpar.Schedule is modelpar.get_schedule("gpipe", ranks=2, microbatches=2).__class__


# internals a user has no business importing from a package (they stay importable from their module)
INTERNAL = {
    "modelpar.checkpoint": ["FORMAT", "MARKER", "META", "LOCK", "leftovers", "remove_leftovers", "lock_holder"],
    "modelpar.schedules": ["rendezvous", "parse_op"],
    "modelpar.costmodel": ["divisors"],
}


@pytest.mark.parametrize("package", sorted(INTERNAL))
def test_internals_not_exported(package):
    module = importlib.import_module(package)
    assert not set(INTERNAL[package]) & set(module.__all__)


@pytest.mark.parametrize("package", ["modelpar", "modelpar.bench", "modelpar.calibrate", "modelpar.checkpoint",
                                     "modelpar.costmodel", "modelpar.distributed", "modelpar.model",
                                     "modelpar.pipeline", "modelpar.recompute", "modelpar.schedules",
                                     "modelpar.simulate", "modelpar.tensor_parallel", "modelpar.text",
                                     "modelpar.training"])
def test_one_export_style(package):
    """Every package lists its names in ``__all__``, and each listed name resolves."""
    module = importlib.import_module(package)
    assert isinstance(module.__all__, list) and module.__all__
    for name in module.__all__:
        getattr(module, name)


def test_all_lists_the_lazy_names():
    assert set(modelpar.__all__) == {"__version__", *modelpar._HOME}
