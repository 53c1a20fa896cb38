// bf16 activations [M, K] x int4 weights [N, K] -> bf16 [M, N], for M up to 64 (batched
// decoding), on the tensor cores of sm_80+ (mma.sync m16n8k16, fp32 sums).
//
// Why a CUDA kernel: at a few rows the product is bound by the weights' bytes, and reading
// them at HBM speed takes wide (16-byte) coalesced loads issued far ahead of the math and
// values that go from the load's registers to the tensor cores with no shared-memory round
// trip and no integer converter. Triton cannot put loaded bytes in the mma's fragment order.
// Here the weights are reshuffled once at load (lmforge/generate/kernels/int4_mma.py,
// `pack`) so that one 16-byte load of a lane is exactly its B fragments for a 16 x 64 slice
// of the weight (8 mma tiles of n8 x k16), and the activations' k order inside each 32
// columns is permuted the same way so that a lane's A fragments for two k16 steps are 8
// consecutive bf16 of a row (one 16-byte load).
//
// Layouts (all made by `pack`):
//   q   int32 [N/64, K/32, 2, 32, 4]: for n64 block c, k32 block t, half h (k16 step), lane
//       (gid = lane / 4, tig = lane % 4) and word j: n0 = 64c + 16j + gid, n1 = n0 + 8,
//       k = 32t + 8 tig + 4h; nibble 0 / 4 = w[n0, k] / w[n0, k+1], 1 / 5 = w[n0, k+2] /
//       w[n0, k+3], 2 / 6 and 3 / 7 the same for n1 (so `(q >> 4p) & 0x000f000f` is the
//       bf16 pair p of the fragments: p 0, 1 = n0's b0, b1; p 2, 3 = n1's).
//   sz  int32 [K/g, N/64, 8, 4, 2]: (scale | zero << 16) as bf16 bits, for group g, block c,
//       gid, word j and n0 / n1 as above; w = (q - 8) * scale + zero.
// The logical k of the mma (tig*2, tig*2+1, tig*2+8, tig*2+9) is the physical k + (0, 1, 2, 3)
// above, for A and B alike, so the sums are the product's.
//
// Work split: a block of WN x WK warps covers 16 * JW * WN output columns; its WK warps share
// the block's k range (contiguous quarters) and add their sums in shared memory; `splits`
// blocks share K, each writing its fp32 sums to its slice of a workspace, and the last of them
// (a counter a column block) adds the slices in order, writes bf16 and puts the counter back
// to zero: no memset, no second kernel, the same result on every run, and it replays in a
// CUDA graph.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lmforge_int4 {

__device__ __forceinline__ uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;  // (a & b) | c
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// A weight load: read once, so it neither allocates in L1 nor waits behind the math.
template <int JW>
__device__ __forceinline__ void load_weights(uint32_t (&r)[JW], const int32_t* p) {
  if constexpr (JW == 4) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "l"(p));
  }
}

// 16 bytes read through L1 (scales and activations: several warps read them), issued where it
// stands: a plain __ldg may be moved down to its first use by the compiler, which puts an L2
// round trip back into every k step the ring of loads was built to hide.
__device__ __forceinline__ uint4 load_shared_bytes(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int JW>
__device__ __forceinline__ void load_groups(uint32_t (&r)[JW * 2], const int32_t* p) {
  // JW words of (scale, zero) pairs for n0 and n1: 2 * JW words
  const uint4* v = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < JW / 2; i++) {
    uint4 u = load_shared_bytes(v + i);
    r[4 * i] = u.x, r[4 * i + 1] = u.y, r[4 * i + 2] = u.z, r[4 * i + 3] = u.w;
  }
}

// The four bf16 pairs of one word, (q - 8) * scale + zero: b[0], b[1] n0's fragments, b[2],
// b[3] n1's. A nibble n masked into 0x4300 (128.0) is the bf16 128 + n, exactly; minus 136 it
// is n - 8 (exact), then one fused multiply-add with the column's scale and zero.
__device__ __forceinline__ void dequantize(uint32_t q, uint32_t sz0, uint32_t sz1,
                                           uint32_t (&b)[4]) {
  constexpr uint32_t MASK = 0x000f000f, MAGIC = 0x43004300;
  constexpr uint32_t ONE = 0x3f803f80, MINUS_136 = 0xc308c308;
  const uint32_t scale0 = __byte_perm(sz0, 0, 0x1010), zero0 = __byte_perm(sz0, 0, 0x3232);
  const uint32_t scale1 = __byte_perm(sz1, 0, 0x1010), zero1 = __byte_perm(sz1, 0, 0x3232);
#pragma unroll
  for (int p = 0; p < 4; p++) {
    const uint32_t v = fma_bf16x2(lop3_and_or(q >> (4 * p), MASK, MAGIC), ONE, MINUS_136);
    b[p] = p < 2 ? fma_bf16x2(v, scale0, zero0) : fma_bf16x2(v, scale1, zero1);
  }
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One k32 step: a lane's words w (two k16 halves, JW words each) with their (scale, zero)
// words g, times rows (an m16 tile's rows gid and gid + 8, 8 columns each: the halves' A
// fragments), added into acc.
template <int M_TILES, int JW>
__device__ __forceinline__ void multiply_step(float (&acc)[M_TILES][2 * JW][4],
                                              const uint32_t (&w)[2][JW],
                                              const uint32_t (&g)[2 * JW],
                                              const uint4 (&rows)[M_TILES][2]) {
#pragma unroll
  for (int h = 0; h < 2; h++)
#pragma unroll
    for (int j = 0; j < JW; j++) {
      uint32_t b[4];
      dequantize(w[h][j], g[2 * j], g[2 * j + 1], b);
#pragma unroll
      for (int i = 0; i < M_TILES; i++) {
        const uint4& r0 = rows[i][0];
        const uint4& r1 = rows[i][1];
        const uint32_t a[4] = {h ? r0.z : r0.x, h ? r1.z : r1.x, h ? r0.w : r0.y,
                               h ? r1.w : r1.y};
        mma(acc[i][2 * j], a, b[0], b[1]);
        mma(acc[i][2 * j + 1], a, b[2], b[3]);
      }
    }
}

// cp.async: 16 bytes global -> shared without registers, in groups a thread commits and waits
// for (`cg`: through L2 only, for the weights read once; `ca`: through L1, for what several
// warps read)
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global));
}

__device__ __forceinline__ void copy_async_cached(void* shared, const void* global) {
  const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(to), "l"(global));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;"); }

template <int PENDING>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

__device__ __forceinline__ uint4 load_from_shared(const void* shared) {
  uint4 v;
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(at));
  return v;
}

// After the k loop: the WK warps of a column slice add their sums in `shared` (warps wk > 0
// write, warps wk == 0 add), then write bf16, or (split blocks) their slice of the workspace,
// the last block of the column slice adding the slices in order.
template <int M_TILES, int JW, int WN, int WK>
__device__ __forceinline__ void finish(float (&acc)[M_TILES][2 * JW][4], float* shared,
                                       __nv_bfloat16* __restrict__ out,
                                       float* __restrict__ workspace, int* __restrict__ counters,
                                       int M, int N, int first_n, int splits) {
  constexpr int TILES_N = 2 * JW, ACC = M_TILES * TILES_N * 4;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane / 4, tig = lane % 4;
  const int wn = warp % WN, wk = warp / WN;
  // the WK warps of a column slice add their sums: warps wk > 0 write, warps wk == 0 add
  if constexpr (WK > 1) {
    float* partial = shared;  // [WK - 1][WN][ACC][32]
    if (wk > 0) {
      float* mine = partial + ((wk - 1) * WN + wn) * ACC * 32 + lane;
#pragma unroll
      for (int i = 0; i < M_TILES; i++)
#pragma unroll
        for (int t = 0; t < TILES_N; t++)
#pragma unroll
          for (int e = 0; e < 4; e++) mine[((i * TILES_N + t) * 4 + e) * 32] = acc[i][t][e];
    }
    __syncthreads();
    if (wk == 0) {
      for (int other = 0; other < WK - 1; other++) {
        const float* theirs = partial + (other * WN + wn) * ACC * 32 + lane;
#pragma unroll
        for (int i = 0; i < M_TILES; i++)
#pragma unroll
          for (int t = 0; t < TILES_N; t++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][t][e] += theirs[((i * TILES_N + t) * 4 + e) * 32];
      }
    }
  }

  // C fragment: c0, c1 = row gid, columns 2 tig, 2 tig + 1; c2, c3 = row gid + 8
  auto each_pair = [&](auto store) {  // store(row, column, the pair's two sums), rows < M
#pragma unroll
    for (int i = 0; i < M_TILES; i++)
#pragma unroll
      for (int t = 0; t < TILES_N; t++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
          const int row = 16 * i + 8 * half + gid, col = first_n + 8 * t + 2 * tig;
          if (row < M) store(row, col, acc[i][t][2 * half], acc[i][t][2 * half + 1]);
        }
  };
  if (splits == 1) {
    if (wk == 0)
      each_pair([&](int row, int col, float s0, float s1) {
        *reinterpret_cast<__nv_bfloat162*>(out + (size_t)row * N + col) =
            __floats2bfloat162_rn(s0, s1);
      });
    return;
  }
  // split blocks: each writes its sums to its own slice of the workspace [splits, M, N]; the
  // last to finish adds the slices in order (the same sums whatever the finishing order)
  float* slice = workspace + (size_t)blockIdx.y * M * N;
  if (wk == 0)
    each_pair([&](int row, int col, float s0, float s1) {
      *reinterpret_cast<float2*>(slice + (size_t)row * N + col) = make_float2(s0, s1);
    });
  __threadfence();
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counters + blockIdx.x, 1) == splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int width = 16 * JW * WN;
  for (int at = threadIdx.x; at < M * width / 2; at += blockDim.x) {
    const int row = at / (width / 2), col = blockIdx.x * width + 2 * (at % (width / 2));
    float2 sum = make_float2(0.f, 0.f);
    for (int split = 0; split < splits; split++) {  // (L2 reads: other SMs wrote them)
      const float2 part = __ldcg(reinterpret_cast<const float2*>(
          workspace + ((size_t)split * M + row) * N + col));
      sum.x += part.x, sum.y += part.y;
    }
    *reinterpret_cast<__nv_bfloat162*>(out + (size_t)row * N + col) = __floats2bfloat162_rn(sum.x, sum.y);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

__device__ __forceinline__ float* partial_memory() {
  extern __shared__ float4 dynamic_shared[];
  return reinterpret_cast<float*>(dynamic_shared);
}

// M_TILES m16 tiles of rows; JW words (16 columns each) a lane; WN x WK warps; DEPTH k32 steps
// of weights in flight a warp, ROWS_DEPTH of activations (it divides DEPTH).
template <int M_TILES, int JW, int WN, int WK, int DEPTH, int ROWS_DEPTH>
__global__ void __launch_bounds__(WN * WK * 32)
    int4_mma_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ q,
                    const int32_t* __restrict__ sz, __nv_bfloat16* __restrict__ out,
                    float* __restrict__ workspace, int* __restrict__ counters, int M, int N,
                    int K, int group, int splits) {
  constexpr int TILES_N = 2 * JW;            // n8 tiles a warp
  constexpr int ACC = M_TILES * TILES_N * 4;  // fp32 sums a lane
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane / 4, tig = lane % 4;
  const int wn = warp % WN, wk = warp / WN;
  const int first_n = (blockIdx.x * WN + wn) * 16 * JW;  // the warp's first column
  const int block64 = first_n / 64, j0 = (first_n % 64) / 16;

  // the warp's k32 steps: the split's range, cut in WK contiguous pieces
  const int steps = K / 32;
  const int split_begin = steps * blockIdx.y / splits, split_end = steps * (blockIdx.y + 1) / splits;
  const int begin = split_begin + (split_end - split_begin) * wk / WK;
  const int end = split_begin + (split_end - split_begin) * (wk + 1) / WK;
  const int count = end - begin;

  const int32_t* q_warp = q + (size_t)block64 * steps * 256 + lane * 4 + j0;
  const int32_t* sz_warp = sz + (size_t)block64 * 64 + gid * 8 + j0 * 2;
  const int sz_group_stride = (N / 64) * 64;

  float acc[M_TILES][TILES_N][4] = {};

  uint32_t wq[DEPTH][2][JW];      // weights of the steps in flight (two k16 halves)
  uint32_t gq[DEPTH][JW * 2];     // their (scale, zero) words
  uint4 xa[ROWS_DEPTH][M_TILES][2];  // activations of the steps in flight: rows gid, gid + 8

  auto load_step = [&](int s, int stage) {
    const int t = begin + s;
    const int32_t* p = q_warp + (size_t)t * 256;
    load_weights<JW>(wq[stage][0], p);
    load_weights<JW>(wq[stage][1], p + 128);
    load_groups<JW>(gq[stage], sz_warp + (size_t)(t * 32 / group) * sz_group_stride);
  };
  auto load_rows = [&](int s, int stage) {
    const int k = (begin + s) * 32 + tig * 8;
#pragma unroll
    for (int i = 0; i < M_TILES; i++)
#pragma unroll
      for (int half = 0; half < 2; half++) {
        const int row = 16 * i + 8 * half + gid;
        xa[stage][i][half] = row < M ? load_shared_bytes(x + (size_t)row * K + k)
                                     : make_uint4(0, 0, 0, 0);
      }
  };

#pragma unroll
  for (int s = 0; s < DEPTH; s++)
    if (s < count) load_step(s, s);
#pragma unroll
  for (int s = 0; s < ROWS_DEPTH - 1; s++)
    if (s < count) load_rows(s, s);

  for (int s0 = 0; s0 < count; s0 += DEPTH) {
#pragma unroll
    for (int stage = 0; stage < DEPTH; stage++) {
      const int s = s0 + stage;
      if (s >= count) break;
      uint32_t w[2][JW], g[JW * 2];
#pragma unroll
      for (int h = 0; h < 2; h++)
#pragma unroll
        for (int j = 0; j < JW; j++) w[h][j] = wq[stage][h][j];
#pragma unroll
      for (int j = 0; j < JW * 2; j++) g[j] = gq[stage][j];
      if (s + DEPTH < count) load_step(s + DEPTH, stage);
      // ROWS_DEPTH divides DEPTH, so stage % ROWS_DEPTH is s % ROWS_DEPTH
      constexpr int ahead = ROWS_DEPTH - 1;
      if (s + ahead < count) load_rows(s + ahead, (stage + ahead) % ROWS_DEPTH);
      multiply_step<M_TILES, JW>(acc, w, g, xa[stage % ROWS_DEPTH]);
    }
  }

  finish<M_TILES, JW, WN, WK>(acc, partial_memory(), out, workspace, counters, M, N, first_n,
                              splits);
}

// The same product with each warp's loads in a ring of STAGES shared-memory buffers filled by
// cp.async (no registers held by loads in flight, so more of them, and more warps an SM): a
// stage is the warp's weights for a k32 step (1 KB, 16 columns x 4 a lane as in the global
// layout), their (scale, zero) words (256 B) and the step's 32 columns of the rows (64 B a
// row; rows >= M are zeros written once). Warps run their rings independently (no block
// barrier in the loop). JW is 4.
template <int M_TILES, int WN, int WK, int STAGES>
__global__ void __launch_bounds__(WN * WK * 32, M_TILES == 1 ? 2 : 1)
    int4_mma_async_kernel(const __nv_bfloat16* __restrict__ x, const int32_t* __restrict__ q,
                          const int32_t* __restrict__ sz, __nv_bfloat16* __restrict__ out,
                          float* __restrict__ workspace, int* __restrict__ counters, int M, int N,
                          int K, int group, int splits) {
  constexpr int JW = 4, TILES_N = 8, ROWS = 16 * M_TILES;
  constexpr int WEIGHTS = 1024, GROUPS = 256, STAGE = WEIGHTS + GROUPS + ROWS * 64;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int gid = lane / 4, tig = lane % 4;
  const int wn = warp % WN, wk = warp / WN;
  const int first_n = (blockIdx.x * WN + wn) * 64;
  const int block64 = first_n / 64;
  const int steps = K / 32;
  const int split_begin = steps * blockIdx.y / splits, split_end = steps * (blockIdx.y + 1) / splits;
  const int begin = split_begin + (split_end - split_begin) * wk / WK;
  const int count = split_begin + (split_end - split_begin) * (wk + 1) / WK - begin;
  char* ring = reinterpret_cast<char*>(partial_memory()) + warp * STAGES * STAGE;

  for (int at = lane; at < STAGES * ROWS * 4; at += 32) {  // rows >= M: zeros, once
    const int stage = at / (ROWS * 4), chunk = at % (ROWS * 4);
    if (chunk / 4 >= M)
      *reinterpret_cast<uint4*>(ring + stage * STAGE + WEIGHTS + GROUPS + chunk * 16) =
          make_uint4(0, 0, 0, 0);
  }
  __syncwarp();

  auto copy_step = [&](int s, int stage) {
    const int t = begin + s;
    char* to = ring + stage * STAGE;
    const int32_t* weights = q + ((size_t)block64 * steps + t) * 256 + lane * 4;
    copy_async(to + lane * 16, weights);
    copy_async(to + 512 + lane * 16, weights + 128);
    if (lane < 16)  // the block's 64 (scale, zero) words of the step's group
      copy_async_cached(to + WEIGHTS + lane * 16,
                        sz + (size_t)(t * 32 / group) * (N / 64) * 64 + block64 * 64 + lane * 4);
    for (int chunk = lane; chunk < M * 4; chunk += 32)
      copy_async_cached(to + WEIGHTS + GROUPS + chunk * 16,
                        x + (size_t)(chunk / 4) * K + t * 32 + (chunk % 4) * 8);
  };

  float acc[M_TILES][TILES_N][4] = {};

#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < count) copy_step(s, s);
    commit_copies();
  }
  for (int s = 0; s < count; s++) {
    wait_copies<STAGES - 2>();  // step s's group is in
    __syncwarp();               // ... for every lane, and step s - 1's buffer is read
    if (s + STAGES - 1 < count) copy_step(s + STAGES - 1, (s + STAGES - 1) % STAGES);
    commit_copies();
    const char* stage = ring + (s % STAGES) * STAGE;
    const uint4 w0 = load_from_shared(stage + lane * 16);
    const uint4 w1 = load_from_shared(stage + 512 + lane * 16);
    const uint4 g0 = load_from_shared(stage + WEIGHTS + gid * 32);
    const uint4 g1 = load_from_shared(stage + WEIGHTS + gid * 32 + 16);
    const uint32_t w[2][JW] = {{w0.x, w0.y, w0.z, w0.w}, {w1.x, w1.y, w1.z, w1.w}};
    const uint32_t g[2 * JW] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    uint4 rows[M_TILES][2];
#pragma unroll
    for (int i = 0; i < M_TILES; i++)
#pragma unroll
      for (int half = 0; half < 2; half++)
        rows[i][half] = load_from_shared(stage + WEIGHTS + GROUPS + (16 * i + 8 * half + gid) * 64 + tig * 16);
    multiply_step<M_TILES, JW>(acc, w, g, rows);
  }
  wait_copies<0>();
  __syncthreads();  // every warp is out of its ring before `finish` writes over the rings
  finish<M_TILES, JW, WN, WK>(acc, partial_memory(), out, workspace, counters, M, N, first_n,
                              splits);
}

template <int M_TILES, int JW, int WN, int WK, int DEPTH, int ROWS_DEPTH>
cudaError_t launch(const void* x, const int32_t* q, const int32_t* sz, void* out,
                   float* workspace, int* counters, int M, int N, int K, int group, int splits,
                   cudaStream_t stream) {
  constexpr int ACC = M_TILES * 2 * JW * 4;
  const int shared = WK > 1 ? (WK - 1) * WN * ACC * 32 * (int)sizeof(float) : 0;
  auto kernel = int4_mma_kernel<M_TILES, JW, WN, WK, DEPTH, ROWS_DEPTH>;
  static bool raised = false;  // past 48 KB with the static `last`: once a process and device
  if (shared + 1024 > 48 * 1024 && !raised) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    if (e != cudaSuccess) return e;
    raised = true;
  }
  dim3 grid(N / (16 * JW * WN), splits);
  kernel<<<grid, WN * WK * 32, shared, stream>>>(
      static_cast<const __nv_bfloat16*>(x), q, sz, static_cast<__nv_bfloat16*>(out), workspace,
      counters, M, N, K, group, splits);
  return cudaGetLastError();
}

template <int M_TILES, int WN, int WK, int STAGES>
cudaError_t launch_async(const void* x, const int32_t* q, const int32_t* sz, void* out,
                         float* workspace, int* counters, int M, int N, int K, int group,
                         int splits, cudaStream_t stream) {
  constexpr int ACC = M_TILES * 8 * 4;
  constexpr int RINGS = WN * WK * STAGES * (1024 + 256 + 16 * M_TILES * 64);
  constexpr int PARTIAL = (WK - 1) * WN * ACC * 32 * (int)sizeof(float);
  constexpr int shared = RINGS > PARTIAL ? RINGS : PARTIAL;
  auto kernel = int4_mma_async_kernel<M_TILES, WN, WK, STAGES>;
  static bool raised = false;
  if (!raised) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared);
    if (e != cudaSuccess) return e;
    raised = true;
  }
  dim3 grid(N / (64 * WN), splits);
  kernel<<<grid, WN * WK * 32, shared, stream>>>(
      static_cast<const __nv_bfloat16*>(x), q, sz, static_cast<__nv_bfloat16*>(out), workspace,
      counters, M, N, K, group, splits);
  return cudaGetLastError();
}

}  // namespace lmforge_int4

// The configurations the Python side picks from (`int4_mma.CONFIGS`): config i below.
// Returns nullptr once launched, or CUDA's description of the error.
static int launch_config(int config, const void* x, const int32_t* q, const int32_t* sz, void* out,
                     float* workspace, int* counters, int M, int N, int K, int group, int splits,
                     void* cuda_stream) {
  using namespace lmforge_int4;
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  switch (config) {
    case 0:  // rows 1-16: 2 x 4 warps, 128 columns a block
      return launch<1, 4, 2, 4, 4, 2>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 1:  // rows 17-32
      return launch<2, 4, 2, 4, 4, 2>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 2:  // rows 33-64: 32 columns a warp, 4 x 2 warps
      return launch<4, 2, 4, 2, 2, 2>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 3:  // rows 1-16, 4 x 2 warps: 256 columns a block, each warp half the k range
      return launch<1, 4, 4, 2, 4, 2>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 4:  // rows 1-16 as 0, the activations of 4 steps in flight (not 2)
      return launch<1, 4, 2, 4, 4, 4>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 5:  // rows 1-16, loads through cp.async rings of 6 steps a warp (int4_mma_async_kernel)
      return launch_async<1, 2, 4, 6>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 6:  // rows 17-32, rings of 4
      return launch_async<2, 2, 4, 4>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    case 7:  // rows 33-64, rings of 3
      return launch_async<4, 2, 4, 3>(x, q, sz, out, workspace, counters, M, N, K, group, splits, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

const char* lmforge_int4_mma(int config, const void* x, const int32_t* q, const int32_t* sz,
                             void* out, float* workspace, int* counters, int M, int N, int K,
                             int group, int splits, void* cuda_stream) {
  const int error = launch_config(config, x, q, sz, out, workspace, counters, M, N, K, group,
                                  splits, cuda_stream);
  return error == cudaSuccess ? nullptr : cudaGetErrorString(static_cast<cudaError_t>(error));
}
