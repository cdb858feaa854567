// zkern/csrc/zk_quant.h: ZeRO++'s blockwise symmetric quantization, one element (or one group's scale) at a time,
// for the host compiler and nvcc alike (zkern/reference.py's quantize/dequantize state the same rules):
//   scale   absmax / qmax per group (qmax 127 for int8, 7 for int4), fp32 division; an all-zero group has scale 0
//           and codes 0; a group holding a NaN or an infinity has scale NaN and codes 0 (its dequantized values stay
//           NaN, so an overflow check after the collective still sees it).
//   code    round-half-away-from-zero(x * (1 / scale)), both in fp32, clamped to [-qmax, qmax].
//   int4    two codes per byte, element 2i in the low nibble, each stored as code + 8.
#pragma once

#include "zk_math.h"

namespace zk_quant {

ZK_HD int qmax_of(int bits) { return bits == 8 ? 127 : 7; }

ZK_HD bool finite(float x) { return (zk_math::bits_of(x) & 0x7f800000u) != 0x7f800000u; }

// A group's scale from its absmax and whether every value was finite.
ZK_HD float scale_of(float absmax, bool all_finite, int bits) {
  return all_finite ? absmax / static_cast<float>(qmax_of(bits)) : zk_math::float_of(0x7fc00000u);
}

// What codes multiply by: 1 / scale, or 0 for a zero or NaN scale (every code of such a group is 0).
ZK_HD float inverse_of(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// One value's code (an integer in [-qmax, qmax]); 0 in a group whose inverse is 0 (all zero, or not finite:
// x * 0 would be NaN for an infinite x).
ZK_HD int code_of(float x, float inverse, int bits) {
  if (!(inverse > 0.0f)) return 0;
  float y = x * inverse;
  float r = floorf(fabsf(y) + 0.5f);
  float q = fminf(r, static_cast<float>(qmax_of(bits)));
  return static_cast<int>(y < 0.0f ? -q : q);
}

// int4: two codes in one byte (the first in the low nibble), each as code + 8; and back.
ZK_HD uint8_t pack4(int lo, int hi) { return static_cast<uint8_t>((lo + 8) | ((hi + 8) << 4)); }
ZK_HD int low4(uint8_t b) { return static_cast<int>(b & 0xf) - 8; }
ZK_HD int high4(uint8_t b) { return static_cast<int>(b >> 4) - 8; }

ZK_HD float dequant(int code, float scale) { return static_cast<float>(code) * scale; }

}  // namespace zk_quant
