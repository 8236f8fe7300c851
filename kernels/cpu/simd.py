"""A few 512-bit vector operations for numba kernels (LLVM vector IR through intrinsics).

Values of the types below live in vector registers inside jitted code; they never reach Python.
`dot_u8s8` is AVX-512 VNNI's `vpdpbusd` where the compile target has it and the same arithmetic in
generic LLVM vector IR elsewhere (LLVM lowers it to what the target offers); `prefetch` is LLVM's
cache hint.
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import config, types
from numba.extending import intrinsic, models, register_model

_BYTES = ir.VectorType(ir.IntType(8), 64)
_INTS = ir.VectorType(ir.IntType(32), 16)
_FLOATS = ir.VectorType(ir.FloatType(), 16)


class Bytes64(types.Type):
    """64 unsigned bytes (weight codes) or 64 signed bytes (activation parts)."""

    def __init__(self) -> None:
        super().__init__(name="bytes64")


class Int32x16(types.Type):
    def __init__(self) -> None:
        super().__init__(name="int32x16")


class Float32x16(types.Type):
    def __init__(self) -> None:
        super().__init__(name="float32x16")


bytes64, int32x16, float32x16 = Bytes64(), Int32x16(), Float32x16()


@register_model(Bytes64)
class _BytesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _BYTES)


@register_model(Int32x16)
class _IntsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _INTS)


@register_model(Float32x16)
class _FloatsModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _FLOATS)


def target_has_vnni() -> bool:
    """Whether numba compiles for a CPU with AVX-512 VNNI (numba targets the host unless
    NUMBA_CPU_FEATURES says otherwise)."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else llvm.get_host_cpu_features().flatten()
    return "+avx512vnni" in features.split(",") and "+avx512bw" in features.split(",")


def _splat(value: int, vector: ir.VectorType) -> ir.Constant:
    return ir.Constant(vector, [ir.Constant(vector.element, value)] * vector.count)


def _element_pointer(context, builder, array_type, array, offset, pointee: ir.Type):
    """Pointer to element `offset` of an array, typed as a pointer to `pointee`."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), pointee.as_pointer())


def _bytes_at(context, builder, array_type, array, offset, count: int):
    """Load `count` bytes of a uint8/int8 array starting at element `offset` (no alignment assumed)."""
    return builder.load(_element_pointer(context, builder, array_type, array, offset, ir.VectorType(ir.IntType(8), count)), align=1)


def _lanes_at(vector: ir.VectorType):
    """Codegen of a load of the 16 int32/float32 lanes of an array from element `offset` on."""
    return lambda context, builder, signature, args: builder.load(
        _element_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=4
    )


# Lanes of a 128-lane block whose codes are the low nibbles (even lanes) and the high ones (odd).
_EVEN_ODD = list(range(0, 128, 2)), list(range(1, 128, 2))


def _nibble_halves(builder, packed):
    """64 bytes -> (their low nibbles, their high nibbles)."""
    return builder.and_(packed, _splat(0x0F, _BYTES)), builder.and_(builder.lshr(packed, _splat(4, _BYTES)), _splat(0x0F, _BYTES))


@intrinsic
def load_bytes(typingctx, array, offset):
    """The 64 bytes of `array` (uint8 or int8) from element `offset` on."""
    sig = bytes64(array, types.intp)
    return sig, lambda context, builder, signature, args: _bytes_at(context, builder, signature.args[0], args[0], args[1], 64)


@intrinsic
def q4_block(typingctx, array, offset):
    """Unsigned codes (code + 8) of two consecutive Q4 groups (a 128-lane block) from their 64 base
    bytes at `offset`: (low nibbles, high nibbles), i.e. (even lanes, odd lanes) of the block, each
    [group 0 | group 1]."""
    sig = types.UniTuple(bytes64, 2)(array, types.intp)

    def codegen(context, builder, signature, args):
        packed = builder.xor(_bytes_at(context, builder, signature.args[0], args[0], args[1], 64), _splat(0x88, _BYTES))
        return context.make_tuple(builder, signature.return_type, _nibble_halves(builder, packed))

    return sig, codegen


@intrinsic
def q5_block(typingctx, array, offset, high_offset):
    """Unsigned codes (code + 16) of two consecutive Q5 groups: base bytes at `offset` as in
    `q4_block`, their 16 fifth-bit bytes (bit i = lane i of the block) at `high_offset`."""
    sig = types.UniTuple(bytes64, 2)(array, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        low, high = _nibble_halves(builder, _bytes_at(context, builder, signature.args[0], args[0], args[1], 64))
        bits = builder.bitcast(_bytes_at(context, builder, signature.args[0], args[0], args[2], 16), ir.IntType(128))
        wide = ir.VectorType(ir.IntType(8), 128)
        fifth = builder.select(builder.bitcast(bits, ir.VectorType(ir.IntType(1), 128)), _splat(0, wide), _splat(16, wide))
        lanes = [builder.shuffle_vector(fifth, fifth, ir.Constant(ir.VectorType(ir.IntType(32), 64), order)) for order in _EVEN_ODD]
        return context.make_tuple(builder, signature.return_type, [builder.or_(low, lanes[0]), builder.or_(high, lanes[1])])

    return sig, codegen


@intrinsic
def load_ints(typingctx, array, offset):
    """The 16 int32 of `array` from element `offset` on."""
    return int32x16(array, types.intp), _lanes_at(_INTS)


@intrinsic
def load_floats(typingctx, array, offset):
    """The 16 float32 of `array` from element `offset` on."""
    return float32x16(array, types.intp), _lanes_at(_FLOATS)


@intrinsic
def sub_ints(typingctx, a, b):
    sig = int32x16(int32x16, int32x16)
    return sig, lambda context, builder, signature, args: builder.sub(args[0], args[1])


@intrinsic
def add_block_scaled(typingctx, acc, ints, first, second, units):
    """acc + float(ints) * scale * units per lane, scale = `first` in lanes 0-7 and `second` in
    lanes 8-15 (the two groups of a block)."""
    sig = float32x16(float32x16, int32x16, types.float32, types.float32, float32x16)

    def codegen(context, builder, signature, args):
        acc, ints, first, second, units = args
        pair = builder.insert_element(ir.Constant(ir.VectorType(ir.FloatType(), 2), ir.Undefined), first, ir.Constant(ir.IntType(32), 0))
        pair = builder.insert_element(pair, second, ir.Constant(ir.IntType(32), 1))
        scales = builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 8 + [1] * 8))
        product = builder.fmul(builder.sitofp(ints, _FLOATS), builder.fmul(scales, units, flags=("contract",)), flags=("contract",))
        return builder.fadd(acc, product, flags=("contract",))

    return sig, codegen


@intrinsic
def int_zeros(typingctx):
    sig = int32x16()
    return sig, lambda context, builder, signature, args: _splat(0, _INTS)


@intrinsic
def float_zeros(typingctx):
    sig = float32x16()
    return sig, lambda context, builder, signature, args: ir.Constant(_FLOATS, [ir.Constant(ir.FloatType(), 0.0)] * 16)


@intrinsic
def dot_u8s8(typingctx, acc, unsigned, signed):
    """acc[i] + sum over j < 4 of unsigned[4i + j] * signed[4i + j] (int32 lanes, no saturation)."""
    sig = int32x16(int32x16, bytes64, bytes64)

    def codegen(context, builder, signature, args):
        acc, unsigned, signed = args
        if target_has_vnni():
            fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(_INTS, [_INTS, _INTS, _INTS]))
            return builder.call(fn, [acc, builder.bitcast(unsigned, _INTS), builder.bitcast(signed, _INTS)])
        wide = ir.VectorType(ir.IntType(32), 64)
        products = builder.mul(builder.zext(unsigned, wide), builder.sext(signed, wide))
        picks = [
            builder.shuffle_vector(products, products, ir.Constant(ir.VectorType(ir.IntType(32), 16), [4 * i + j for i in range(16)]))
            for j in range(4)
        ]
        return builder.add(acc, builder.add(builder.add(picks[0], picks[1]), builder.add(picks[2], picks[3])))

    return sig, codegen


@intrinsic
def shift_left(typingctx, acc, bits):
    """acc << bits per int32 lane (`bits` a compile-time constant)."""
    if not isinstance(bits, types.IntegerLiteral):
        return None
    sig = int32x16(int32x16, bits)
    amount = bits.literal_value
    return sig, lambda context, builder, signature, args: builder.shl(args[0], _splat(amount, _INTS))


@intrinsic
def prefetch(typingctx, array, offset):
    """Hint that the cache line holding element `offset` of `array` will be read soon (it may lie
    past the array's end: a prefetch never faults)."""
    sig = types.void(array, types.intp)

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1], ir.IntType(8))
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", [pointer.type], fnty=ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
        )
        builder.call(fn, [pointer, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def total(typingctx, values):
    """Sum of the 16 lanes (float32)."""
    sig = types.float32(float32x16)

    def codegen(context, builder, signature, args):
        value = args[0]
        for width in (8, 4, 2, 1):
            upper = builder.shuffle_vector(
                value, value, ir.Constant(ir.VectorType(ir.IntType(32), 16), [(i + width) % 16 for i in range(16)])
            )
            value = builder.fadd(value, upper)
        return builder.extract_element(value, ir.Constant(ir.IntType(32), 0))

    return sig, codegen
