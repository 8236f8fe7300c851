"""Atomic loads, stores and adds on int64 numpy arrays for numba code (threads of one parallel
region, and the host side of the device hand-off in `kernels.cpu.handoff`)."""

from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def fetch_add(typingctx, counters, index, amount):
    """Atomically counters[index] += amount (acquire-release); the value before."""
    sig = types.int64(counters, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", builder.gep(array.data, [args[1]]), args[2], "acq_rel")

    return sig, codegen


@intrinsic
def load_acquire(typingctx, counters, index):
    """counters[index], read atomically with acquire ordering (polling without taking the line)."""
    sig = types.int64(counters, types.intp)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(array.data, [args[1]]), "acquire", 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, counters, index, value):
    """counters[index] = value, atomically with release ordering (every earlier write is visible first)."""
    sig = types.void(counters, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        builder.store_atomic(args[2], builder.gep(array.data, [args[1]]), "release", 8)
        return context.get_dummy_value()

    return sig, codegen
