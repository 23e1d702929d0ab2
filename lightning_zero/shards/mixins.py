"""A class with a mixin in front, keeping the original's name: how ZeRO changes what an object of the user's class
does without changing what ``type(obj).__name__`` and ``isinstance`` say (the user's optimizer's ``zero_grad`` in
``optimizer_support.py``, a released stage 3 parameter in ``stage3/guard.py``)."""

from __future__ import annotations

# [Note: one class per mixin and class]
# The classes made here replace the class of user objects (optimizers, parameters), so they must be made once per
# process and pair: two engines that each made their own would give two objects of one user class different types
# (`type(a) is type(b)` fails, pickled references disagree). Classes live as long as the process anyway.
_CACHE: dict[tuple[type, type], type] = {}


def with_mixin(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin`` in front of it in the MRO, named as ``cls``; made once per pair. ``cls`` itself if it
    already has the mixin."""
    if issubclass(cls, mixin):
        return cls
    if (mixin, cls) not in _CACHE:
        _CACHE[(mixin, cls)] = type(
            cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _CACHE[(mixin, cls)]
