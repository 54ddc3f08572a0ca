"""Process-wide integer keys for the objects a call may name by number.

torch's custom operators (``numba_flash.torch``) take tensors and plain values, so a ``BlockMask`` or a
``mods.Mod`` crosses them as an integer.  The key is given when the object is made, outside any compiled region:
under ``torch.compile`` Dynamo reads it as a constant attribute, guarded on the object, and nothing is registered
while it traces (a registration traced there would be a side effect that Dynamo replays only after the graph has run,
so the graph's first call would find nothing under the key).  The table holds its objects weakly: a call's object is
alive while the call runs, since the caller passes it.
"""
import itertools
import weakref

_NEXT = itertools.count()
_OBJECTS = weakref.WeakValueDictionary()


def new_key(obj):
    """A key no other object of this process has had, naming ``obj`` while it lives."""
    key = next(_NEXT)
    _OBJECTS[key] = obj
    return key


def registered(key):
    """The object under ``key``, or None for a negative key (none given)."""
    if key < 0:
        return None
    obj = _OBJECTS.get(key)
    if obj is None:
        raise RuntimeError(f"numba_flash: the block mask or mod under key {key} no longer exists (a compiled graph "
                           f"outlived the object it was traced with); pass the object to the call")
    return obj
