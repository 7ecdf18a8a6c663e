// Weight-only int8 linear layer for a few rows of fp32 activations, on AVX2 + FMA.
//
//     y[m, n] = scales[n] * sum_k x[m, k] * w[n, k] + bias[n]
//
// Decoding reads every weight once per forward, so with few rows (one token, or the K + 1 tokens
// of a speculative verification) the cost is the bytes of w, and int8 reads a quarter of fp32's.
//
// Layout. The weight is stored in panels of 64 output rows, k-major inside a panel:
// wp[p, k, r] = w[64 p + r, k], so one 64-byte cache line holds column k of 64 rows and a panel is
// one sequential stream. The kernel is an outer product: for each k it converts 8 rows' weights to
// fp32 once, broadcasts x[m, k] and accumulates into y[m, 8 rows] for every row m of x, so one
// conversion serves all rows and no horizontal sums are needed.
//
// Two kernels share that layout. Up to 12 rows ("direct"), the weights are converted in registers
// and used at once, and the next k tile of the panel is prefetched during the first sweep of the
// current one (measured: one row 0.77 -> 0.56 ms per 1536 x 8960 layer streamed from DRAM). Beyond
// 12 rows ("tiled", prefill), each 64 x 64 tile of a panel is converted once into an fp32 buffer in
// L1 and multiplied by a 6-row x 16-column register block, so the conversions no longer repeat per
// 12 rows; rows go in passes of at most 48.
//
// Exactness across row counts: every y[m, n] is one fp32 accumulator updated by fused
// multiply-adds over k = 0, 1, ..., K - 1 in order (kept in memory between k tiles, which does not
// change its value), then fma(acc, scale, bias). The number of rows in the call only changes how
// the (m, n) pairs are grouped into registers, never the arithmetic of one pair, so a verification
// over K + 1 tokens gives bit-for-bit the outputs of K + 1 one-token calls.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int kPanel = 64;     // output rows per panel (8 groups of 8)
constexpr int kGroups = kPanel / 8;
constexpr int kTile = 256;     // k per tile: the panel's tile (16 KB) stays in L1 across sweeps
constexpr int kMaxRows = 12;   // rows of x per pass of the direct kernel
constexpr int kTiledTile = 64; // k per fp32 tile of the tiled kernel: 64 x 64 x 4 B = 16 KB
constexpr int kTiledRows = 48; // rows of x per pass of the tiled kernel
constexpr int kBlockRows = 6;  // rows per register block of the tiled kernel (12 accumulators)

inline __m256 load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Register blocking: MB rows of x times NB groups of 8 output rows, MB * NB accumulators.
template <int MB>
constexpr int groups_per_sweep() {
  return MB == 1 ? 8 : MB == 2 ? 4 : MB <= 6 ? 2 : 1;
}

// One k tile [k0, k1) of one sweep (groups g0 .. g0 + NB - 1) of one panel; acc lives in buf.
// The first sweep of a tile (PF) prefetches the next tile, one 64-byte line per k.
template <int MB, int NB, bool PF>
inline void sweep_tile(const float* x, int64_t ldx, const int8_t* panel, int64_t k0, int64_t k1, int g0,
                       float* buf /* [MB][kPanel] */, bool first) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < NB; ++g)
      acc[m][g] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + m * kPanel + (g0 + g) * 8);
  const int8_t* wk = panel + k0 * kPanel + g0 * 8;
  for (int64_t k = k0; k < k1; ++k, wk += kPanel) {
    if (PF) _mm_prefetch(reinterpret_cast<const char*>(wk + kTile * kPanel), _MM_HINT_T0);
    __m256 w[NB];
    for (int g = 0; g < NB; ++g) w[g] = load_w8(wk + g * 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
      for (int g = 0; g < NB; ++g) acc[m][g] = _mm256_fmadd_ps(b, w[g], acc[m][g]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int g = 0; g < NB; ++g) _mm256_storeu_ps(buf + m * kPanel + (g0 + g) * 8, acc[m][g]);
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

template <int MB>
void rows(const float* x, int64_t ldx, const int8_t* wp, int64_t panels, int64_t K, const float* scales,
          const float* bias, float* y, int64_t ldy) {
  constexpr int NB = groups_per_sweep<MB>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float buf[MB * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* panel = wp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kTile) {
        const int64_t k1 = std::min<int64_t>(K, k0 + kTile);
        sweep_tile<MB, NB, true>(x, ldx, panel, k0, k1, 0, buf, k0 == 0);
        for (int g0 = NB; g0 < kGroups; g0 += NB) sweep_tile<MB, NB, false>(x, ldx, panel, k0, k1, g0, buf, k0 == 0);
      }
      store_panel(buf, MB, p * kPanel, scales, bias, y, ldy);
    }
  });
}

using RowsFn = void (*)(const float*, int64_t, const int8_t*, int64_t, int64_t, const float*, const float*,
                        float*, int64_t);

constexpr RowsFn kRows[kMaxRows + 1] = {nullptr,  rows<1>, rows<2>,  rows<3>,  rows<4>,  rows<5>, rows<6>,
                                       rows<7>,  rows<8>, rows<9>,  rows<10>, rows<11>, rows<12>};


// ---- the tiled kernel (more than kMaxRows rows) ----

// wf[k - k0][r] = panel[k][r] as fp32 for k in [k0, k1)
inline void convert_tile(const int8_t* panel, int64_t k0, int64_t k1, float* wf) {
  const int8_t* src = panel + k0 * kPanel;
  const int64_t n = (k1 - k0) * kPanel;
  for (int64_t i = 0; i < n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_store_ps(wf + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    _mm256_store_ps(wf + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))));
  }
}

// MR rows x 16 columns [c0, c0 + 16) over the kt k of one fp32 tile; accumulators live in buf.
// (GCC keeps acc in registers only when these loops are unrolled before scalar replacement.)
template <int MR>
inline void block(const float* x, int64_t ldx, const float* wf, int64_t kt, int c0, float* buf, bool first) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + m * kPanel + c0);
    acc[m][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(buf + m * kPanel + c0 + 8);
  }
  const float* w = wf + c0;
  for (int64_t k = 0; k < kt; ++k, w += kPanel) {
    const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(buf + m * kPanel + c0, acc[m][0]);
    _mm256_storeu_ps(buf + m * kPanel + c0 + 8, acc[m][1]);
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, int, float*, bool);
constexpr BlockFn kBlocks[kBlockRows + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>, block<5>, block<6>};

// M (<= kTiledRows) rows, in register blocks of at most kBlockRows as even as possible
void tiled_rows(const float* x, int64_t M, int64_t ldx, const int8_t* wp, int64_t panels, int64_t K,
                const float* scales, const float* bias, float* y, int64_t ldy) {
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    alignas(32) float buf[kTiledRows * kPanel];
    alignas(32) float wf[kTiledTile * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* panel = wp + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += kTiledTile) {
        const int64_t k1 = std::min<int64_t>(K, k0 + kTiledTile);
        convert_tile(panel, k0, k1, wf);
        int64_t m0 = 0;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t mr = (M - m0 + (blocks - b) - 1) / (blocks - b);
          for (int c0 = 0; c0 < kPanel; c0 += 16)
            kBlocks[mr](x + m0 * ldx + k0, ldx, wf, k1 - k0, c0, buf + m0 * kPanel, k0 == 0);
          m0 += mr;
        }
      }
      store_panel(buf, M, p * kPanel, scales, bias, y, ldy);
    }
  });
}

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
  if (M <= kMaxRows) {
    if (M > 0) kRows[M](xp, K, wc.data_ptr<int8_t>(), P, K, sc.data_ptr<float>(), bptr, yp, N);
    return y;
  }
  // rows in passes of at most kTiledRows, as even as possible (49 rows: 25 + 24, not 48 + 1)
  const int64_t passes = (M + kTiledRows - 1) / kTiledRows;
  int64_t m0 = 0;
  for (int64_t p = 0; p < passes; ++p) {
    const int64_t mb = (M - m0 + (passes - p) - 1) / (passes - p);
    tiled_rows(xp + m0 * K, mb, K, wc.data_ptr<int8_t>(), P, K, sc.data_ptr<float>(), bptr, yp + m0 * N, N);
    m0 += mb;
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "y = (x W^T) * scales + bias for a panel-packed int8 W and fp32 x (AVX2)");
  m.def("panel_rows", &panel_rows, "output rows per weight panel");
}
