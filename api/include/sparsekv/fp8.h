// FP8 e4m3 (OCP "e4m3fn") and UE8M0 scale bytes: exact software conversions.
//
// e4m3fn: 1 sign, 4 exponent (bias 7) and 3 mantissa bits. No infinities; 0x7f and 0xff are
// NaN; the largest finite value is ±448; subnormals are m * 2^-9 (m = 1..7); 0x80 is -0.
// UE8M0: an unsigned exponent-only byte e meaning 2^(e - 127); 0xff is NaN. It is the per-tile
// scale of the fp8_v4 layout.
//
// These are the reference conversions every codec path is held to. Pure functions, thread-safe.
#pragma once

#include <cstdint>

namespace sparsekv {

inline constexpr float kE4m3MaxFinite = 448.0f;
inline constexpr uint8_t kE4m3NaN = 0x7f;  // 0xff is the negative NaN
inline constexpr uint8_t kUe8m0NaN = 0xff;

// Rounds to the nearest e4m3 value, ties to even. Finite values beyond ±448 after rounding and
// ±infinity saturate to ±448 (OCP's saturating conversion); NaN gives 0x7f or 0xff by sign.
uint8_t E4m3FromFloat(float value);
// The exact value of `code`; a NaN code gives a quiet NaN with the code's sign.
float E4m3ToFloat(uint8_t code);

// 2^(e - 127); NaN for 0xff. Exact (2^-127 is an fp32 denormal).
float Ue8m0ToFloat(uint8_t e);
// The byte of 2^k. Precondition: -127 <= k <= 127.
uint8_t Ue8m0FromExponent(int k);

}  // namespace sparsekv
