#include "sparsekv/bf16.h"

#include "compress/scalar_math.h"

namespace sparsekv {

uint16_t Bf16FromFloat(float value) {
  return compress::Bf16FromFloatRef(value);
}
float Bf16ToFloat(uint16_t bits) {
  return compress::Bf16ToFloatRef(bits);
}

}  // namespace sparsekv
