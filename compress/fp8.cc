#include "sparsekv/fp8.h"

#include "compress/scalar_math.h"

namespace sparsekv {

uint8_t E4m3FromFloat(float value) {
  return compress::E4m3FromFloatRef(value);
}
float E4m3ToFloat(uint8_t code) {
  return compress::E4m3ToFloatRef(code);
}
float Ue8m0ToFloat(uint8_t e) {
  return compress::Ue8m0ToFloatRef(e);
}
uint8_t Ue8m0FromExponent(int k) {
  return static_cast<uint8_t>(k + 127);
}

}  // namespace sparsekv
