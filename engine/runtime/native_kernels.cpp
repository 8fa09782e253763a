// SpecLens's float32 CPU kernels for decoding on x86-64 (AVX-512F, or AVX2 + FMA + F16C): a linear layer
// and attention over a KV cache, both batch invariant.
//
// Linear: y[M, N] = x[M, K] W^T (+ bias) with W repacked once into panels of 16 output columns,
// [P, K, 16] (P = N rounded up to 64, over 16; zero padding), so that a panel's weights for one k are
// one 64-byte line and every panel is one contiguous stream.
//
// Decoding reads every weight once per forward, for 1 row (plain decoding) or a handful (a draft
// being verified). A register tile holds the outputs of up to 24 rows, so each weight is loaded
// once per forward and used for every row while the next lines are prefetched.
//
// Batch invariance: every output is a single FMA chain over k = 0, 1, ..., K-1 started from zero,
// then the bias is added. The tile shape, the row count M and the thread split only decide which
// chains run side by side, never the order inside one, so a row's result is bit for bit the same
// whether it is computed alone or inside a block of any size. Verification therefore scores a
// drafted token with exactly the numbers plain decoding would have computed for it.
//
// 4-bit blocks: a weight whose every 32 consecutive inputs of an output hold
// m + d * q exactly (q = 0..15; d, m half precision: what a Q4_1 GGUF dequantises to, as the embedded
// default's decoder does) can be packed as those q, d and m, 5 bits a weight instead of 32. The kernel
// rebuilds each weight as fma(d, q, m), which is m + d * q exactly (d * q needs 15 bits), and runs the
// same FMA chain as the float32 panels: the outputs are bit for bit those of the float32 weights.
// Python packs (engine/runtime/native_kernels.py, pack_blocks) only weights it has checked to rebuild exactly.
//
// 8-bit blocks, likewise: a weight whose every 32 consecutive inputs of an output hold
// d * q exactly (q = -128..127, d half precision: a Q8_0 GGUF's, as the embedded default's tied LM
// head) is packed as q and d, 8.5 bits a weight; the kernel rebuilds d * q (exact: 19 bits) and runs
// the same chain (pack_byte_blocks).
//
// Attention: out[t, h] = softmax_j(scale * q[h, t] . k[g, j]) v[g, j] over the keys j that query t may
// see (its mask row, or causally), with g = h / (H / G) (grouped-query attention read in place).
// Batch invariant as well: a query's keys are taken in cache order with the masked ones skipped, and
// every sum (the dot products, the softmax total, the weighted values) runs over that compacted
// sequence in a fixed order. A tree node sees its context and its ancestors, in that order, exactly
// as the same token decoded alone sees the cache; the other tree nodes in between leave no trace.
//
// Built at first use by engine/runtime/native_kernels.py (torch.utils.cpp_extension, -march=native).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: one 64-byte line of weights per k
constexpr int64_t kGroup = 64;  // panels are padded to whole groups of output columns (every tile width fits)
constexpr int64_t kPrefetch = 32;  // k steps ahead to prefetch each panel stream (2 KB)
constexpr int64_t kMaxHeads = 8;  // attention: query heads of one key/value group handled together
constexpr int64_t kSpan = 32;  // attention: keys whose value rows every head of a group takes in turn
constexpr int64_t kBlockBytes = 320;  // 4-bit blocks: bytes per panel per 32 k (16 d, 16 m, 32 x 8 of nibbles)
constexpr int64_t kByteBlockBytes = 544;  // 8-bit blocks: bytes per panel per 32 k (16 d, 32 x 16 of q)

// The elements of W one panel takes: K lines of 16 weights, or K / 32 blocks of kBlockBytes (4-bit) or
// kByteBlockBytes (8-bit) bytes.
inline int64_t panel_size(const float*, int64_t K) { return K * kPanel; }
inline int64_t panel_size(const uint16_t*, int64_t K) { return K * kPanel; }
inline int64_t panel_size(const uint8_t*, int64_t K) { return K / 32 * kBlockBytes; }
inline int64_t panel_size(const int8_t*, int64_t K) { return K / 32 * kByteBlockBytes; }

#if defined(__AVX512F__)

inline __mmask16 column_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// 16 weights of a panel line as floats: float32 as they are, bfloat16 widened exactly.
inline __m512 load_line(const float* p) { return _mm512_load_ps(p); }
inline __m512 load_line(const uint16_t* p) {
  const __m256i bits = _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The outputs of rows [0, MR) times NV panels, held in registers while a tile runs over k: every tile
// (float32 or bfloat16 lines, 4-bit or 8-bit blocks) starts it at zero, adds one k at a time, stores it.
template <int MR, int NV>
struct Accumulators {
  __m512 acc[MR][NV];

  __attribute__((always_inline)) Accumulators() {
#pragma GCC unroll 24
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  }

  // acc[r][j] += x[r] * b[j]: one k of each output's chain (x: the rows' inputs at k; b: NV panels' weights)
  __attribute__((always_inline)) void add(const float* x, const __m512* b) {
#pragma GCC unroll 24
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }

  // out[r, 16 j + c] = acc[r][j][c] (+ bias[16 j + c]) for the `cols` valid columns
  __attribute__((always_inline)) void store(const float* bias, float* out, int64_t ldo, int64_t cols) const {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __mmask16 mask = column_mask(cols - 16 * j);
      const __m512 bias_j = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 24
      for (int r = 0; r < MR; ++r)
        _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mask, bias ? _mm512_add_ps(acc[r][j], bias_j) : acc[r][j]);
    }
  }
};

// Rows [0, MR) times NV panels. xt: the rows transposed, [K, ldx]; w: the first panel [K, 16],
// later panels K * 16 weights apart; out: [MR, ldo], `cols` valid columns from out[0].
template <int MR, int NV, typename W>
void tile(const float* xt, int64_t ldx, const W* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  Accumulators<MR, NV> acc;
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * kPanel;
    __m512 b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      b[j] = load_line(wk + j * K * kPanel);
      _mm_prefetch(reinterpret_cast<const char*>(wk + j * K * kPanel + kPrefetch * kPanel), _MM_HINT_T0);
    }
    acc.add(xt + k * ldx, b);
  }
  acc.store(bias, out, ldo, cols);
}

// ---- 4-bit blocks ----
// Per panel, per 32 k: 16 d then 16 m (half precision, one per column), then for each pair of inputs
// k, k + 1 16 bytes whose byte j holds column j's q for k in its low nibble and for k + 1 in its high
// one (one widening gives both). An overload of tile, so that rows and span serve every weight format.

template <int MR, int NV>
void tile(const float* xt, int64_t ldx, const uint8_t* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  Accumulators<MR, NV> acc;
  const int64_t stride = panel_size(w, K);
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    __m512 d[NV], m[NV];
    const uint8_t* block[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      block[j] = w + j * stride + kb * kBlockBytes;
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[j])));
      m[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[j] + 32)));
      for (int64_t line = 0; line < kBlockBytes; line += 64)  // three blocks (~1 KB) ahead
        _mm_prefetch(reinterpret_cast<const char*>(block[j] + 3 * kBlockBytes + line), _MM_HINT_T0);
    }
    for (int kk = 0; kk < 32; kk += 2) {  // inputs k and k + 1 share each column's byte
      const int64_t k = kb * 32 + kk;
      __m512 even[NV], odd[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        const __m512i bytes = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(block[j] + 64 + kk * 8)));
        even[j] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), m[j]);  // = m + d q
        odd[j] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), m[j]);  // exactly
      }
      acc.add(xt + k * ldx, even);
      acc.add(xt + (k + 1) * ldx, odd);
    }
  }
  acc.store(bias, out, ldo, cols);
}

// ---- 8-bit blocks ----
// Per panel, per 32 k: 16 d (half precision, one per column), then for each k the 16 columns' q.
template <int MR, int NV>
void tile(const float* xt, int64_t ldx, const int8_t* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  Accumulators<MR, NV> acc;
  const int64_t stride = panel_size(w, K);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    __m512 d[NV];
    const int8_t* block[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      block[j] = w + j * stride + kb * kByteBlockBytes;
      d[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[j])));
      for (int64_t line = 0; line < kByteBlockBytes; line += 64)  // two blocks (~1 KB) ahead
        _mm_prefetch(reinterpret_cast<const char*>(block[j] + 2 * kByteBlockBytes + line), _MM_HINT_T0);
    }
#pragma GCC unroll 2
    for (int kk = 0; kk < 32; ++kk) {
      const int64_t k = kb * 32 + kk;
      __m512 b[NV];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block[j] + 32 + kk * 16));
        b[j] = _mm512_mul_ps(d[j], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));  // = d q, exactly
      }
      acc.add(xt + k * ldx, b);
    }
  }
  acc.store(bias, out, ldo, cols);
}

// Tiles of up to MAXR rows over NV panels for all M rows.
template <int NV, int MAXR, typename W>
void rows(const float* xt, int64_t M, const W* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  for (int64_t r0 = 0; r0 < M; r0 += MAXR) {
    const float* x = xt + r0;
    float* o = out + r0 * ldo;
    switch (std::min<int64_t>(MAXR, M - r0)) {
#define SPECLENS_TILE(n) \
  case n:                \
    if constexpr (n <= MAXR) tile<n, NV>(x, M, w, K, bias, o, ldo, cols); \
    break;
      SPECLENS_TILE(1) SPECLENS_TILE(2) SPECLENS_TILE(3) SPECLENS_TILE(4) SPECLENS_TILE(5) SPECLENS_TILE(6)
      SPECLENS_TILE(7) SPECLENS_TILE(8) SPECLENS_TILE(9) SPECLENS_TILE(10) SPECLENS_TILE(11) SPECLENS_TILE(12)
      SPECLENS_TILE(13) SPECLENS_TILE(14) SPECLENS_TILE(15) SPECLENS_TILE(16) SPECLENS_TILE(17) SPECLENS_TILE(18)
      SPECLENS_TILE(19) SPECLENS_TILE(20) SPECLENS_TILE(21) SPECLENS_TILE(22) SPECLENS_TILE(23) SPECLENS_TILE(24)
#undef SPECLENS_TILE
      default:
        break;
    }
  }
}

// Panels side by side in one tile: as many as the row count leaves registers for (4 x 6, 2 x 12 or
// 1 x 24 accumulators of 16 floats). One or two rows take one panel at a time: a single stream from
// memory read as fast as four side by side there, even for blocks (measured; and the AVX2 path does so too).
inline int64_t tile_panels(int64_t M) { return M <= 2 ? 1 : M <= 6 ? 4 : M <= 12 ? 2 : 1; }

// One work item: the output columns [0, cols) of tile_panels(M) panels, for all M rows.
template <typename W>
void span(const float* xt, int64_t M, const W* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  switch (tile_panels(M)) {
    case 4: rows<4, 6>(xt, M, w, K, bias, out, ldo, cols); break;
    case 2: rows<2, 12>(xt, M, w, K, bias, out, ldo, cols); break;
    default: rows<1, 24>(xt, M, w, K, bias, out, ldo, cols); break;
  }
}

constexpr const char* kIsa = "AVX-512";

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

// 8 weights of a panel line as floats: float32 as they are, bfloat16 widened exactly.
inline __m256 load_half(const float* p) { return _mm256_load_ps(p); }
inline __m256 load_half(const uint16_t* p) {
  const __m128i bits = _mm_load_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The 16 half-precision values at p (one per column of a panel) as floats: columns 0-7, then 8-15.
inline void load_halves(const uint8_t* p, __m256& lo, __m256& hi) {
  lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
}

// The outputs of rows [0, MR) times one panel (two 8-float halves), held in registers while a tile runs
// over k: every tile (float32 or bfloat16 lines, 4-bit or 8-bit blocks) starts it at zero, adds one k
// at a time, stores it.
template <int MR>
struct Accumulators {
  __m256 lo[MR], hi[MR];

  __attribute__((always_inline)) Accumulators() {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  }

  // one k of each output's chain (x: the rows' inputs at k; b0, b1: the panel's weights at k)
  __attribute__((always_inline)) void add(const float* x, __m256 b0, __m256 b1) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }

  // out[r, c] = the chains (+ bias[c]) for the `cols` valid columns
  __attribute__((always_inline)) void store(const float* bias, float* out, int64_t ldo, int64_t cols) const {
    alignas(32) float line[kPanel];
    const int64_t n = std::min<int64_t>(cols, kPanel);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      _mm256_store_ps(line, lo[r]);
      _mm256_store_ps(line + 8, hi[r]);
      for (int64_t c = 0; c < n; ++c) out[r * ldo + c] = bias ? line[c] + bias[c] : line[c];
    }
  }
};

// One panel for rows [0, MR); xt: the rows transposed, [K, ldx].
template <int MR, typename W>
void tile(const float* xt, int64_t ldx, const W* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  Accumulators<MR> acc;
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * kPanel;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kPanel), _MM_HINT_T0);
    acc.add(xt + k * ldx, load_half(wk), load_half(wk + 8));
  }
  acc.store(bias, out, ldo, cols);
}

// ---- 4-bit and 8-bit blocks: the AVX-512 layouts above, read 8 columns at a time ----

template <int MR>
void tile(const float* xt, int64_t ldx, const uint8_t* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  Accumulators<MR> acc;
  const __m256i nibble = _mm256_set1_epi32(15);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint8_t* block = w + kb * kBlockBytes;
    __m256 d_lo, d_hi, m_lo, m_hi;
    load_halves(block, d_lo, d_hi);
    load_halves(block + 32, m_lo, m_hi);
    for (int64_t line = 0; line < kBlockBytes; line += 64)  // three blocks (~1 KB) ahead
      _mm_prefetch(reinterpret_cast<const char*>(block + 3 * kBlockBytes + line), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int kk = 0; kk < 32; kk += 2) {  // inputs k and k + 1 share each column's byte
      const int64_t k = kb * 32 + kk;
      const __m128i pair = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 + kk * 8));
      const __m256i lo = _mm256_cvtepu8_epi32(pair), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(pair, 8));
      acc.add(xt + k * ldx,  // m + d q, exactly
              _mm256_fmadd_ps(d_lo, _mm256_cvtepi32_ps(_mm256_and_si256(lo, nibble)), m_lo),
              _mm256_fmadd_ps(d_hi, _mm256_cvtepi32_ps(_mm256_and_si256(hi, nibble)), m_hi));
      acc.add(xt + (k + 1) * ldx,
              _mm256_fmadd_ps(d_lo, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), m_lo),
              _mm256_fmadd_ps(d_hi, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), m_hi));
    }
  }
  acc.store(bias, out, ldo, cols);
}

template <int MR>
void tile(const float* xt, int64_t ldx, const int8_t* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  Accumulators<MR> acc;
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const int8_t* block = w + kb * kByteBlockBytes;
    __m256 d_lo, d_hi;
    load_halves(reinterpret_cast<const uint8_t*>(block), d_lo, d_hi);
    for (int64_t line = 0; line < kByteBlockBytes; line += 64)  // two blocks (~1 KB) ahead
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * kByteBlockBytes + line), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int kk = 0; kk < 32; ++kk) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + kk * 16));
      acc.add(xt + (kb * 32 + kk) * ldx,  // d q, exactly
              _mm256_mul_ps(d_lo, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))),
              _mm256_mul_ps(d_hi, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
    }
  }
  acc.store(bias, out, ldo, cols);
}

inline int64_t tile_panels(int64_t) { return 1; }

// One work item: the output columns [0, cols) of one panel, for all M rows in tiles of up to 6.
template <typename W>
void span(const float* xt, int64_t M, const W* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  for (int64_t r0 = 0; r0 < M; r0 += 6) {
    const float* x = xt + r0;
    float* o = out + r0 * ldo;
    switch (std::min<int64_t>(6, M - r0)) {
      case 1: tile<1>(x, M, w, K, bias, o, ldo, cols); break;
      case 2: tile<2>(x, M, w, K, bias, o, ldo, cols); break;
      case 3: tile<3>(x, M, w, K, bias, o, ldo, cols); break;
      case 4: tile<4>(x, M, w, K, bias, o, ldo, cols); break;
      case 5: tile<5>(x, M, w, K, bias, o, ldo, cols); break;
      default: tile<6>(x, M, w, K, bias, o, ldo, cols); break;
    }
  }
}

constexpr const char* kIsa = "AVX2";

#else
#error "SpecLens's native linear needs AVX-512F, or AVX2 with FMA and F16C"
#endif

// ---- integer kernels: Q8 activations against 4-bit and 8-bit weight blocks ------------------------
//
// The float kernels above rebuild every weight as a float and run one FMA per weight per row, so each
// extra row of a verified block costs the arithmetic of a whole forward. Here the rows are quantised
// like llama.cpp's Q8 blocks (per row, per 32 inputs: q = round(x * 127 / max|x|) as int8, with the
// scale max|x| / 127 and the sum of q), and a block of 32 weights meets a block of 32 inputs as one
// exact integer dot product (vpdpbusd on AVX-512 VNNI: 4 unsigned x signed byte products summed into
// each 32-bit lane; AVX2: maddubs + madd). Per block and row the float work is one or two FMAs:
//   4-bit (Q4_1, w = m + d q):  y += d dx * sum(q qx) + m (dx sum(qx))
//   8-bit (Q8_0, w = d q):      y += d dx * sum(q qx)
// Each weight block is loaded once per forward, decoded once, and used for every row of the block.
//
// Batch invariance holds as for the float kernels: a row is quantised on its own, integer sums are
// exact, and each output's float accumulation runs over the blocks in order with the same operations
// whatever the rows beside it, so a row's result is bit for bit the same alone or in any block.
//
// Layouts (uint8, built by pack_blocks / pack_byte_blocks with integer=True in native_kernels.py), per
// panel of 16 outputs and block of 32 inputs, read as 64-byte vectors of 16 lanes of 4 bytes (lane j
// is output j; its 4 bytes are 4 consecutive inputs, what one vpdpbusd lane takes):
//   4-bit [P, B, 5, 64]: 16 d and 16 m (half precision); then vectors v = 0..3, lane j byte b holding
//     q[j][4v + b] in its low nibble and q[j][16 + 4v + b] in its high one.
//   8-bit [P, B, 17, 32]: 16 d (half precision); then vectors v = 0..7, lane j byte b = q[j][4v + b]
//     (signed).

constexpr int64_t kIntRows = 16;  // rows per integer tile: what the registers hold beside a decoded block

// The rows' Q8 blocks: values [M, K] int8, scales and sums [M, K / 32].
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
};

inline int32_t load_u32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

constexpr const char* kIntegerIsa = "AVX-512 VNNI";

// One row's Q8 blocks (K a multiple of 32). round-to-nearest-even (the default rounding mode).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtepi32_epi8(qhi));
    d[b] = amax / 127.0f;
    s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

// Rows [0, MR) of one panel: q, d, s point at the first row's Q8 blocks (rows K and K / 32 apart);
// w: the panel's blocks; out [MR, ldo], `cols` valid columns.
template <int MR, bool Nibbles>
void int_tile(const int8_t* q, const float* d, const int32_t* s, int64_t K, const uint8_t* w, float* out,
              int64_t ldo, int64_t cols, bool add) {
  constexpr int64_t bytes = Nibbles ? 320 : 544;
  const int64_t B = K / 32;
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t kb = 0; kb < B; ++kb) {
    const uint8_t* block = w + kb * bytes;
    for (int64_t line = 0; line < bytes; line += 64)  // two blocks (~1 KB) ahead
      _mm_prefetch(reinterpret_cast<const char*>(block + 8 * bytes + line), _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
    __m512 mw = _mm512_setzero_ps();
    __m512i wv[8];  // unsigned bytes: q (4-bit) or q + 128 (8-bit)
    if constexpr (Nibbles) {
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        const __m512i both = _mm512_loadu_si512(block + 64 + 64 * v);
        wv[v] = _mm512_and_si512(both, low4);
        wv[4 + v] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low4);
      }
    } else {
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v) wv[v] = _mm512_xor_si512(_mm512_loadu_si512(block + 32 + 64 * v), flip);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const int8_t* x = q + r * K + kb * 32;
      // two independent chains of four (integer sums: their order changes nothing)
      __m512i sum = _mm512_setzero_si512(), other = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        sum = _mm512_dpbusd_epi32(sum, wv[v], _mm512_set1_epi32(load_u32(x + 4 * v)));
        other = _mm512_dpbusd_epi32(other, wv[4 + v], _mm512_set1_epi32(load_u32(x + 16 + 4 * v)));
      }
      sum = _mm512_add_epi32(sum, other);
      const float dx = d[r * B + kb];
      const int32_t sx = s[r * B + kb];
      if constexpr (Nibbles) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[r]);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dx * static_cast<float>(sx)), acc[r]);
      } else {  // sum((q + 128) qx) - 128 sum(qx) = sum(q qx)
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * sx));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[r]);
      }
    }
  }
  const __mmask16 mask = column_mask(cols);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    if (add) acc[r] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out + r * ldo), acc[r]);  // out + y, as add_ does
    _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr const char* kIntegerIsa = "AVX2";

inline void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* s) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(x[32 * b + i] * inv));
      q[32 * b + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = amax / 127.0f;
    s[b] = sum;
  }
}

// The AVX-512 layouts read as two halves of 8 lanes (outputs 0-7, then 8-15); u8 x s8 products in
// pairs (maddubs), then in fours (madd): exact, as the products stay within 16 bits (4-bit: 15 x 127
// x 2; 8-bit: |q| <= 128 with the sign moved onto qx, 128 x 127 x 2).
template <int MR, bool Nibbles>
void int_tile(const int8_t* q, const float* d, const int32_t* s, int64_t K, const uint8_t* w, float* out,
              int64_t ldo, int64_t cols, bool add) {
  constexpr int64_t bytes = Nibbles ? 320 : 544;
  const int64_t B = K / 32;
  __m256 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t kb = 0; kb < B; ++kb) {
    const uint8_t* block = w + kb * bytes;
    for (int64_t line = 0; line < bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block + 2 * bytes + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * h)));
      const __m256 mw = Nibbles ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * h)))
                                : _mm256_setzero_ps();
      __m256i wv[8];
      for (int v = 0; v < 8; ++v) {
        if (Nibbles) {
          const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 + 64 * (v % 4) + 32 * h));
          wv[v] = v < 4 ? _mm256_and_si256(both, low4) : _mm256_and_si256(_mm256_srli_epi16(both, 4), low4);
        } else {
          wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 + 64 * v + 32 * h));
        }
      }
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = q + r * K + kb * 32;
        __m256i sum = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
          const __m256i xv = _mm256_set1_epi32(load_u32(x + 4 * v));
          const __m256i pairs = Nibbles ? _mm256_maddubs_epi16(wv[v], xv)
                                        : _mm256_maddubs_epi16(_mm256_sign_epi8(wv[v], wv[v]), _mm256_sign_epi8(xv, wv[v]));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));
        }
        const float dx = d[r * B + kb];
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(dx)), acc[r][h]);
        if (Nibbles) acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(dx * static_cast<float>(s[r * B + kb])), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, acc[r][0]);
      _mm256_store_ps(lanes + 8, acc[r][1]);
      out[r * ldo + c] = add ? out[r * ldo + c] + lanes[c] : lanes[c];
    }
}

#endif

// All M rows of one panel, in tiles of up to kIntRows rows (the panel, a few KB, stays in cache).
template <bool Nibbles>
void int_rows(const Q8Rows& x, int64_t M, int64_t K, const uint8_t* w, float* out, int64_t ldo, int64_t cols,
              bool add) {
  const int64_t B = K / 32;
  for (int64_t r0 = 0; r0 < M; r0 += kIntRows) {
    const int8_t* q = x.q.data() + r0 * K;
    const float* d = x.d.data() + r0 * B;
    const int32_t* s = x.s.data() + r0 * B;
    float* o = out + r0 * ldo;
    switch (std::min<int64_t>(kIntRows, M - r0)) {
#define SPECLENS_INT_TILE(n) \
  case n:                    \
    int_tile<n, Nibbles>(q, d, s, K, w, o, ldo, cols, add); \
    break;
      SPECLENS_INT_TILE(1) SPECLENS_INT_TILE(2) SPECLENS_INT_TILE(3) SPECLENS_INT_TILE(4)
      SPECLENS_INT_TILE(5) SPECLENS_INT_TILE(6) SPECLENS_INT_TILE(7) SPECLENS_INT_TILE(8)
      SPECLENS_INT_TILE(9) SPECLENS_INT_TILE(10) SPECLENS_INT_TILE(11) SPECLENS_INT_TILE(12)
      SPECLENS_INT_TILE(13) SPECLENS_INT_TILE(14) SPECLENS_INT_TILE(15) SPECLENS_INT_TILE(16)
#undef SPECLENS_INT_TILE
      default:
        break;
    }
  }
}


// ---- attention ------------------------------------------------------------------------------------

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vround(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vselect_nonnegative(Vec x, Vec yes, Vec no) {  // lanes where x >= 0 from yes, the rest from no
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), no, yes);
}
inline Vec vpow2(Vec n) {  // 2^n for integral n in [-127, 127]
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#else
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vsum(Vec v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
inline Vec vround(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vselect_nonnegative(Vec x, Vec yes, Vec no) {
  return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline Vec vpow2(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

// e^x for x <= 0 (softmax arguments after subtracting the maximum), within 2 ulp down to e^-87;
// below that it returns about 1e-38 rather than 0, which a softmax total never notices.
inline Vec vexp(Vec x) {
  x = vmax(x, vset1(-87.0f));
  const Vec n = vround(vmul(x, vset1(1.44269504088896341f)));
  Vec r = vsub(x, vmul(n, vset1(0.693145751953125f)));
  r = vsub(r, vmul(n, vset1(1.42860682030941723e-6f)));
  Vec p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vmul(p, vpow2(n));
}

#if defined(__AVX512F__)
// The lanes l of a vector without bit St set, in order, then the same lanes + 16 (lanes of the second
// operand of a two-vector permute); + St, the lanes each is added to.
template <int St>
__m512i pair_index(int offset) {
  alignas(64) int32_t lanes[16];
  for (int l = 0, n = 0; l < 16; ++l)
    if (!(l & St)) lanes[n] = l + offset, lanes[n + 8] = l + 16 + offset, ++n;
  return _mm512_load_si512(lanes);
}

// Lanes 0-7: x[l] + x[l + St] over the lanes l without bit St, in order; lanes 8-15: the same of y.
template <int St>
inline Vec pair_sum(Vec x, Vec y) {
  static const __m512i first = pair_index<St>(0), second = pair_index<St>(St);
  return _mm512_add_ps(_mm512_permutex2var_ps(x, first, y), _mm512_permutex2var_ps(x, second, y));
}

// Lane j of the result: the sum of the lanes of acc[j], over one fixed tree (lanes l and l + 8, then
// l and l + 4, l + 2, l + 1), whichever vectors share the batch.
inline Vec reduce_batch(Vec* acc) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) acc[i] = pair_sum<8>(acc[2 * i], acc[2 * i + 1]);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) acc[i] = pair_sum<4>(acc[2 * i], acc[2 * i + 1]);
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) acc[i] = pair_sum<2>(acc[2 * i], acc[2 * i + 1]);
  return pair_sum<1>(acc[0], acc[1]);
}
#else
// Lane j of the result: the sum of the lanes of acc[j] (lanes l and l + 4, then l + 2, then l + 1).
inline Vec reduce_batch(Vec* acc) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    acc[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x20),
                           _mm256_permute2f128_ps(acc[2 * i], acc[2 * i + 1], 0x31));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    acc[i] = _mm256_add_ps(_mm256_shuffle_ps(acc[2 * i], acc[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(acc[2 * i], acc[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const Vec r = _mm256_add_ps(_mm256_shuffle_ps(acc[0], acc[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(acc[0], acc[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// q . k for kLanes keys at once (rows[j]; C vectors of head dimension): lane j is key j's dot product,
// a fused multiply-add chain over the head dimension in steps of kLanes, then reduce_batch's tree.
template <int C>
inline Vec batch_dots(const Vec* q, const float* const* rows) {
  Vec acc[kLanes];
#pragma GCC unroll 16
  for (int64_t j = 0; j < kLanes; ++j) {
    Vec a = vfma(q[0], vload(rows[j]), vzero());
#pragma GCC unroll 16
    for (int i = 1; i < C; ++i) a = vfma(q[i], vload(rows[j] + i * kLanes), a);
    acc[j] = a;
  }
  return reduce_batch(acc);
}


// R query heads of one key/value group at one query position, over their n compacted keys (keys[c]: cache
// rows of k and v, strides ks and vs); C vectors of head dimension. q: head r at q + r * qs; out: head r
// at out + r * C * kLanes; weights: scratch for R * (n + kLanes) floats. The heads share every key and
// value row they load, while each head's arithmetic is what it would be alone: the same batches of
// compacted keys, the same chains in the same order.
template <int C>
void attend_rows(const float* q, int64_t qs, int64_t R, const float* k, int64_t ks, const float* v, int64_t vs,
                 const int64_t* keys, int64_t n, double scale, float* weights, float* out) {
  if (n == 0) {  // a fully masked row (padding): zeros, as SDPA's math gives no meaningful answer
    std::fill(out, out + R * C * kLanes, 0.0f);
    return;
  }
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  // scores in batches of kLanes keys of the compacted sequence; a short last batch repeats its last
  // key in the spare lanes, which never mix with the others and are then dropped
  const Vec scale_v = vset1(static_cast<float>(scale));
  Vec top_v[kMaxHeads];
  for (int64_t r = 0; r < R; ++r) top_v[r] = vset1(-INFINITY);
  for (int64_t c = 0; c < padded; c += kLanes) {
    const float* rows[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) rows[l] = k + keys[std::min(c + l, n - 1)] * ks;
    for (int64_t r = 0; r < R; ++r) {
      Vec qv[C];
#pragma GCC unroll 16
      for (int i = 0; i < C; ++i) qv[i] = vload(q + r * qs + i * kLanes);
      const Vec scores = vmul(scale_v, batch_dots<C>(qv, rows));
      vstore(weights + r * padded + c, scores);
      top_v[r] = vmax(top_v[r], scores);  // the repeated key changes no maximum
    }
  }
  alignas(64) float lanes[kLanes];
  Vec inverse[kMaxHeads];
  for (int64_t r = 0; r < R; ++r) {
    float* w = weights + r * padded;
    vstore(lanes, top_v[r]);
    const Vec top = vset1(*std::max_element(lanes, lanes + kLanes));
    Vec total = vzero();
    for (int64_t c = 0; c < padded; c += kLanes) {
      Vec e = vexp(vsub(vload(w + c), top));
      if (c + kLanes > n) {  // lanes past the last key weigh exactly nothing
        vstore(lanes, e);
        for (int64_t l = n - c; l < kLanes; ++l) lanes[l] = 0.0f;
        e = vload(lanes);
      }
      vstore(w + c, e);
      total = vadd(total, e);
    }
    inverse[r] = vset1(1.0f / vsum(total));
  }
  // each output: two chains over the compacted keys in order, the even ones and the odd ones (two
  // chains run twice as fast as one), added at the end. Keys go in spans of kSpan (even, so a pair
  // never straddles two spans) whose value rows stay in L1 while every head takes them; a head's
  // chains wait in `chains` between spans, which leaves their arithmetic untouched.
  Vec chains[kMaxHeads][2][C];
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i) chains[r][0][i] = chains[r][1][i] = vzero();
  for (int64_t c0 = 0; c0 < n; c0 += kSpan) {
    const int64_t c1 = std::min(n, c0 + kSpan);
    for (int64_t r = 0; r < R; ++r) {
      const float* w = weights + r * padded;
      Vec even[C], odd[C];
#pragma GCC unroll 16
      for (int i = 0; i < C; ++i) even[i] = chains[r][0][i], odd[i] = chains[r][1][i];
      int64_t c = c0;
      for (; c + 1 < c1; c += 2) {
        const Vec we = vset1(w[c]), wo = vset1(w[c + 1]);
        const float* re = v + keys[c] * vs;
        const float* ro = v + keys[c + 1] * vs;
#pragma GCC unroll 16
        for (int i = 0; i < C; ++i) {
          even[i] = vfma(we, vload(re + i * kLanes), even[i]);
          odd[i] = vfma(wo, vload(ro + i * kLanes), odd[i]);
        }
      }
      if (c < c1) {  // only at the very end (spans are even): the odd last key joins the even chain
        const Vec we = vset1(w[c]);
        const float* re = v + keys[c] * vs;
#pragma GCC unroll 16
        for (int i = 0; i < C; ++i) even[i] = vfma(we, vload(re + i * kLanes), even[i]);
      }
#pragma GCC unroll 16
      for (int i = 0; i < C; ++i) chains[r][0][i] = even[i], chains[r][1][i] = odd[i];
    }
  }
  for (int64_t r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int i = 0; i < C; ++i)
      vstore(out + r * C * kLanes + i * kLanes, vmul(vadd(chains[r][0][i], chains[r][1][i]), inverse[r]));
}

}  // namespace

// [N, K] float32 -> panels [P, K, 16], P = N rounded up to 64, over 16 (zero padded), in float32 or
// rounded to bfloat16 (half the bytes to stream; for drafters, whose precision never touches exactness).
torch::Tensor pack(const torch::Tensor& weight, bool bfloat16) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack takes a float32 CPU weight [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t padded = (N + kGroup - 1) / kGroup * kGroup;
  auto full = torch::zeros({padded, K}, weight.options());
  full.narrow(0, 0, N).copy_(weight);
  auto panels = full.view({padded / kPanel, kPanel, K}).transpose(1, 2);
  return (bfloat16 ? panels.to(torch::kBFloat16) : panels).contiguous();
}

// Whether panels are in an integer layout: 4-bit [P, B, 5, 64] (nibbles) or 8-bit [P, B, 17, 32].
bool integer_nibbles(const torch::Tensor& panels, int64_t K, int64_t N) {
  const bool nibbles = panels.size(2) == 5 && panels.size(3) == 64, bytes = panels.size(2) == 17 && panels.size(3) == 32;
  TORCH_CHECK(panels.scalar_type() == torch::kByte && panels.is_contiguous() && (nibbles || bytes) && K % 32 == 0 &&
                  panels.size(1) == K / 32 && panels.size(0) * kPanel >= N,
              "integer blocks do not fit this input");
  return nibbles;
}

// out [M, N] (= or +=) the M rows xs [M, K], each quantised to Q8 blocks on its own, against integer blocks.
// With `residual` (16-bit activations) a row becomes two Q8 rows: its blocks, then the blocks of what
// their rounding left (x - d q, quantised again, so about 16 bits of each activation survive), and its
// output is the sum of the two rows' outputs: twice the integer work of a row, still on its own.
void integer_product(const float* xs, int64_t M, int64_t K, const torch::Tensor& panels, int64_t N, float* out,
                     bool add, bool residual = false) {
  const bool nibbles = integer_nibbles(panels, K, N);
  const int64_t B = K / 32, R = residual ? 2 * M : M;
  Q8Rows rows;
  rows.q.resize(R * K);
  rows.d.resize(R * B);
  rows.s.resize(R * B);
  std::vector<float> rest(residual ? K : 0);
  for (int64_t r = 0; r < M; ++r) {  // each row on its own: its blocks never see another row
    const int64_t at = residual ? 2 * r : r;
    const float* x = xs + r * K;
    int8_t* q = rows.q.data() + at * K;
    float* d = rows.d.data() + at * B;
    quantize_row(x, K, q, d, rows.s.data() + at * B);
    if (!residual) continue;
    for (int64_t i = 0; i < K; ++i) rest[i] = std::fma(-d[i / 32], static_cast<float>(q[i]), x[i]);  // exact
    quantize_row(rest.data(), K, q + K, d + B, rows.s.data() + (at + 1) * B);
  }
  std::vector<float> parts(residual ? R * N : 0);  // [2M, N]: each row's two outputs
  float* into = residual ? parts.data() : out;
  const uint8_t* w = panels.data_ptr<uint8_t>();
  const int64_t stride = B * (nibbles ? 320 : 544), used = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, used, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
      if (nibbles) int_rows<true>(rows, R, K, w + p * stride, into + p * kPanel, N, cols, add && !residual);
      else int_rows<false>(rows, R, K, w + p * stride, into + p * kPanel, N, cols, add && !residual);
    }
  });
  if (!residual) return;
  for (int64_t r = 0; r < M; ++r) {
    const float* a = parts.data() + 2 * r * N;
    const float* b = a + N;
    float* o = out + r * N;
    for (int64_t n = 0; n < N; ++n) o[n] = add ? o[n] + (a[n] + b[n]) : a[n] + b[n];
  }
}

// x [..., K] float32 quantised to Q8 blocks, against integer-layout blocks [P, K / 32, 5, 64] (4-bit) or
// [P, K / 32, 17, 32] (8-bit); bias [N] or None -> [..., N]. linear() sends integer layouts here.
torch::Tensor linear_integer(const torch::Tensor& x, const torch::Tensor& panels,
                             const c10::optional<torch::Tensor>& bias, int64_t N, bool residual) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "linear takes float32 CPU input");
  integer_nibbles(panels, K, N);
  const auto flat = x.reshape({-1, K}).contiguous();
  const int64_t M = flat.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out.view(sizes);
  integer_product(flat.data_ptr<float>(), M, K, panels, N, out.data_ptr<float>(), false, residual);
  if (bias.has_value() && bias->defined()) {
    const auto b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "bias must be float32 [N]");
    out.add_(b);
  }
  return out.view(sizes);
}

// x [..., K] float32, panels from pack(), bias [N] or None -> [..., N]; residual: integer layouts only,
// 16-bit activations as two Q8 rows (integer_product).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                     int64_t N, bool residual) {
  if (panels.dim() == 4) return linear_integer(x, panels, bias, N, residual);
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "linear takes float32 CPU input");
  const bool nibbles = panels.scalar_type() == torch::kUInt8, bytes = panels.scalar_type() == torch::kChar;
  TORCH_CHECK(panels.scalar_type() == torch::kFloat32 || panels.scalar_type() == torch::kBFloat16 ||
                  nibbles || bytes,
              "panels are float32 or bfloat16, or 4-bit or 8-bit blocks");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(0) * kPanel >= N &&
                  (panels.size(0) * kPanel) % kGroup == 0 &&
                  (nibbles || bytes ? K % 32 == 0 && panels.size(1) == K / 32 &&
                                          panels.size(2) == (nibbles ? kBlockBytes : kByteBlockBytes)
                                    : panels.size(1) == K && panels.size(2) == kPanel),
              "panels do not fit this input");
  const auto flat = x.reshape({-1, K});
  const int64_t M = flat.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out.view(sizes);
  // [K, M]: a tile's rows sit side by side at each k, so its broadcasts share one pointer (a plain
  // loop here: torch's strided copy cost more than the product itself for a handful of rows)
  const auto src = flat.contiguous();
  const float* xs = src.data_ptr<float>();
  std::vector<float> transposed;
  if (M > 1) {
    transposed.resize(M * K);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t k = 0; k < K; ++k) transposed[k * M + r] = xs[r * K + k];
  }
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "bias must be float32 [N]");
  }
  const float* xp = M > 1 ? transposed.data() : xs;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // Work items of one tile's columns each, so that the threads split even the narrow products (576
  // columns are 9 groups of 64, which two threads would have split 5 to 4)
  const int64_t width = kPanel * tile_panels(M);
  const int64_t items = (N + width - 1) / width;
  const auto run = [&](const auto* wp) {
    const int64_t stride = tile_panels(M) * panel_size(wp, K);  // elements per work item
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        span(xp, M, wp + i * stride, K, bp ? bp + i * width : nullptr, op + i * width, N,
             std::min<int64_t>(width, N - i * width));
      }
    });
  };
  if (nibbles) run(panels.data_ptr<uint8_t>());
  else if (bytes) run(panels.data_ptr<int8_t>());
  else if (panels.scalar_type() == torch::kBFloat16) run(reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>()));
  else run(panels.data_ptr<float>());
  return out.view(sizes);
}


// q [T, H, D] (any strides, last dim contiguous), k and v [G, S, D] (the same), mask [T, S'] with
// S' >= S (bool: true = may attend; float: 0 = may attend, -inf or the dtype's lowest = may not) or
// undefined (then causal: query t sees keys 0 .. S - T + t; or every key when `causal` is false)
// -> out [T, H, D]. A float mask with any other value is refused: the caller falls back.
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const c10::optional<torch::Tensor>& mask, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attention takes q [T, H, D], k and v [G, S, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32 && q.device().is_cpu(), "attention takes float32 CPU tensors");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), G = k.size(0), S = k.size(1);
  TORCH_CHECK(D % kLanes == 0 && v.size(2) == D && k.size(2) == D && v.size(0) == G && v.size(1) == S &&
                  G > 0 && H % G == 0, "unsupported attention shapes");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "the head dimension must be contiguous");
  const bool masked = mask.has_value() && mask->defined();
  torch::Tensor m;
  if (masked) {
    m = *mask;
    TORCH_CHECK(m.dim() == 2 && m.size(0) == T && m.size(1) >= S, "the mask must be [T, >= S]");
    TORCH_CHECK(m.scalar_type() == torch::kBool || m.scalar_type() == torch::kFloat32, "bool or float32 mask");
  }
  auto out = torch::empty({T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0),
                vs1 = v.stride(1), group = H / G;
  const bool* mb = masked && m.scalar_type() == torch::kBool ? m.data_ptr<bool>() : nullptr;
  const float* mf = masked && m.scalar_type() == torch::kFloat32 ? m.data_ptr<float>() : nullptr;
  const int64_t ms0 = masked ? m.stride(0) : 0, ms1 = masked ? m.stride(1) : 0;
  std::atomic<bool> refused{false};
  // A work item is one query position and `chunk` heads of one key/value group, which share the key and
  // value rows they load and the mask's compaction. One-token decoding spreads single heads over the
  // threads instead. Either way every head's arithmetic is the same.
  const int64_t chunk = T >= 4 && group <= kMaxHeads ? group : 1, per_group = group / chunk;
  const auto run = [&](auto chunks) {
    constexpr int C = decltype(chunks)::value;
    at::parallel_for(0, G * T * per_group, 1, [&](int64_t i0, int64_t i1) {
      std::vector<int64_t> keys(S);
      std::vector<float> weights(chunk * (S + kLanes));
      for (int64_t i = i0; i < i1; ++i) {
        // items grouped by key/value head, so that a thread's keys and values stay in its cache
        const int64_t g = i / (T * per_group), t = i % (T * per_group) / per_group,
                      h = g * group + i % per_group * chunk;
        int64_t n = 0;  // the keys this query sees, in cache order
        if (mb && ms1 == 1) {  // a bool row is mostly runs of keys seen (the context): jump from run to run
          const char* row = reinterpret_cast<const char*>(mb + t * ms0);
          for (int64_t j = 0; j < S;) {
            const void* stop = std::memchr(row + j, 0, S - j);
            const int64_t end = stop ? static_cast<const char*>(stop) - row : S;
            for (; j < end; ++j) keys[n++] = j;
            for (++j; j < S && !row[j]; ++j) {}
          }
        } else if (mb || mf) {
          for (int64_t j = 0; j < S; ++j) {
            bool sees;
            if (mb) {
              sees = mb[t * ms0 + j * ms1];
            } else {
              const float x = mf[t * ms0 + j * ms1];
              sees = x == 0.0f;
              if (!sees && !(x < -1e30f)) refused = true;
            }
            if (sees) keys[n++] = j;
          }
        } else {
          for (const int64_t last = causal ? S - T + t : S - 1; n <= last; ++n) keys[n] = n;
        }
        attend_rows<C>(qp + t * qs0 + h * qs1, qs1, chunk, kp + g * ks0, ks1, vp + g * vs0, vs1, keys.data(), n,
                       scale, weights.data(), op + (t * H + h) * D);
      }
    });
  };
  switch (D / kLanes) {
    case 1: run(std::integral_constant<int, 1>()); break;
    case 2: run(std::integral_constant<int, 2>()); break;
    case 4: run(std::integral_constant<int, 4>()); break;
    case 8: run(std::integral_constant<int, 8>()); break;
    case 16: run(std::integral_constant<int, 16>()); break;
    default: TORCH_CHECK(false, "head dimension ", D, " is not ", kLanes, " times 1, 2, 4, 8 or 16");
  }
  TORCH_CHECK(!refused, "the float mask holds values other than 0 and -inf");
  return out;
}

// ---- a whole Llama decoder stack ----------------------------------------------------------------------

namespace {

// HF's LlamaRMSNorm in float32, row by row: w * (x * 1 / sqrt(mean(x^2) + eps)). The squares are summed
// in kLanes running sums (a ragged tail into the first lanes), then across lanes, in a fixed order that
// depends only on the row's length, so a row's result never depends on the rows beside it.
void rms_norm(const float* x, const float* w, int64_t T, int64_t H, double eps, float* y) {
  alignas(64) float lanes[kLanes];
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * H;
    Vec sums = vzero();
    int64_t i = 0;
    for (; i + kLanes <= H; i += kLanes) sums = vfma(vload(xt + i), vload(xt + i), sums);
    vstore(lanes, sums);
    for (int64_t l = 0; i < H; ++i, ++l) lanes[l] = std::fma(xt[i], xt[i], lanes[l]);
    float sum = 0.0f;
    for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + static_cast<float>(eps));
    for (int64_t j = 0; j < H; ++j) y[t * H + j] = w[j] * (xt[j] * inv);
  }
}

// Rotary positions in place on heads [T, n, D] (row stride ld): x * cos + rotate_half(x) * sin, with the
// fused multiply-adds spelled out, so that no compiler choice (vector body or scalar remainder) can
// round one position differently from another.
void rotate(float* x, int64_t ld, int64_t T, int64_t n, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  std::vector<float> row(D);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < n; ++h) {
      float* xh = x + t * ld + h * D;
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      std::copy(xh, xh + D, row.begin());
      for (int64_t d = 0; d < half; ++d) xh[d] = std::fma(row[d], c[d], -row[d + half] * s[d]);
      for (int64_t d = half; d < D; ++d) xh[d] = std::fma(row[d], c[d], row[d - half] * s[d]);
    }
}

// silu(gate) * up, elementwise (gate at g, up at u, rows ld apart; out [T, I]): x * sigmoid(x) * up, the
// sigmoid from e^-|x| (which the vector exponential takes: it is made for arguments <= 0), 1 / (1 + e)
// for x >= 0 and e / (1 + e) below. A ragged tail goes through the same vector code, zero padded.
void silu_mul(const float* g, const float* u, int64_t ld, int64_t T, int64_t I, float* out) {
  alignas(64) float gate[kLanes], up[kLanes], result[kLanes];
  const Vec one = vset1(1.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; i += kLanes) {
      const int64_t n = std::min<int64_t>(kLanes, I - i);
      const float* gi = g + t * ld + i;
      const float* ui = u + t * ld + i;
      Vec x, y;
      if (n == kLanes) {
        x = vload(gi), y = vload(ui);
      } else {
        std::fill(gate, gate + kLanes, 0.0f), std::fill(up, up + kLanes, 0.0f);
        std::copy(gi, gi + n, gate), std::copy(ui, ui + n, up);
        x = vload(gate), y = vload(up);
      }
      const Vec e = vexp(vsub(vzero(), vmax(x, vsub(vzero(), x))));  // e^-|x|
      const Vec sigmoid = vdiv(vselect_nonnegative(x, one, e), vadd(one, e));
      const Vec z = vmul(vmul(x, sigmoid), y);
      if (n == kLanes) {
        vstore(out + t * I + i, z);
      } else {
        vstore(result, z);
        std::copy(result, result + n, out + t * I + i);
      }
    }
  }
}

}  // namespace

// x [T, H] += rows [T, K] @ W^T: integer blocks add into x in the tile's store (no product tensor, no
// add_ call: at T = 1 those were a tenth of a layer's time); other panels through linear() and add_.
void add_product(torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& panels, bool residual) {
  const int64_t H = x.size(1);
  if (panels.dim() == 4 && rows.is_contiguous()) {
    integer_product(rows.data_ptr<float>(), rows.size(0), rows.size(1), panels, H, x.data_ptr<float>(), true, residual);
  } else {
    x.add_(linear(rows, panels, c10::nullopt, H, residual));
  }
}

// A Llama decoder stack on the kernels above, HF's LlamaDecoderLayer math per layer, without a trip
// back to Python between ops. x [T, H] embeddings; cos, sin [T, D]; per layer six tensors in
// `weights`: input norm [H], q/k/v panels stacked (columns: q at 0, k at k_at, v at v_at), o panels,
// post-attention norm [H], gate/up panels stacked (up at up_at), down panels; keys[l], values[l]: the
// layer's cache buffers [G, capacity, D] whose first `cached` rows are filled, the new rows written
// after them; mask [T, cached + T] bool or undefined (causal). Returns the logits [n_logits, V] of the
// last rows (none for n_logits = 0) and, if keep_hidden, the final hidden states [T, H] (else an empty
// tensor), after final_norm if one is given (an EAGLE head has none). residual: every integer product takes
// 16-bit activations (integer_product).
std::vector<torch::Tensor> decoder(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                   const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& keys,
                                   const std::vector<torch::Tensor>& values, int64_t cached,
                                   const c10::optional<torch::Tensor>& mask,
                                   const c10::optional<torch::Tensor>& final_norm,
                                   const c10::optional<torch::Tensor>& lm_panels, int64_t vocab, int64_t heads, int64_t kv_heads,
                                   int64_t k_at, int64_t v_at, int64_t intermediate, int64_t up_at, double eps,
                                   double scale, int64_t n_logits, bool keep_hidden, bool residual) {
  const int64_t T = x.size(0), H = x.size(1), D = cos.size(1), layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == T && weights.size() == static_cast<size_t>(6 * layers) && values.size() == keys.size() &&
                  0 <= n_logits && n_logits <= T && (n_logits == 0 || (lm_panels.has_value() && lm_panels->defined())),
              "decoder: inputs do not fit");
  x = x.clone();
  auto normed = torch::empty_like(x);
  auto act = torch::empty({T, intermediate}, x.options());
  const int64_t end = cached + T;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor* w = weights.data() + 6 * l;
    const auto& k_cache = keys[l];
    const auto& v_cache = values[l];
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == kv_heads && k_cache.size(1) >= end && k_cache.size(2) == D &&
                    k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
                "decoder: a cache buffer does not fit");
    rms_norm(x.data_ptr<float>(), w[0].data_ptr<float>(), T, H, eps, normed.data_ptr<float>());
    auto qkv = linear(normed, w[1], c10::nullopt, w[1].size(0) * kPanel, residual);  // [T, q | k | v]
    float* qp = qkv.data_ptr<float>();
    const int64_t ld = qkv.size(1);
    rotate(qp, ld, T, heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
    rotate(qp + k_at, ld, T, kv_heads, D, cos.data_ptr<float>(), sin.data_ptr<float>());
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    const int64_t capacity = k_cache.size(1);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < kv_heads; ++g) {
        std::copy(qp + t * ld + k_at + g * D, qp + t * ld + k_at + (g + 1) * D, kc + (g * capacity + cached + t) * D);
        std::copy(qp + t * ld + v_at + g * D, qp + t * ld + v_at + (g + 1) * D, vc + (g * capacity + cached + t) * D);
      }
    const auto q = qkv.narrow(1, 0, heads * D).view({T, heads, D});
    const auto attended = attention(q, k_cache.narrow(1, 0, end), v_cache.narrow(1, 0, end), mask, scale, true);
    add_product(x, attended.view({T, heads * D}), w[2], residual);
    rms_norm(x.data_ptr<float>(), w[3].data_ptr<float>(), T, H, eps, normed.data_ptr<float>());
    auto gate_up = linear(normed, w[4], c10::nullopt, w[4].size(0) * kPanel, residual);  // [T, gate | up]
    const float* gp = gate_up.data_ptr<float>();
    silu_mul(gp, gp + up_at, gate_up.size(1), T, intermediate, act.data_ptr<float>());
    add_product(x, act, w[5], residual);
  }
  const int64_t rows = keep_hidden ? T : n_logits;
  auto hidden = x.narrow(0, T - rows, rows);
  if (final_norm.has_value() && final_norm->defined()) {
    hidden = torch::empty({rows, H}, x.options());
    rms_norm(x.data_ptr<float>() + (T - rows) * H, final_norm->data_ptr<float>(), rows, H, eps, hidden.data_ptr<float>());
  }
  auto logits = n_logits ? linear(hidden.narrow(0, rows - n_logits, n_logits), *lm_panels, c10::nullopt, vocab, residual)
                         : torch::empty({0, vocab}, x.options());
  return {logits, keep_hidden ? hidden : torch::empty({0, H}, x.options())};
}

// After a tree's verification, in each KV cache buffer [B, G, capacity, D] (contiguous float32): row
// dst[i] takes row src[i], for i in order. Both ascend and dst[i] <= src[i] (the accepted path moves
// towards the root), so no row is overwritten before it is read. One call for every layer's keys and
// values, where a Python loop spent two indexing ops per buffer.
void move_rows(const std::vector<torch::Tensor>& buffers, const std::vector<int64_t>& src,
               const std::vector<int64_t>& dst) {
  TORCH_CHECK(src.size() == dst.size(), "move_rows: src and dst differ in length");
  for (size_t i = 0; i < src.size(); ++i)
    TORCH_CHECK(0 <= dst[i] && dst[i] <= src[i] && (i == 0 || (src[i - 1] < src[i] && dst[i - 1] < dst[i])),
                "move_rows: rows must ascend and move towards the start");
  for (const auto& buffer : buffers) {
    TORCH_CHECK(buffer.dim() == 4 && buffer.is_contiguous() && buffer.scalar_type() == torch::kFloat32 &&
                    buffer.device().is_cpu() && (src.empty() || src.back() < buffer.size(2)),
                "move_rows: a buffer is not a contiguous float32 CPU [B, G, capacity, D] holding these rows");
    const int64_t planes = buffer.size(0) * buffer.size(1), capacity = buffer.size(2), D = buffer.size(3);
    float* p = buffer.data_ptr<float>();
    for (int64_t plane = 0; plane < planes; ++plane)
      for (size_t i = 0; i < src.size(); ++i)
        if (src[i] != dst[i])
          std::memcpy(p + (plane * capacity + dst[i]) * D, p + (plane * capacity + src[i]) * D, D * sizeof(float));
  }
}

std::string isa() { return kIsa; }
std::string integer_isa() { return kIntegerIsa; }

// The compute calls let go of the GIL (they touch no Python object): the window's GUI thread keeps drawing
// while the model thread runs a long prefill chunk, and a Stop is seen at once.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("pack", &pack, "float32 weight [N, K] -> panels [P, K, 16] in float32 or bfloat16",
        py::arg("weight"), py::arg("bfloat16") = false, no_gil());
  m.def("linear", &linear, "x [..., K] @ W^T (+ bias) from packed panels (residual: 16-bit activations on integer blocks)",
        py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("out_features"), py::arg("residual") = false, no_gil());
  m.def("attention", &attention, "batch-invariant attention of q [T, H, D] over k, v [G, S, D]", no_gil());
  m.def("decoder", &decoder, "a Llama decoder stack, its final norm and LM head, on these kernels", no_gil());
  m.def("move_rows", &move_rows, "move KV cache rows towards the start in every buffer [B, G, capacity, D]",
        no_gil());
  m.def("isa", &isa, "the instruction set this build uses");
  m.def("integer_isa", &integer_isa, "the instruction set of the integer (Q8 activation) kernels");
}
