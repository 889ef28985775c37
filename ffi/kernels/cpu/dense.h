// The dense bias and mask (params.h, DenseParams) in the CPU kernels.
//
// A tile of pairs is summarised before any product (`View`): a tile the mask
// hides entirely is skipped like one outside the window, a tile it shows
// entirely runs as if there were no mask. In a mixed tile the hidden pairs get
// a -inf score (so P = 0), and after the probabilities are formed an exact 0
// in P and dS (`ZeroHidden`), so the tile products may run over the whole tile
// (`Finite`: when no operand row holds a NaN or Inf, 0 times it is 0) and only
// fall back to the pair-by-pair product of masked spans when one does.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include "common/mask.h"
#include "cpu/tile.h"
#include "jaxflash/params.h"

namespace jaxflash::cpu {

struct DenseRows {
  const DenseParams& d;
  int64_t b;

  // Pointer to the mask bytes of (head, query row) at key 0.
  JAXFLASH_CPU_INLINE const uint8_t* MaskRow(int64_t head, int row) const {
    return static_cast<const uint8_t*>(d.mask.data) + d.mask.RowOffset(b, head, row);
  }
  JAXFLASH_CPU_INLINE bool Shows(int64_t head, int row, int col) const {
    return !d.mask.On() || MaskRow(head, row)[col * d.mask.key_stride] != 0;
  }

  enum class View { kHidden, kMixed, kShown };
  // What the mask shows of the tile of `rows` rows, row r being (head, query row) =
  // row_of(r), and keys [c0, c0 + cols).
  template <typename RowOf>
  JAXFLASH_CPU_INLINE View Tile(int rows, RowOf&& row_of, int c0, int cols) const {
    if (!d.mask.On()) return View::kShown;
    bool any = false, all = true;
    for (int r = 0; r < rows; ++r) {
      const auto [head, row] = row_of(r);
      const uint8_t* m = MaskRow(head, row) + c0 * d.mask.key_stride;
      const int n = d.mask.key_stride == 0 ? 1 : cols;
      for (int c = 0; c < n; ++c) {
        any |= m[c] != 0;
        all &= m[c] != 0;
      }
    }
    return !any ? View::kHidden : all ? View::kShown : View::kMixed;
  }

  // s[c] += log2(e) * bias of (head, query row, key c0 + c), c < cols.
  JAXFLASH_CPU_INLINE void AddBias(int64_t head, int row, int c0, int cols, float* s) const {
    if (!d.bias.On()) return;
    WithFormat(d.bias.dtype, [&](auto format) {
      using Format = decltype(format);
      const auto* src = As<Format>(d.bias.data) + d.bias.RowOffset(b, head, row) + c0 * d.bias.key_stride;
      if (d.bias.key_stride == 0) {
        const float x = Format::Load(src[0]) * kLog2e;
        for (int c = 0; c < cols; ++c) s[c] += x;
      } else {
        for (int c = 0; c < cols; ++c) s[c] += Format::Load(src[c]) * kLog2e;
      }
    });
  }

  // s[c] = -inf for the keys c0 + c the mask hides from (head, query row).
  JAXFLASH_CPU_INLINE void Hide(int64_t head, int row, int c0, int cols, float* s) const {
    const uint8_t* m = MaskRow(head, row) + c0 * d.mask.key_stride;
    for (int c = 0; c < cols; ++c) {
      if (m[c * d.mask.key_stride] == 0) s[c] = kNegInf;
    }
  }
};

// Whether rows x cols of a tile (`stride` floats a row) are all finite.
JAXFLASH_CPU_INLINE bool Finite(const float* x, int rows, int cols, int stride) {
  bool ok = true;
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < cols; ++c) ok &= std::isfinite(x[r * stride + c]);
  }
  return ok;
}

}  // namespace jaxflash::cpu
