"""A few 512-bit vector operations for numba kernels (LLVM vector IR through intrinsics).

Values of the types below live in vector registers inside jitted code; they never reach Python.
`dot_u8s8` is AVX-512 VNNI's `vpdpbusd` where the compile target has it and the same arithmetic in
generic LLVM vector IR elsewhere (LLVM lowers it to what the target offers).
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


def _bytes_at(context, builder, array_type, array, offset, count: int):
    """Load `count` bytes of a uint8/int8 array starting at element `offset` (no alignment assumed)."""
    data = context.make_array(array_type)(context, builder, array).data
    pointer = builder.bitcast(builder.gep(data, [offset]), ir.VectorType(ir.IntType(8), count).as_pointer())
    return builder.load(pointer, align=1)


def _nibbles(builder, packed):
    """32 bytes -> 64: [their low nibbles | their high nibbles]."""
    low, high = builder.and_(packed, _splat(0x0F, packed.type)), builder.lshr(packed, _splat(4, packed.type))
    return builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(64))))


@intrinsic
def load_bytes(typingctx, array, offset):
    """The 64 bytes of `array` (uint8 or int8) from element `offset` on."""
    sig = bytes64(array, types.intp)
    return sig, lambda context, builder, signature, args: _bytes_at(context, builder, signature.args[0], args[0], args[1], 64)


@intrinsic
def q4_codes(typingctx, array, offset):
    """Unsigned codes (code + 8) of one Q4 group: its 32 base bytes at `offset` hold lanes 2j (low
    nibble) and 2j + 1 (high nibble); the result is [even lanes | odd lanes]."""
    sig = bytes64(array, types.intp)

    def codegen(context, builder, signature, args):
        packed = _bytes_at(context, builder, signature.args[0], args[0], args[1], 32)
        return _nibbles(builder, builder.xor(packed, _splat(0x88, packed.type)))

    return sig, codegen


@intrinsic
def q5_codes(typingctx, array, offset, high_bits):
    """Unsigned codes (code + 16) of one Q5 group: base bytes as in `q4_codes`, `high_bits` the
    group's fifth bits (bit i = lane i); the result is in [even lanes | odd lanes] order."""
    sig = bytes64(array, types.intp, types.uint64)

    def codegen(context, builder, signature, args):
        nibbles = _nibbles(builder, _bytes_at(context, builder, signature.args[0], args[0], args[1], 32))
        lanes = builder.select(builder.bitcast(args[2], ir.VectorType(ir.IntType(1), 64)), _splat(0, _BYTES), _splat(16, _BYTES))
        even_odd = ir.Constant(ir.VectorType(ir.IntType(32), 64), list(range(0, 64, 2)) + list(range(1, 64, 2)))
        return builder.or_(nibbles, builder.shuffle_vector(lanes, lanes, even_odd))

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
        picks = [builder.shuffle_vector(products, products, ir.Constant(ir.VectorType(ir.IntType(32), 16), [4 * i + j for i in range(16)])) for j in range(4)]
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
def add_scaled(typingctx, acc, ints, scale):
    """acc + float(ints) * scale per lane."""
    sig = float32x16(float32x16, int32x16, types.float32)

    def codegen(context, builder, signature, args):
        acc, ints, scale = args
        scales = builder.insert_element(ir.Constant(_FLOATS, ir.Undefined), scale, ir.Constant(ir.IntType(32), 0))
        scales = builder.shuffle_vector(scales, scales, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))
        product = builder.fmul(builder.sitofp(ints, _FLOATS), scales, flags=("contract",))
        return builder.fadd(acc, product, flags=("contract",))

    return sig, codegen


@intrinsic
def total(typingctx, values):
    """Sum of the 16 lanes (float32)."""
    sig = types.float32(float32x16)

    def codegen(context, builder, signature, args):
        value = args[0]
        for width in (8, 4, 2, 1):
            upper = builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(ir.IntType(32), 16), [(i + width) % 16 for i in range(16)]))
            value = builder.fadd(value, upper)
        return builder.extract_element(value, ir.Constant(ir.IntType(32), 0))

    return sig, codegen
