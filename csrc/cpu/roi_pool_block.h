// The vector path of the CPU roi_pool forward: all bins of one RoI for a block of 8 float32
// channels, one channel per lane (the two steps are described in roi_pool.cpp). Without
// kIndex (the values alone) no index is tracked: step 1 keeps each column's first maximum from
// the top by MAXPS alone, step 2 takes the largest column maximum, and a bin whose maximum is
// zero finds its first zero in row-major order in the map (first_zeros), for the sign.
//
// No include guard: roi_pool.cpp includes this file once per instruction set, each time inside
// its own namespace that defines
//   Lanes               a lane type of roi_pool_lanes.h (Sse2Lanes, Avx2Lanes, Avx512Lanes)
//   DETOPS_LANES_FN     attributes of the functions below (the target of Lanes' instructions)
// after kChannelBlock (8) and RoiWindows.

// Step 1 when rows are contiguous (s_w == 1, width >= 4): columns in groups of 4, the block's
// channels l and l + 4 in the halves of one vector (4 chains), then a transpose within the
// halves gives one vector per column, a lane per channel. A group that would pass the right
// edge of the map is moved left to end on it: it recomputes columns that an earlier group
// holds, with the same result (every column is computed on its own). Columns outside [c0, c1)
// may be written too, never outside [0, width). Without kIndex, col_idx is not written.
template <bool kIndex>
DETOPS_LANES_FN inline void column_max_rows(
    const float* first_plane, int64_t s_c, int64_t s_h, int64_t width, int64_t h0, int64_t h1,
    int64_t c0, int64_t c1, float* col_max, int32_t* col_idx) {
  using F = Lanes::F;
  using I = Lanes::I;
  const F lowest = Lanes::fill(geometry::roi_pool_lowest<float>());
  const I none = Lanes::fill(int32_t{-1});
  const I step = Lanes::fill(static_cast<int32_t>(width));  // from one row's indices to the next's
  for (int64_t w = c0; w < c1;) {
    const int64_t g = std::min(w, width - 4);
    const I cols = Lanes::add(Lanes::fill(static_cast<int32_t>(g)), Lanes::iota4());
    F m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
    I r0 = none, r1 = none, r2 = none, r3 = none;
    const float* p = first_plane + h0 * s_h + g;
    I idx = Lanes::add(Lanes::fill(static_cast<int32_t>(h0 * width)), cols);  // row h's indices
    for (int64_t h = h0; h < h1; ++h, p += s_h) {
      if constexpr (kIndex) {
        Lanes::keep_greater(Lanes::load_halves(p, p + 4 * s_c), idx, m0, r0);
        Lanes::keep_greater(Lanes::load_halves(p + s_c, p + 5 * s_c), idx, m1, r1);
        Lanes::keep_greater(Lanes::load_halves(p + 2 * s_c, p + 6 * s_c), idx, m2, r2);
        Lanes::keep_greater(Lanes::load_halves(p + 3 * s_c, p + 7 * s_c), idx, m3, r3);
        idx = Lanes::add(idx, step);
      } else {
        Lanes::keep_greater(Lanes::load_halves(p, p + 4 * s_c), m0);
        Lanes::keep_greater(Lanes::load_halves(p + s_c, p + 5 * s_c), m1);
        Lanes::keep_greater(Lanes::load_halves(p + 2 * s_c, p + 6 * s_c), m2);
        Lanes::keep_greater(Lanes::load_halves(p + 3 * s_c, p + 7 * s_c), m3);
      }
    }
    Lanes::transpose4(m0, m1, m2, m3);
    Lanes::store(col_max + g * kChannelBlock, m0);
    Lanes::store(col_max + (g + 1) * kChannelBlock, m1);
    Lanes::store(col_max + (g + 2) * kChannelBlock, m2);
    Lanes::store(col_max + (g + 3) * kChannelBlock, m3);
    if constexpr (kIndex) {
      Lanes::transpose4(r0, r1, r2, r3);
      Lanes::store(col_idx + g * kChannelBlock, r0);
      Lanes::store(col_idx + (g + 1) * kChannelBlock, r1);
      Lanes::store(col_idx + (g + 2) * kChannelBlock, r2);
      Lanes::store(col_idx + (g + 3) * kChannelBlock, r3);
    }
    w = g + 4;
  }
}

// Step 1 when channels are contiguous (s_c == 1, channels_last): a load is a block's 8
// channels at one pixel; two columns at a time for independent chains. With kBlocks 2 or 4,
// the blocks at first_plane + 8, + 16, ... too (block b's column maxima at col_max + b *
// col_step, its indices at col_idx + b * col_step): the blocks' loads of a pixel then read
// whole 64-byte lines where the map is aligned, where one block would read half of each line
// and leave the rest to another item. Without kIndex, col_idx is not written.
template <bool kIndex, int kBlocks>
DETOPS_LANES_FN inline void column_max_channels(
    const float* first_plane, int64_t s_h, int64_t s_w, int64_t width, int64_t h0, int64_t h1,
    int64_t c0, int64_t c1, float* col_max, int32_t* col_idx, int64_t col_step) {
  using F = Lanes::F;
  using I = Lanes::I;
  const F lowest = Lanes::fill(geometry::roi_pool_lowest<float>());
  const I none = Lanes::fill(int32_t{-1});
  const I step = Lanes::fill(static_cast<int32_t>(width));
  for (int64_t w = c0; w < c1; w += 2) {
    const int64_t w2 = std::min(w + 1, c1 - 1);  // an odd last column is done twice
    F m[kBlocks], m2[kBlocks];
    I r[kBlocks], r2[kBlocks];
    for (int b = 0; b < kBlocks; ++b) {
      m[b] = m2[b] = lowest;
      r[b] = r2[b] = none;
    }
    const float* p = first_plane + h0 * s_h + w * s_w;
    const float* p2 = first_plane + h0 * s_h + w2 * s_w;
    I idx = Lanes::fill(static_cast<int32_t>(h0 * width + w));  // row h's index of each column
    I idx2 = Lanes::fill(static_cast<int32_t>(h0 * width + w2));
    for (int64_t h = h0; h < h1; ++h, p += s_h, p2 += s_h) {
      for (int b = 0; b < kBlocks; ++b) {
        if constexpr (kIndex) {
          Lanes::keep_greater(Lanes::load(p + b * kChannelBlock), idx, m[b], r[b]);
          Lanes::keep_greater(Lanes::load(p2 + b * kChannelBlock), idx2, m2[b], r2[b]);
        } else {
          Lanes::keep_greater(Lanes::load(p + b * kChannelBlock), m[b]);
          Lanes::keep_greater(Lanes::load(p2 + b * kChannelBlock), m2[b]);
        }
      }
      if constexpr (kIndex) {
        idx = Lanes::add(idx, step);
        idx2 = Lanes::add(idx2, step);
      }
    }
    for (int b = 0; b < kBlocks; ++b) {
      Lanes::store(col_max + b * col_step + w * kChannelBlock, m[b]);
      Lanes::store(col_max + b * col_step + w2 * kChannelBlock, m2[b]);
      if constexpr (kIndex) {
        Lanes::store(col_idx + b * col_step + w * kChannelBlock, r[b]);
        Lanes::store(col_idx + b * col_step + w2 * kChannelBlock, r2[b]);
      }
    }
  }
}

// Channels l of `zeros` (a bit per lane) of a bin whose maximum is zero: res[l] = the first
// zero of window [h0, h1) x [w0, w1) in row-major order (the serial scan's value, sign
// included; there is one, the maximum is one).
inline void first_zeros(
    const float* first_plane, int64_t s_c, int64_t s_h, int64_t s_w, int64_t h0, int64_t h1,
    int64_t w0, int64_t w1, int zeros, float* res) {
  for (int l = 0; l < kChannelBlock; ++l) {
    if (!(zeros >> l & 1)) continue;
    const float* plane = first_plane + l * s_c;
    bool found = false;
    for (int64_t h = h0; h < h1 && !found; ++h) {
      for (int64_t w = w0; w < w1; ++w) {
        const float v = plane[h * s_h + w * s_w];
        if (v == 0.f) {
          res[l] = v;
          found = true;
          break;
        }
      }
    }
  }
}

// Step 2 for bin row ph (rows [h0, h1)) of the block at first_plane: each bin's result from
// the row's column maxima (bin j of channel l to res[j * 8 + l], its index to res_idx).
template <bool kIndex>
DETOPS_LANES_FN inline void bin_row(
    const float* first_plane, int64_t s_c, int64_t s_h, int64_t s_w, const RoiWindows& win,
    int64_t ph, int64_t h0, int64_t h1, int64_t pooled_width, const float* col_max,
    const int32_t* col_idx, float* res, int32_t* res_idx) {
  using F = Lanes::F;
  using I = Lanes::I;
  const F lowest = Lanes::fill(geometry::roi_pool_lowest<float>());
  const I none = Lanes::fill(int32_t{-1});
  for (int64_t pw = 0; pw < pooled_width; ++pw) {
    const int64_t j = ph * pooled_width + pw;
    const int64_t w0 = win.cols[2 * pw], w1 = win.cols[2 * pw + 1];
    if (h1 <= h0 || w1 <= w0) {
      Lanes::store(res + j * kChannelBlock, Lanes::fill(0.f));
      if constexpr (kIndex) Lanes::store(res_idx + j * kChannelBlock, none);
      continue;
    }
    if constexpr (!kIndex) {
      // Nonzero maxima have one encoding each, so the columns' order does not matter.
      F best = lowest;
      for (int64_t w = w0; w < w1; ++w) {
        Lanes::keep_greater(Lanes::load(col_max + w * kChannelBlock), best);
      }
      Lanes::store(res + j * kChannelBlock, best);
      const int zeros = Lanes::zero_lanes(best);
      if (zeros) {
        first_zeros(first_plane, s_c, s_h, s_w, h0, h1, w0, w1, zeros, res + j * kChannelBlock);
      }
      continue;
    }
    // An all-NaN column (maximum roi_pool_lowest, index -1) is never taken: its maximum is
    // not greater than best, and when equal, best's index is -1 too.
    F best = lowest;
    I bi = none;
    for (int64_t w = w0; w < w1; ++w) {
      Lanes::keep_first_max(
          Lanes::load(col_max + w * kChannelBlock), Lanes::load(col_idx + w * kChannelBlock),
          best, bi);
    }
    Lanes::store(res + j * kChannelBlock, best);
    Lanes::store(res_idx + j * kChannelBlock, bi);
  }
}

// The block's channels l = 0..7 at first_plane + l * s_c: step 1 by rows when `rows`, else by
// channels; step 2 per bin. Writes bin j of channel l to res[j * 8 + l], and with kIndex its
// index to res_idx[j * 8 + l]. col_max / col_idx hold 8 entries per column of the map (col_idx
// and res_idx are not used without kIndex). With channels inner, nblocks 2 or 4 (4 with kIndex
// only up to Lanes::kIndexBlocks) runs the blocks at first_plane + 8, ... in the same pass over
// the map (column_max_channels): block b's column maxima at col_max + b * width * 8, its
// results at res + b * bins * 8 (and its indices likewise), where bins = pooled_height *
// pooled_width.
template <bool kIndex>
DETOPS_LANES_FN inline void pool_block(
    const float* first_plane, int64_t s_c, int64_t s_h, int64_t s_w, int64_t width, bool rows,
    int64_t nblocks, const RoiWindows& win, int64_t pooled_height, int64_t pooled_width,
    float* col_max, int32_t* col_idx, float* res, int32_t* res_idx) {
  const int64_t col_step = width * kChannelBlock;
  const int64_t res_step = pooled_height * pooled_width * kChannelBlock;
  for (int64_t ph = 0; ph < pooled_height; ++ph) {
    const int64_t h0 = win.rows[2 * ph], h1 = win.rows[2 * ph + 1];
    if (h1 > h0) {
      if (rows) {
        column_max_rows<kIndex>(
            first_plane, s_c, s_h, width, h0, h1, win.first_col, win.last_col, col_max, col_idx);
      } else if (nblocks == 2) {
        column_max_channels<kIndex, 2>(
            first_plane, s_h, s_w, width, h0, h1, win.first_col, win.last_col, col_max, col_idx,
            col_step);
      } else if (nblocks == 4) {
        // with indices only where Lanes::kIndexBlocks is 4 (the caller's blocks an item)
        if constexpr (!kIndex || Lanes::kIndexBlocks >= 4) {
          column_max_channels<kIndex, 4>(
              first_plane, s_h, s_w, width, h0, h1, win.first_col, win.last_col, col_max,
              col_idx, col_step);
        }
      } else {
        column_max_channels<kIndex, 1>(
            first_plane, s_h, s_w, width, h0, h1, win.first_col, win.last_col, col_max, col_idx,
            col_step);
      }
    }
    for (int64_t b = 0; b < nblocks; ++b) {
      bin_row<kIndex>(
          first_plane + b * kChannelBlock, s_c, s_h, s_w, win, ph, h0, h1, pooled_width,
          col_max + b * col_step, kIndex ? col_idx + b * col_step : nullptr, res + b * res_step,
          kIndex ? res_idx + b * res_step : nullptr);
    }
  }
}
