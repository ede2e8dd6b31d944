// SPDX-License-Identifier: Apache-2.0
//
// Element decoding for pooled lookups: every stored dtype widened to fp32 exactly. Host and
// device share these so both accumulate the very same values.
#pragma once

#include <cstdint>
#include <cstring>

#include "ibpembed/format.h"

namespace ibpembed {

IBP_HD float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

IBP_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// IEEE binary16 -> binary32, exact for every input (subnormals, inf, NaN payloads kept).
IBP_HD float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_to_float(sign);
  // Subnormal: normalise the mantissa.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return bits_to_float(sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3FFu) << 13));
}

// Width in bytes of the int8 row-wise header (fp16 scale, fp16 bias).
inline constexpr int kInt8RowwiseHeaderBytes = 4;

// Number of fp32 outputs one row pools into (0 when the dtype cannot be pooled).
IBP_HD int64_t pooled_dim(DType dtype, int64_t row_bytes) {
  switch (dtype) {
    case DType::kFloat32: return row_bytes % 4 == 0 ? row_bytes / 4 : 0;
    case DType::kFloat16:
    case DType::kBFloat16: return row_bytes % 2 == 0 ? row_bytes / 2 : 0;
    case DType::kInt8Rowwise:
      return row_bytes > kInt8RowwiseHeaderBytes ? row_bytes - kInt8RowwiseHeaderBytes : 0;
    default: return 0;
  }
}

// acc[d] += weight * value(row, d) for d < dim.
IBP_HD void accumulate_row(DType dtype, const uint8_t* row, int64_t dim, float weight, float* acc) {
  switch (dtype) {
    case DType::kFloat32: {
      for (int64_t d = 0; d < dim; ++d) {
        float v;
        memcpy(&v, row + 4 * d, 4);
        acc[d] += weight * v;
      }
      break;
    }
    case DType::kBFloat16: {
      for (int64_t d = 0; d < dim; ++d) {
        uint16_t h;
        memcpy(&h, row + 2 * d, 2);
        acc[d] += weight * bf16_to_float(h);
      }
      break;
    }
    case DType::kFloat16: {
      for (int64_t d = 0; d < dim; ++d) {
        uint16_t h;
        memcpy(&h, row + 2 * d, 2);
        acc[d] += weight * fp16_to_float(h);
      }
      break;
    }
    case DType::kInt8Rowwise: {
      uint16_t scale_bits, bias_bits;
      memcpy(&scale_bits, row, 2);
      memcpy(&bias_bits, row + 2, 2);
      const float scale = fp16_to_float(scale_bits);
      const float bias = fp16_to_float(bias_bits);
      const uint8_t* codes = row + kInt8RowwiseHeaderBytes;
      for (int64_t d = 0; d < dim; ++d) {
        acc[d] += weight * (static_cast<float>(codes[d]) * scale + bias);
      }
      break;
    }
    default: break;
  }
}

}  // namespace ibpembed
