// Fused MoE for one layer over packed expert weights, and the packed layouts the kernels read.
//
// A matrix W [N, K] is stored in tiles of 16 rows; K is zero-padded to kp. Per tile (t = row block):
//   bf16: [kp/2][16][2] bf16                        (one 64-byte line per k pair: vdpbf16ps operand)
//   fp8 : [kp/4][64] e4m3, each line two k pairs laid out so that unpacklo/unpackhi_epi8 of the
//         converted high/low bytes yield the bf16 line of the first and second pair; scales [kp/bk];
//         flags [ceil(kp/64)] bytes: bit p % 8 of byte p / 8 set where line pair p (lines 2p, 2p + 1)
//         holds a code that fp8_code_needs_tables
//   int8: [kp/4][16][4] s8 with per-row scales [16] and comp [16] = 128 * row sum (u8 activations)
//   int4: per group of `group` columns: group/8 lines [16][4] bytes, byte j of a row holding k = 8c + j
//         (low nibble) and 8c + 4 + j (high), nibble = q + 8; then one line of the 16 rows' fp32 scales
// w13 interleaves tiles: 2t = gate rows 16t.., 2t + 1 = up rows 16t.. .
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "cache_aligned.h"
#include "thread_pool.h"

namespace hybridd {

enum class Format : int { kBF16 = 0, kFP8 = 1, kINT8 = 2, kINT4 = 3 };
// The formats whose activations are quantized per token and multiplied in integers.
inline bool int_format(Format f) { return f == Format::kINT8 || f == Format::kINT4; }
// kAmx: the AVX-512 BF16 kernels, with AMX tile kernels for blocks of many tokens per expert. kAvx512: AVX-512
// F/BW/VL/DQ only (tile_dot_avx512f.h); kAvx512Vnni: that, with the int formats by VNNI (tile_dot_vnni.h).
enum class Isa : int { kGeneric = 0, kAvx512Bf16 = 1, kAvx2 = 2, kAmx = 3, kAvx512 = 4, kAvx512Vnni = 5 };
// The amx path runs the AVX-512 BF16 kernels wherever it does not run AMX ones.
inline bool avx512_bf16(Isa isa) { return isa == Isa::kAvx512Bf16 || isa == Isa::kAmx; }
// Paths whose CPUs run AVX512VNNI_TARGET code (simd_math.h).
inline bool vnni(Isa isa) { return isa == Isa::kAvx512Vnni || avx512_bf16(isa); }
// Paths whose CPUs run AVX512F_TARGET code (simd_math.h).
inline bool avx512(Isa isa) { return isa == Isa::kAvx512 || vnni(isa); }
// Paths whose CPUs run AVX2_TARGET code: all but the generic one (isa_supported asks AVX-512 CPUs for AVX2 + FMA).
inline bool runs_avx2(Isa isa) { return isa != Isa::kGeneric; }

constexpr int kRows = 16;  // output rows per packed tile

// The fp8 codes the kernels' two-instruction conversion gets wrong: zero, subnormal (and the tiny e = 1,
// m < 7 codes the test also catches) and NaN. A line pair holding one is converted by tables instead.
inline bool fp8_code_needs_tables(uint8_t c) { return ((c + 1) & 0x70) == 0; }
inline int64_t fp8_flag_bytes(int64_t kp) { return (kp / 8 + 7) / 8; }

struct PackedMatrices {
  const uint8_t* data = nullptr;  // expert e at data + e * data_stride
  int64_t data_stride = 0;
  const float* scales = nullptr;  // per tile: scales_per_tile floats
  int64_t scales_stride = 0;
  const int32_t* comp = nullptr;  // int8: per tile 16 ints
  int64_t comp_stride = 0;
  const uint8_t* flags = nullptr;  // fp8: per tile fp8_flag_bytes(kp) bytes
  int64_t flags_stride = 0;
  int tiles = 0;  // row tiles of 16
  int kp = 0;     // padded K
};

struct ExpertLayer {
  Format format = Format::kBF16;
  int num_experts = 0;
  int hidden = 0;        // H
  int inter = 0;         // I
  int block_k = 128;     // fp8 scale block along K
  int group = 128;       // int4 group along K
  PackedMatrices w13;    // K = H (padded to w13.kp), 2 * ceil(I/16) tiles
  PackedMatrices w2;     // K = I (padded to w2.kp), ceil(H/16) tiles
};

// One packed tile (16 output rows x kp columns) of one expert's matrix.
struct Tile {
  const uint8_t* data;
  const float* scales;  // fp8: one per block_k columns; int8: one per row
  const int32_t* comp;  // int8: 128 * row sum
  int kp;
  const uint8_t* flags = nullptr;  // fp8: the line pair flags, this tile's first pair at bit pair0
  int pair0 = 0;
};

// Columns [k0, k0 + klen) of an fp8 tile (k0 a multiple of 16) as a tile of their own; no scales.
inline Tile fp8_columns(const Tile& t, int k0, int klen) {
  return {t.data + int64_t(k0) * kRows, nullptr, nullptr, klen, t.flags, t.pair0 + k0 / 8};
}

// The input rows of one matrix product, in the representation the format's kernel reads.
struct Act {
  const uint16_t* bf = nullptr;  // bf16 / fp8 formats: bf16 [rows][kp]
  const int8_t* q = nullptr;     // int8: u8 (= q + 128) bytes; int4: s8; [rows][kp]
  const float* scale = nullptr;  // per row dequantization scale (int formats)
  const int32_t* gsum = nullptr; // int4: per row, per group sum of q
  int64_t kp = 0;
  int ngroups = 0;
  bool exact = false;            // rows are bf16 hi + lo pairs of fp32 values: weights must stay unrounded
  bool padded = false;           // 16 more rows past any row are readable (AMX reads a partial block in place)
  bool amx_packed = false;       // the rows of products that tile_span_amx runs are packed as its operands
};

// An fp8 tile's columns as bf16 lines in the bf16 tile layout (AVX-512 VBMI); with `scales`, each block_k
// columns multiplied by their block scale and rounded to bf16 once.
void convert_fp8_tile(const Tile& t, const float* scales, int block_k, uint16_t* lines);

Isa best_isa();
bool isa_supported(Isa isa);
// Throws std::invalid_argument when this CPU cannot run `isa`.
void check_isa(Isa isa);
// The fp8 -> bf16 line conversion the kernels use (64 e4m3 bytes -> two 64-byte bf16 lines), for tests.
void fp8_to_bf16_lines(const uint8_t* src, int64_t lines, uint16_t* dst, Isa isa);
const char* isa_name(Isa isa);

struct PagedAttention;  // attention.h
struct RmsNorm;         // norm.h
struct Rope;            // rope.h
struct SoftmaxTopK;     // routing.h
struct GroupedTopK;     // routing.h
struct Add;             // elementwise.h
struct SiluMul;         // elementwise.h
struct Widen;           // elementwise.h
struct Sigmoid;         // elementwise.h

// Where each active expert's activation rows sit once sorted by expert: R rows per slot from row first[e].
// The rows of a packed[e] expert (those tile_span_amx reads) are its A operands (pack_amx_block), padded to
// whole 16-row blocks.
struct SortedRows {
  std::vector<int> first;
  std::vector<char> packed;
  int rows = 0;  // padding included
};

class MoeRunner {
 public:
  // cpus[i], nodes[i]: core and NUMA node of pool thread i; spin_us: idle workers' polling time (see ThreadPool).
  MoeRunner(std::vector<int> cpus, std::vector<int> nodes, int spin_us)
      : pool_(std::move(cpus), std::move(nodes), spin_us) {}
  int num_threads() const { return pool_.size(); }
  int spin_us() const { return pool_.spin_us(); }
  void set_spin_us(int us) { pool_.set_spin_us(us); }
  int num_nodes() const { return pool_.num_nodes(); }
  // out[t] = scale * sum_j weights[t, j] * expert_{ids[t, j]}(x[t]); x, out: [T, H], bf16 or (f32_io) fp32.
  void forward(const ExpertLayer& layer, const void* x, bool f32_io, int num_tokens, int topk, const int32_t* ids,
               const float* weights, float scale, void* out, Isa isa);
  // out[t] = W x[t] for one packed matrix W [n, k] (expert 0 of `w`); x [T, k], out [T, n].
  void linear(Format format, const PackedMatrices& w, int n, int k, int block_k, int group, const void* x,
              bool f32_io, int num_tokens, void* out, Isa isa);
  // out[t, h] = W_h x[t, h] for `heads` packed matrices W_h [n, k] (expert h of `w`): input row (t, h) at
  // x + t * x_strides[0] + h * x_strides[1] elements, output row (t, h) likewise in out (MLA's absorbed
  // per-head projections).
  void head_linear(Format format, const PackedMatrices& w, int heads, int n, int k, int block_k, int group,
                   const void* x, const int64_t x_strides[2], bool f32_io, int num_tokens, void* out,
                   const int64_t out_strides[2], Isa isa);
  // Paged attention on this runner's threads (attention.cpp).
  void attention(const PagedAttention& a, Isa isa);
  // RMSNorm of every row (norm.cpp).
  void rms_norm(const RmsNorm& n);
  // Rotary embedding of every row (rope.cpp).
  void rope(const Rope& r, Isa isa);
  // Softmax / grouped top-k routing of every token (routing.cpp).
  void softmax_topk(const SoftmaxTopK& r);
  void grouped_topk(const GroupedTopK& r);
  // Elementwise ops (elementwise.cpp).
  void add(const Add& a);
  void silu_mul(const SiluMul& s, Isa isa);
  void widen(const Widen& w, Isa isa);
  void sigmoid(const Sigmoid& s, Isa isa);

 private:
  void run(int ntasks, int64_t elements, const std::function<void(int, int)>& fn);
  // fn(r0, r1) over row ranges splitting [0, rows), up to four per thread, under the runner's lock; inline
  // (run) when rows * elements_per_row is small.
  void run_rows(int64_t rows, int64_t elements_per_row, const std::function<void(int64_t, int64_t)>& fn);
  Act prepare_input(Format f, int group, const void* x, bool f32_io, int num_tokens, int k, int kp, int rows_per_token,
                    Isa isa);
  // fn(expert, t0, t1) for every active expert's tiles [0, tiles) in chunks of up to `longest` tiles, split so
  // every thread gets several tasks; with several NUMA nodes a node always gets the same chunks of every expert.
  void run_expert_tiles(const std::vector<int>& active, int tiles, int longest,
                        const std::function<void(int, int, int)>& fn);
  // The rows of the sorted slots (R per slot, slot r taking token tok[r]'s), where `sorted` puts them (bf16
  // rows; int rows of slot r at row r); expert e's slots are [count[e], count[e + 1]).
  Act sort_rows(const Act& a, const std::vector<int>& tok, const std::vector<int>& count,
                const std::vector<int>& active, int rows_per_token, const SortedRows& sorted);

  ThreadPool pool_;
  std::mutex mutex_;
  AlignedVector<float> ybuf_;
  std::vector<float> actf_;
  std::vector<uint16_t> xbf_;
  std::vector<uint8_t> xdense_;  // head_linear: strided head rows gathered contiguous
  AlignedVector<uint16_t> xpacked_, actbf_, sortbf_;
  std::vector<int8_t> xq_, actq_;
  std::vector<float> xscale_, actscale_;
  std::vector<int32_t> xgsum_, actgsum_;
  std::vector<int8_t> sortq_;
  std::vector<float> sortscale_;
  std::vector<int32_t> sortgsum_;
};

}  // namespace hybridd
