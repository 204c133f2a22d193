"""Inductor fallbacks for the ``coda::`` ops, registered when Inductor's lowering table loads.

Inductor has no lowering for a custom op, so it makes an implicit fallback (an extern kernel
call) the first time it meets one. Before doing so, torch releases up to 2.14 format a log
message of the op's arguments even when logging is off, and that text prints the IR of every
input, which repeats the graph shared below it: its length grows exponentially with the number
of layers, and a whole-model ``torch.compile(fullgraph=True)`` spends minutes on it at a few
layers' depth. Registering the same fallback up front, with the layout constraint Inductor
would pick itself (the op's tag, else the default), gives the identical graph without the
message.

Importing ``torch._inductor.lowering`` takes seconds, so ``import coda`` does not do it: a
finder on ``sys.meta_path`` registers the fallbacks right after that module's own import (or at
once, when it is already loaded), i.e. only in processes that compile with Inductor; a
``find_spec`` probe of the module before its import does not use it up.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

import torch

_LOWERING = "torch._inductor.lowering"
_NAMESPACE = "coda"


def _coda_overloads() -> list:
    ops = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != _NAMESPACE:
            continue
        base, _, overload = name.partition(".")
        packet = getattr(getattr(torch.ops, _NAMESPACE), base)
        ops.append(getattr(packet, overload or "default"))
    return ops


def register_fallbacks() -> list:
    """Registers an Inductor fallback for every ``coda::`` op without a lowering or a
    decomposition (ops with a CompositeImplicitAutograd kernel decompose before Inductor and are
    left alone). Returns the ops registered."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    registered = []
    for op in _coda_overloads():
        if op in lowering.lowerings or op in lowering.decompositions:
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
            continue
        tag = get_layout_constraint_tag(op, with_default=True)
        lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag),
                               warn=False)
        registered.append(op)
    return registered


def _register_or_warn() -> None:
    try:
        register_fallbacks()
    except Exception as e:  # an internal API moved: compile still works, only slower at depth
        warnings.warn(f"coda: could not register Inductor fallbacks for the coda ops ({e!r}); "
                      "torch.compile still works, but a deep fullgraph compile may be slow",
                      stacklevel=2)


class _AfterLoweringImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._inductor.lowering`` through the other finders and wraps its loader so the
    fallbacks are registered right after the module executes. It stays on ``sys.meta_path``
    (answering None for every other name, and for everything once it has fired): removing it
    while another thread iterates the list could make that thread skip a finder."""

    def __init__(self) -> None:
        self.fired = False

    def find_spec(self, fullname, path, target=None):
        if self.fired or fullname != _LOWERING:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisteringLoader(spec.loader, self)
            return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader, finder: _AfterLoweringImport) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec):
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # the module's loader is the real one (get_source, get_filename, reload)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.fired = True
        _register_or_warn()


def install() -> None:
    if _LOWERING in sys.modules:
        _register_or_warn()
    elif not any(isinstance(f, _AfterLoweringImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLoweringImport())
