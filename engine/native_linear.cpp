// SpecLens's float32 linear kernel for small row counts on x86-64 CPUs (AVX-512F, or AVX2 + FMA).
//
// y[M, N] = x[M, K] W^T (+ bias) with W repacked once into panels of 16 output columns,
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
// Built at first use by engine/native_kernels.py (torch.utils.cpp_extension, -march=native).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: one 64-byte line of weights per k
constexpr int64_t kGroup = 64;  // output columns per work item handed to a thread
constexpr int64_t kPrefetch = 32;  // k steps ahead to prefetch each panel stream (2 KB)

#if defined(__AVX512F__)

inline __mmask16 column_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// Rows [0, MR) times NV panels. xt: the rows transposed, [K, ldx]; w: the first panel [K, 16],
// later panels K * 16 floats apart; out: [MR, ldo], `cols` valid columns from out[0].
template <int MR, int NV>
void tile(const float* xt, int64_t ldx, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  __m512 acc[MR][NV];
#pragma GCC unroll 24
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kPanel;
    __m512 b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      b[j] = _mm512_load_ps(wk + j * K * kPanel);
      _mm_prefetch(reinterpret_cast<const char*>(wk + j * K * kPanel + kPrefetch * kPanel), _MM_HINT_T0);
    }
#pragma GCC unroll 24
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(xt[k * ldx + r]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) {
    const __mmask16 mask = column_mask(cols - 16 * j);
    const __m512 bias_j = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 24
    for (int r = 0; r < MR; ++r) {
      const __m512 y = bias ? _mm512_add_ps(acc[r][j], bias_j) : acc[r][j];
      _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mask, y);
    }
  }
}

// Tiles of up to MAXR rows over NV panels for all M rows.
template <int NV, int MAXR>
void rows(const float* xt, int64_t M, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
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

// One group of 64 output columns: as many panels side by side as the row count leaves registers for
// (4 x 6, 2 x 12 or 1 x 24 accumulators of 16 floats). One or two rows take one panel at a time: a
// single stream from memory read as fast as four side by side there (and the AVX2 path does so too).
void group(const float* xt, int64_t M, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
           int64_t cols) {
  const int64_t width = M <= 2 ? 1 : M <= 6 ? 4 : M <= 12 ? 2 : 1;  // panels per tile
  for (int64_t p = 0; p < kGroup / kPanel; p += width) {
    const float* wp = w + p * K * kPanel;
    const float* bp = bias ? bias + p * kPanel : nullptr;
    float* op = out + p * kPanel;
    const int64_t left = cols - p * kPanel;
    if (left <= 0) break;
    if (width == 4) rows<4, 6>(xt, M, wp, K, bp, op, ldo, left);
    else if (width == 2) rows<2, 12>(xt, M, wp, K, bp, op, ldo, left);
    else rows<1, 24>(xt, M, wp, K, bp, op, ldo, left);
  }
}

constexpr const char* kIsa = "AVX-512";

#elif defined(__AVX2__) && defined(__FMA__)

// One panel (two 8-float halves) for rows [0, MR); xt: the rows transposed, [K, ldx].
template <int MR>
void tile(const float* xt, int64_t ldx, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
          int64_t cols) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kPanel;
    const __m256 b0 = _mm256_load_ps(wk), b1 = _mm256_load_ps(wk + 8);
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kPanel), _MM_HINT_T0);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(xt + k * ldx + r);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
  alignas(32) float line[kPanel];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_store_ps(line, lo[r]);
    _mm256_store_ps(line + 8, hi[r]);
    const int64_t n = std::min<int64_t>(cols, kPanel);
    for (int64_t c = 0; c < n; ++c) out[r * ldo + c] = bias ? line[c] + bias[c] : line[c];
  }
}

void group(const float* xt, int64_t M, const float* w, int64_t K, const float* bias, float* out, int64_t ldo,
           int64_t cols) {
  for (int64_t p = 0; p < kGroup / kPanel && p * kPanel < cols; ++p) {
    for (int64_t r0 = 0; r0 < M; r0 += 6) {
      const float* x = xt + r0;
      const float* wp = w + p * K * kPanel;
      const float* bp = bias ? bias + p * kPanel : nullptr;
      float* o = out + r0 * ldo + p * kPanel;
      const int64_t left = cols - p * kPanel;
      switch (std::min<int64_t>(6, M - r0)) {
        case 1: tile<1>(x, M, wp, K, bp, o, ldo, left); break;
        case 2: tile<2>(x, M, wp, K, bp, o, ldo, left); break;
        case 3: tile<3>(x, M, wp, K, bp, o, ldo, left); break;
        case 4: tile<4>(x, M, wp, K, bp, o, ldo, left); break;
        case 5: tile<5>(x, M, wp, K, bp, o, ldo, left); break;
        default: tile<6>(x, M, wp, K, bp, o, ldo, left); break;
      }
    }
  }
}

constexpr const char* kIsa = "AVX2";

#else
#error "SpecLens's native linear needs AVX-512F or AVX2 with FMA"
#endif

}  // namespace

// [N, K] float32 -> panels [P, K, 16], P = N rounded up to 64, over 16 (zero padded).
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32 && weight.device().is_cpu(),
              "pack takes a float32 CPU weight [out, in]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t padded = (N + kGroup - 1) / kGroup * kGroup;
  auto full = torch::zeros({padded, K}, weight.options());
  full.narrow(0, 0, N).copy_(weight);
  return full.view({padded / kPanel, kPanel, K}).transpose(1, 2).contiguous();
}

// x [..., K] float32, panels from pack(), bias [N] or None -> [..., N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, const c10::optional<torch::Tensor>& bias,
                     int64_t N) {
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(), "linear takes float32 CPU input");
  TORCH_CHECK(panels.dim() == 3 && panels.size(1) == K && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.size(0) * kPanel >= N && (panels.size(0) * kPanel) % kGroup == 0,
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
  const float* wp = panels.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t groups = (N + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      group(xp, M, wp + g * K * kGroup, K, bp ? bp + g * kGroup : nullptr, op + g * kGroup, N,
            std::min<int64_t>(kGroup, N - g * kGroup));
    }
  });
  return out.view(sizes);
}

std::string isa() { return kIsa; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "float32 weight [N, K] -> panels [P, K, 16]");
  m.def("linear", &linear, "x [..., K] @ W^T (+ bias) from packed panels");
  m.def("isa", &isa, "the instruction set this build uses");
}
