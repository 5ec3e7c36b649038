// Exact top-k selection over one token's logits, deterministic: the k largest values, ties
// broken by the lower position, NaN below every number (so a NaN is chosen only when fewer
// than k numbers exist). Private to attention/.
#pragma once

#include <cstdint>

namespace sparsekv::attention {

// Writes the positions of the min(k, n) selected values to `out`, ascending. Three histogram
// passes (11, 11 and 10 bits of an order-preserving key) find the k-th largest key exactly,
// then one pass in position order takes every larger key and the first equal ones.
// Returns the count written. Allocates nothing.
uint32_t SelectTopK(const float* values, uint32_t n, uint32_t k, uint32_t* out);

// The order-preserving key: larger floats get larger keys; every NaN gets 0.
uint32_t OrderKey(float x);

}  // namespace sparsekv::attention
