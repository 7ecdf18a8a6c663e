// Weight-only int8 linear layer for fp32 activations, on AVX2 + FMA.
//
//     y[m, n] = scales[n] * sum_k x[m, k] * w[n, k] + bias[n]
//
// Decoding reads every weight once per forward, so with few rows (one token, or the K + 1 tokens
// of a speculative verification) the cost is the bytes of w, and int8 reads a quarter of fp32's.
//
// Layout. The weight is stored in panels of 64 output rows, k-major inside a panel:
// wp[p, k, r] = w[64 p + r, k], so one 64-byte cache line holds column k of 64 rows and a panel is
// one sequential stream. The kernel is an outer product: for each k it converts 8 rows' weights to
// fp32 in a register, broadcasts x[m, k] and accumulates into y[m, 8 rows] for the rows m of a
// register block, so one conversion serves a whole block and no horizontal sums are needed.
//
// Blocking. A panel is walked in k tiles of 256 (16 KB, kept in L1); within a tile the rows of the
// call go in register blocks of at most 6, and each block sweeps the tile's 8 groups of 8 outputs
// NB groups at a time, with MB * NB accumulators (MB rows): 1 row x 8 groups, 2 x 6, 3 x 4, 4 x 3,
// 5-6 x 2, i.e. 8 to 12 independent FMA chains, enough to cover the FMA latency. The first sweep
// of a tile prefetches the same k range of the next tile. Rows go in passes of at most 24 (each
// pass streams the weights once), as even as possible.
//
// Measured in a scratch harness (this code without torch) on a 1536 x 8960 layer streamed from
// DRAM, 2 threads (ms): 1 row 0.55, 2 rows 0.62, 3 0.77, 4 0.88, 5 1.03, 9 1.6, 12 1.95, 24 3.8 --
// from about 3 rows on, the multiply-adds and conversions bound it, not the bytes.
//
// Exactness across row counts: every y[m, n] is one fp32 accumulator updated by fused
// multiply-adds over k = 0, 1, ..., K - 1 in order (kept in memory between k tiles, which does not
// change its value), then fma(acc, scale, bias). The number of rows in the call only changes how
// the (m, n) pairs are grouped into registers, never the arithmetic of one pair, so a verification
// over K + 1 tokens gives bit-for-bit the outputs of K + 1 one-token calls, and a prefill those of
// its rows one by one.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace {

constexpr int kPanel = 64;     // output rows per panel (8 groups of 8)
constexpr int kGroups = kPanel / 8;
constexpr int kTile = 256;     // k per tile: the panel's tile (16 KB) stays in L1 across sweeps
constexpr int kBlockRows = 6;  // rows per register block
constexpr int kMaxRows = 24;   // rows of x per pass over the weights

inline __m256 load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Groups of 8 outputs per sweep for MB rows: MB * NB accumulators plus min(MB, NB) + 1 operand
// registers fit AVX2's 16.
template <int MB>
constexpr int groups_per_sweep() {
  return MB == 1 ? 8 : MB == 2 ? 6 : MB == 3 ? 4 : MB == 4 ? 3 : 2;
}

// Groups g0 .. g0 + NB - 1 of MB rows over the k tile [k0, k1) of one panel; acc lives in buf
// between tiles. PF: also prefetch the next tile, one 64-byte line per k.
// (GCC keeps acc in registers only when these loops are unrolled before scalar replacement.)
template <int MB, int NB, bool PF>
inline void sweep_tile(const float* x, int64_t ldx, const int8_t* panel, int64_t k0, int64_t k1, int g0,
                       float* buf /* [MB][kPanel] */, bool first) {
  __m256 acc[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int g = 0; g < NB; ++g)
      acc[m][g] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + m * kPanel + (g0 + g) * 8);
  const int8_t* wk = panel + k0 * kPanel + g0 * 8;
  for (int64_t k = k0; k < k1; ++k, wk += kPanel) {
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(wk + kTile * kPanel), _MM_HINT_T0);
    if constexpr (MB > 1 && MB <= NB) {  // few rows: hold the broadcasts, stream the weights
      __m256 b[MB];
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) b[m] = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
      for (int g = 0; g < NB; ++g) {
        const __m256 w = load_w8(wk + g * 8);
#pragma GCC unroll 8
        for (int m = 0; m < MB; ++m) acc[m][g] = _mm256_fmadd_ps(b[m], w, acc[m][g]);
      }
    } else {  // more rows: hold the weights, stream the broadcasts
      __m256 w[NB];
#pragma GCC unroll 8
      for (int g = 0; g < NB; ++g) w[g] = load_w8(wk + g * 8);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
        for (int g = 0; g < NB; ++g) acc[m][g] = _mm256_fmadd_ps(b, w[g], acc[m][g]);
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 8
    for (int g = 0; g < NB; ++g) _mm256_storeu_ps(buf + m * kPanel + (g0 + g) * 8, acc[m][g]);
}

// One k tile of one panel for one register block of MB (<= kBlockRows) rows: every sweep.
template <int MB>
inline void tile_block(const float* x, int64_t ldx, const int8_t* panel, int64_t k0, int64_t k1, float* buf) {
  constexpr int NB = groups_per_sweep<MB>(), full = kGroups / NB, rest = kGroups % NB;
  sweep_tile<MB, NB, true>(x, ldx, panel, k0, k1, 0, buf, k0 == 0);
  for (int s = 1; s < full; ++s) sweep_tile<MB, NB, false>(x, ldx, panel, k0, k1, s * NB, buf, k0 == 0);
  if constexpr (rest > 0) sweep_tile<MB, rest, false>(x, ldx, panel, k0, k1, full * NB, buf, k0 == 0);
}

// MB rows of one k tile as ceil(MB / kBlockRows) register blocks of near-equal size
template <int MB>
inline void tile_rows(const float* x, int64_t ldx, const int8_t* panel, int64_t k0, int64_t k1, float* buf) {
  constexpr int blocks = (MB + kBlockRows - 1) / kBlockRows;
  constexpr int first = (MB + blocks - 1) / blocks;
  tile_block<first>(x, ldx, panel, k0, k1, buf);
  if constexpr (MB > first) tile_rows<MB - first>(x + first * ldx, ldx, panel, k0, k1, buf + first * kPanel);
}

// y[m, n0 + j] = buf[m][j] * scales[n0 + j] + bias[n0 + j] for the rows and 64 columns of one panel
inline void store_panel(const float* buf, int64_t rows, int64_t n0, const float* scales, const float* bias, float* y,
                        int64_t ldy) {
  for (int g = 0; g < kGroups; ++g) {
    const __m256 s = _mm256_loadu_ps(scales + n0 + g * 8);
    const __m256 c = bias ? _mm256_loadu_ps(bias + n0 + g * 8) : _mm256_setzero_ps();
    for (int64_t m = 0; m < rows; ++m)
      _mm256_storeu_ps(y + m * ldy + n0 + g * 8, _mm256_fmadd_ps(_mm256_loadu_ps(buf + m * kPanel + g * 8), s, c));
  }
}

// One pass of MB rows over all panels, the panels split between threads.
template <int MB>
void rows(const float* x, int64_t ldx, const int8_t* wp, int64_t panels, int64_t K, const float* scales,
          const float* bias, float* y, int64_t ldy) {
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float buf[MB * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* panel = wp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kTile) tile_rows<MB>(x, ldx, panel, k0, std::min<int64_t>(K, k0 + kTile), buf);
      store_panel(buf, MB, p * kPanel, scales, bias, y, ldy);
    }
  });
}

using RowsFn = void (*)(const float*, int64_t, const int8_t*, int64_t, int64_t, const float*, const float*,
                        float*, int64_t);

template <int... M>
constexpr auto make_table(std::integer_sequence<int, M...>) {
  return std::array<RowsFn, sizeof...(M) + 1>{nullptr, rows<M + 1>...};
}
constexpr auto kRows = make_table(std::make_integer_sequence<int, kMaxRows>{});

}  // namespace

int64_t panel_rows() { return kPanel; }

// x [M, K] fp32; wp [P, K, 64] int8 (see the layout above); scales, bias [P * 64] fp32.
// Returns y [M, P * 64].
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && wp.device().is_cpu(), "int8_linear runs on the CPU");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kPanel, "int8_linear: x [M, K] and wp [P, K, 64]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && wp.scalar_type() == torch::kInt8, "int8_linear: fp32 x, int8 wp");
  const int64_t M = x.size(0), K = x.size(1), P = wp.size(0), N = P * kPanel;
  TORCH_CHECK(wp.size(1) == K, "int8_linear: x has ", K, " columns, the weight ", wp.size(1));
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.numel() == N, "int8_linear: scales fp32 [P * 64]");
  const float* bptr = nullptr;
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == N, "int8_linear: bias fp32 [P * 64]");
    bptr = b.data_ptr<float>();
  }
  const torch::Tensor xc = x.contiguous(), wc = wp.contiguous(), sc = scales.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // rows in passes of at most kMaxRows, as even as possible (25 rows: 13 + 12, not 24 + 1)
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows;
  int64_t m0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t mb = (M - m0 + (passes - p) - 1) / (passes - p);
    kRows[mb](xp + m0 * K, K, wc.data_ptr<int8_t>(), P, K, sc.data_ptr<float>(), bptr, yp + m0 * N, N);
    m0 += mb;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = (x W^T) * scales + bias for a panel-packed int8 W and fp32 x (AVX2)");
  m.def("panel_rows", &panel_rows, "output rows per weight panel");
}
