// bf16 <-> fp32 conversion, exact and the same on every SIMD path.
//
// bf16 is the top half of an fp32: 1 sign, 8 exponent and 7 mantissa bits. Widening is exact.
// Narrowing rounds to nearest, ties to even; NaN stays NaN (truncated, quiet bit set, sign
// kept); infinities stay infinities; values that round past the largest bf16 become infinity;
// fp32 denormals round like any other value (nothing is flushed to zero). These are the
// reference conversions the codecs use for rope parts and bf16 rows; pure functions,
// thread-safe. For whole rows, PageCodec (codec.h) converts with SIMD.
#pragma once

#include <cstdint>

namespace sparsekv {

// The bits of `value` rounded to bf16.
uint16_t Bf16FromFloat(float value);
// The fp32 value of bf16 `bits` (exact).
float Bf16ToFloat(uint16_t bits);

}  // namespace sparsekv
