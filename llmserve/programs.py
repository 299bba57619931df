"""Who owns compiled programs: an engine, not the process.

XLA:CPU maps every executable's machine code into the process (about 450 memory maps per engine
step shape). With module-level jits, every engine's executables stayed cached for the life of
the process, and a sweep or a test run that built engine after engine reached the kernel's
``vm.max_map_count`` (65,530) and crashed inside XLA's compiler. So each engine holds its
programs (``runner.StepPrograms``, ``speculative.proposers.DraftPrograms``): jax.jit objects made
by ``owned_jit`` and handed out by ``programs_for``, which shares one programs object among
engines of the same shape while any lives and keeps the last ``KEEP_RECENT`` shapes of each kind
after their engines are gone (sweeps and tests rebuild them).
"""

from __future__ import annotations

import collections
import functools
import weakref

import jax

KEEP_RECENT = 2

_LIVE: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()
_RECENT: "dict[type, collections.OrderedDict]" = {}


def owned_jit(fn, **jit_kwargs):
    """``jax.jit`` over a fresh callable wrapping ``fn``: jax keys some compile caches on the
    function object, so jitting a module-level function directly would tie the executables to
    the module; through the wrapper they die with the returned jit object."""
    return jax.jit(functools.partial(fn), **jit_kwargs)


def programs_for(key: tuple, factory):
    """The ``factory()`` programs object for an engine shape ``key`` (hashable): shared while an
    engine holding it lives, or while the key is among the last KEEP_RECENT of its kind."""
    key = (factory, *key)
    recent = _RECENT.setdefault(factory, collections.OrderedDict())
    programs = _LIVE.get(key) or recent.get(key) or factory()
    _LIVE[key] = programs
    recent[key] = programs
    recent.move_to_end(key)
    while len(recent) > KEEP_RECENT:
        recent.popitem(last=False)
    return programs
