// Python binding: tensors cross as raw addresses and sizes, validated by cpu_kernels/moe.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "all_reduce.h"
#include "amx.h"
#include "attention.h"
#include "elementwise.h"
#include "kernel_program.h"
#include "logits_scan.h"
#include "moe.h"
#include "norm.h"
#include "rope.h"
#include "routing.h"
#include "row_ops.h"
#include "slot_channel.h"
#include "tile_layout.h"

namespace py = pybind11;
using hybridd::ExpertLayer;
using hybridd::Format;
using hybridd::Isa;
using hybridd::KernelProgram;
using hybridd::MoeRunner;
using hybridd::PackedMatrices;
using hybridd::ShmCollectives;
using hybridd::ShmGroup;
using hybridd::SlotCall;
using hybridd::SlotOffsets;
using hybridd::SlotServer;

namespace {
// A raw address from Python as a typed pointer.
template <typename T>
T* as(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

PackedMatrices matrices(uintptr_t data, int64_t data_stride, uintptr_t scales, int64_t scales_stride, uintptr_t comp,
                        int64_t comp_stride, uintptr_t flags, int64_t flags_stride, int tiles, int kp) {
  PackedMatrices m;
  m.data = reinterpret_cast<const uint8_t*>(data);
  m.data_stride = data_stride;
  m.scales = reinterpret_cast<const float*>(scales);
  m.scales_stride = scales_stride;
  m.comp = reinterpret_cast<const int32_t*>(comp);
  m.comp_stride = comp_stride;
  m.flags = reinterpret_cast<const uint8_t*>(flags);
  m.flags_stride = flags_stride;
  m.tiles = tiles;
  m.kp = kp;
  return m;
}

// The kernels a MoeRunner runs, each callable at once (MoeRunner.<name>) or recorded into a KernelProgram
// (KernelProgram.<name>(runner, ...)) with the same arguments.
void k_forward(MoeRunner& r, const ExpertLayer& layer, uintptr_t x, bool f32_io, int tokens, int topk, uintptr_t ids,
               uintptr_t weights, float scale, uintptr_t out, int isa) {
  r.forward(layer, as<const void>(x), f32_io, tokens, topk, as<const int32_t>(ids), as<const float>(weights), scale,
            as<void>(out), static_cast<Isa>(isa));
}

void k_linear(MoeRunner& r, int fmt, const PackedMatrices& w, int n, int k, int block_k, int group, uintptr_t x,
              bool f32_io, int tokens, uintptr_t out, int isa) {
  r.linear(static_cast<Format>(fmt), w, n, k, block_k, group, as<const void>(x), f32_io, tokens, as<void>(out),
           static_cast<Isa>(isa));
}

void k_head_linear(MoeRunner& r, int fmt, const PackedMatrices& w, int heads, int n, int k, int block_k, int group,
                   uintptr_t x, int64_t x_token_stride, int64_t x_head_stride, bool f32_io, int tokens, uintptr_t out,
                   int64_t out_token_stride, int64_t out_head_stride, int isa) {
  const int64_t x_strides[2] = {x_token_stride, x_head_stride}, out_strides[2] = {out_token_stride, out_head_stride};
  r.head_linear(static_cast<Format>(fmt), w, heads, n, k, block_k, group, as<const void>(x), x_strides, f32_io, tokens,
                as<void>(out), out_strides, static_cast<Isa>(isa));
}

void k_rms_norm(MoeRunner& r, uintptr_t x, int64_t heads, int64_t token_stride, uintptr_t out, uintptr_t weight,
                int64_t rows, int64_t dim, float eps, bool f32) {
  r.rms_norm({.x = as<const void>(x), .heads = heads, .token_stride = token_stride, .out = as<void>(out),
              .weight = as<const void>(weight), .rows = rows, .dim = dim, .eps = eps, .f32 = f32});
}

void k_rope(MoeRunner& r, uintptr_t x, int64_t token_stride, int64_t head_stride, uintptr_t out, uintptr_t cos,
            uintptr_t sin, int64_t tokens, int64_t heads, int64_t dim, bool interleave, bool f32, int isa) {
  r.rope({.x = as<const void>(x), .token_stride = token_stride, .head_stride = head_stride, .out = as<void>(out),
          .cos = as<const void>(cos), .sin = as<const void>(sin), .tokens = tokens, .heads = heads, .dim = dim,
          .interleave = interleave, .f32 = f32},
         static_cast<Isa>(isa));
}

void k_softmax_topk(MoeRunner& r, uintptr_t logits, bool f32, int64_t tokens, int64_t experts, int k,
                    bool renormalize, uintptr_t ids, uintptr_t weights) {
  r.softmax_topk({.logits = as<const void>(logits), .f32 = f32, .tokens = tokens, .experts = experts, .k = k,
                  .renormalize = renormalize, .ids = as<int32_t>(ids), .weights = as<void>(weights)});
}

void k_grouped_topk(MoeRunner& r, uintptr_t scores, uintptr_t bias, int64_t tokens, int64_t experts, int k, int groups,
                    int keep_groups, bool renormalize, float scaling, uintptr_t ids, uintptr_t weights) {
  r.grouped_topk({.scores = as<const float>(scores), .bias = as<const float>(bias), .tokens = tokens,
                  .experts = experts, .k = k, .groups = groups, .keep_groups = keep_groups,
                  .renormalize = renormalize, .scaling = scaling, .ids = as<int32_t>(ids),
                  .weights = as<float>(weights)});
}

void k_paged_attention(MoeRunner& r, uintptr_t q, uintptr_t out, bool f32, int num_seqs, int num_heads,
                       int num_kv_heads, int head_dim, int v_head_dim, uintptr_t k, uintptr_t v,
                       int64_t k_token_stride, int64_t k_head_stride, int64_t v_token_stride, int64_t v_head_stride,
                       int block_size, uintptr_t block_tables, int table_width, uintptr_t context_lens,
                       uintptr_t query_lens, float scale, int64_t num_queries, int64_t num_blocks, int isa) {
  r.attention({.q = as<const void>(q), .out = as<void>(out), .f32 = f32, .num_seqs = num_seqs, .num_heads = num_heads,
               .num_kv_heads = num_kv_heads, .head_dim = head_dim, .v_head_dim = v_head_dim, .k = as<const void>(k),
               .v = as<const void>(v), .k_token_stride = k_token_stride, .k_head_stride = k_head_stride,
               .v_token_stride = v_token_stride, .v_head_stride = v_head_stride, .block_size = block_size,
               .block_tables = as<const int32_t>(block_tables), .table_width = table_width,
               .context_lens = as<const int32_t>(context_lens), .query_lens = as<const int32_t>(query_lens),
               .scale = scale, .num_queries = num_queries, .num_blocks = num_blocks},
              static_cast<Isa>(isa));
}

void k_add(MoeRunner& r, uintptr_t a, uintptr_t b, uintptr_t out, int64_t n, bool f32) {
  r.add({.a = as<const void>(a), .b = as<const void>(b), .out = as<void>(out), .n = n, .f32 = f32});
}

void k_silu_mul(MoeRunner& r, uintptr_t g, int64_t g_stride, uintptr_t u, int64_t u_stride, uintptr_t out,
                int64_t rows, int64_t cols, bool f32, int isa) {
  r.silu_mul({.g = as<const void>(g), .u = as<const void>(u), .g_stride = g_stride, .u_stride = u_stride,
              .out = as<void>(out), .rows = rows, .cols = cols, .f32 = f32},
             static_cast<Isa>(isa));
}

void k_widen(MoeRunner& r, uintptr_t x, uintptr_t out, int64_t n, int isa) {
  r.widen({.x = as<const uint16_t>(x), .out = as<float>(out), .n = n}, static_cast<Isa>(isa));
}

void k_sigmoid(MoeRunner& r, uintptr_t x, uintptr_t out, int64_t n, int isa) {
  r.sigmoid({.x = as<const float>(x), .out = as<float>(out), .n = n}, static_cast<Isa>(isa));
}

void k_copy_rows(MoeRunner&, uintptr_t src, int64_t src_stride, uintptr_t dst, int64_t dst_stride, int64_t rows,
                 int64_t row_bytes) {
  hybridd::copy_rows({.src = as<const void>(src), .dst = as<void>(dst), .src_stride = src_stride,
                      .dst_stride = dst_stride, .rows = rows, .row_bytes = row_bytes});
}

void k_gather_rows(MoeRunner&, uintptr_t table, int64_t num_rows, int64_t row_stride, uintptr_t index, uintptr_t dst,
                   int64_t dst_stride, int64_t rows, int64_t row_bytes) {
  hybridd::gather_rows({.table = as<const void>(table), .num_rows = num_rows, .row_stride = row_stride,
                        .index = as<const int64_t>(index), .dst = as<void>(dst), .dst_stride = dst_stride,
                        .rows = rows, .row_bytes = row_bytes});
}

void k_store_rows(MoeRunner&, uintptr_t cache, int64_t num_slots, int64_t slot_stride, uintptr_t slots, uintptr_t src,
                  int64_t src_stride, int64_t rows, int64_t row_bytes) {
  hybridd::store_rows({.cache = as<void>(cache), .num_slots = num_slots, .slot_stride = slot_stride,
                       .slots = as<const int64_t>(slots), .src = as<const void>(src), .src_stride = src_stride,
                       .rows = rows, .row_bytes = row_bytes});
}

// An expert-process call through one slot: submitted, then waited for, as two kernels (the engine runs its shared
// experts in between).
void k_expert_submit(SlotCall& c, int layer, int tokens, int topk, bool f32, uintptr_t x, uintptr_t ids, bool ids64,
                     uintptr_t weights) {
  c.submit(layer, tokens, topk, f32, as<const void>(x), as<const void>(ids), ids64, as<const float>(weights));
}

void k_expert_wait(SlotCall& c, uintptr_t out, int64_t out_bytes) { c.wait(as<void>(out), out_bytes); }

void k_all_reduce(ShmCollectives& c, uintptr_t data, int64_t numel, bool bf16) {
  c.all_reduce(as<void>(data), numel, bf16);
}

// fn as Target.<name> (run now, without the GIL) and as KernelProgram.<name>(target, ...), which records the
// call with copies of its arguments (raw addresses, sizes and the packed weights' descriptions). The target (a
// MoeRunner, a SlotCall) must outlive the program.
template <typename Target, typename... Args>
void def_kernel(py::class_<Target>& target, py::class_<KernelProgram>& program, const char* name,
                void (*fn)(Target&, Args...)) {
  target.def(name, fn, py::call_guard<py::gil_scoped_release>());
  program.def(name, [fn](KernelProgram& p, Target& t, Args... args) {
    p.add([fn, target = &t, args...] { fn(*target, args...); });
  });
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hybridd CPU MoE kernels";
  m.def("best_isa", [] { return static_cast<int>(hybridd::best_isa()); });
  m.def("isa_supported", [](int isa) { return hybridd::isa_supported(static_cast<Isa>(isa)); });
  m.def("fp8_to_bf16_lines", [](uintptr_t src, int64_t lines, uintptr_t dst, int isa) {
    hybridd::fp8_to_bf16_lines(reinterpret_cast<const uint8_t*>(src), lines, reinterpret_cast<uint16_t*>(dst),
                               static_cast<Isa>(isa));
  });
  m.def("pack_tile_lines", [](int layout, uintptr_t src, int64_t src_stride, int64_t n, int64_t row_bytes,
                              int64_t padded_bytes, uintptr_t dst) {
    py::gil_scoped_release release;
    hybridd::pack_tile_lines(static_cast<hybridd::TileLayout>(layout), reinterpret_cast<const uint8_t*>(src),
                             src_stride, n, row_bytes, padded_bytes, reinterpret_cast<uint8_t*>(dst));
  });
  m.def("fp8_pair_flags", [](uintptr_t lines, int64_t tiles, int64_t kp, uintptr_t flags) {
    py::gil_scoped_release release;
    hybridd::fp8_pair_flags(reinterpret_cast<const uint8_t*>(lines), tiles, kp, reinterpret_cast<uint8_t*>(flags));
  });
  m.def("amx_calls", &hybridd::amx_calls);
  // The row conversions around the dot kernels, one call per row, for their tests.
  m.def("row_to_f32", [](int isa, uintptr_t src, bool f32, int n, uintptr_t dst) {
    hybridd::to_f32(static_cast<Isa>(isa), as<const void>(src), f32, n, as<float>(dst));
  });
  m.def("row_split_bf16", [](int isa, uintptr_t v, int n, uintptr_t hi, uintptr_t lo) {
    hybridd::split_bf16(static_cast<Isa>(isa), as<const float>(v), n, as<uint16_t>(hi), as<uint16_t>(lo));
  });
  m.def("row_put", [](int isa, uintptr_t hi, uintptr_t lo, int n, float scale, bool f32, uintptr_t dst) {
    hybridd::put(static_cast<Isa>(isa), as<const float>(hi), as<const float>(lo), n, scale, f32, as<void>(dst));
  });
  m.def("row_axpy_tiles", [](int isa, float w, uintptr_t hi, uintptr_t lo, int64_t stride, int n, uintptr_t acc) {
    hybridd::axpy_tiles(static_cast<Isa>(isa), w, as<const float>(hi), as<const float>(lo), stride, n, as<float>(acc));
  });
  m.def("row_silu_mul", [](int isa, uintptr_t g, uintptr_t u, uintptr_t out) {
    hybridd::silu_mul_row(static_cast<Isa>(isa), as<const float>(g), as<const float>(u), as<float>(out));
  });
  m.def("row_quantize", [](int isa, uintptr_t v, int k, int kp, int fmt, int group, uintptr_t q, uintptr_t scale,
                           uintptr_t gsum) {
    hybridd::quantize_row(static_cast<Isa>(isa), as<const float>(v), k, kp, static_cast<Format>(fmt), group,
                          as<int8_t>(q), as<float>(scale), as<int32_t>(gsum));
  });
  // bits None: no row masked; else bits row i masks logits row rows[i] (rows None: row i). (greedy, status) as lists.
  m.def("logits_scan", [](int isa, uintptr_t logits, bool bf16, int64_t batch, int64_t vocab, int64_t stride,
                          std::optional<std::vector<int64_t>> rows,
                          std::optional<py::array_t<int32_t, py::array::c_style>> bits) {
    std::vector<int64_t> mask_of_row;
    if (bits) {
      const auto masked = static_cast<py::ssize_t>(rows ? rows->size() : batch);
      if (bits->ndim() != 2 || bits->shape(0) != masked)
        throw std::invalid_argument("bits must be int32 [rows, words], one row per logits row masked");
      mask_of_row.assign(batch, -1);
      for (py::ssize_t i = 0; i < masked; ++i) {
        const int64_t r = rows ? (*rows)[i] : i;
        if (r < 0 || r >= batch || mask_of_row[r] >= 0)
          throw std::invalid_argument("rows must be distinct rows of the logits");
        mask_of_row[r] = i;
      }
    }
    std::vector<int64_t> greedy(batch);
    std::vector<uint8_t> status(batch);
    hybridd::logits_scan(static_cast<Isa>(isa), as<void>(logits), bf16, batch, vocab, stride,
                         bits ? mask_of_row.data() : nullptr,
                         bits ? reinterpret_cast<const uint32_t*>(bits->data()) : nullptr, bits ? bits->shape(1) : 0,
                         greedy.data(), status.data());
    py::list g(batch), s(batch);
    for (int64_t r = 0; r < batch; ++r) {
      g[r] = greedy[r];
      s[r] = status[r];
    }
    return py::make_tuple(g, s);
  });
  m.def("isa_name", [](int isa) { return std::string(hybridd::isa_name(static_cast<Isa>(isa))); });

  py::class_<PackedMatrices>(m, "PackedMatrices")
      .def(py::init(&matrices), py::arg("data"), py::arg("data_stride"), py::arg("scales"), py::arg("scales_stride"),
           py::arg("comp"), py::arg("comp_stride"), py::arg("flags"), py::arg("flags_stride"), py::arg("tiles"),
           py::arg("kp"));

  py::class_<ExpertLayer>(m, "ExpertLayer")
      .def(py::init([](int fmt, int num_experts, int hidden, int inter, int block_k, int group,
                       const PackedMatrices& w13, const PackedMatrices& w2) {
             ExpertLayer l;
             l.format = static_cast<Format>(fmt);
             l.num_experts = num_experts;
             l.hidden = hidden;
             l.inter = inter;
             l.block_k = block_k;
             l.group = group;
             l.w13 = w13;
             l.w2 = w2;
             return l;
           }),
           py::arg("fmt"), py::arg("num_experts"), py::arg("hidden"), py::arg("inter"), py::arg("block_k"),
           py::arg("group"), py::arg("w13"), py::arg("w2"));

  py::class_<SlotOffsets>(m, "SlotOffsets")
      .def(py::init([](int64_t error, int64_t error_bytes, int64_t x, int64_t ids, int64_t weights, int64_t out,
                       int hidden, int max_tokens, int max_topk) {
             SlotOffsets o;
             o.error = error;
             o.error_bytes = error_bytes;
             o.x = x;
             o.ids = ids;
             o.weights = weights;
             o.out = out;
             o.hidden = hidden;
             o.max_tokens = max_tokens;
             o.max_topk = max_topk;
             return o;
           }),
           py::arg("error"), py::arg("error_bytes"), py::arg("x"), py::arg("ids"), py::arg("weights"), py::arg("out"),
           py::arg("hidden"), py::arg("max_tokens"), py::arg("max_topk"));
  py::register_exception<hybridd::ExpertCallError>(m, "ExpertCallError", PyExc_RuntimeError);
  auto slot_call = py::class_<SlotCall>(m, "SlotCall");
  slot_call.def(py::init([](uintptr_t slot, const SlotOffsets& o, int server_pid, int64_t timeout_us, int spin_us,
                             int64_t poll_us) {
                  return new SlotCall(as<uint8_t>(slot), o, server_pid, timeout_us, spin_us, poll_us);
                }),
                py::arg("slot"), py::arg("offsets"), py::arg("server_pid"), py::arg("timeout_us"), py::arg("spin_us"),
                py::arg("poll_us"))
      .def("close", &SlotCall::close);
  py::register_exception<hybridd::CollectiveError>(m, "CommunicationError", PyExc_RuntimeError);
  auto collectives = py::class_<ShmCollectives>(m, "ShmCollectives");
  collectives.def(py::init<ShmGroup, int64_t>(), py::arg("group"), py::arg("timeout_us"))
      .def("next_seq", &ShmCollectives::next_seq)
      .def_property_readonly("seq", &ShmCollectives::seq)
      .def("close", &ShmCollectives::close);

  auto runner = py::class_<MoeRunner>(m, "MoeRunner");
  runner
      .def(py::init<std::vector<int>, std::vector<int>, int>(), py::arg("cpus"), py::arg("nodes"), py::arg("spin_us"))
      .def_property_readonly("num_threads", &MoeRunner::num_threads)
      .def_property("spin_us", &MoeRunner::spin_us, &MoeRunner::set_spin_us)
      .def_property_readonly("num_nodes", &MoeRunner::num_nodes);

  auto program = py::class_<KernelProgram>(m, "KernelProgram");
  program.def(py::init<>())
      .def("run", &KernelProgram::run, py::call_guard<py::gil_scoped_release>())
      .def("run_timed", &KernelProgram::run_timed, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &KernelProgram::size);
  def_kernel(runner, program, "forward", &k_forward);
  def_kernel(runner, program, "linear", &k_linear);
  def_kernel(runner, program, "head_linear", &k_head_linear);
  def_kernel(runner, program, "rms_norm", &k_rms_norm);
  def_kernel(runner, program, "rope", &k_rope);
  def_kernel(runner, program, "softmax_topk", &k_softmax_topk);
  def_kernel(runner, program, "grouped_topk", &k_grouped_topk);
  def_kernel(runner, program, "paged_attention", &k_paged_attention);
  def_kernel(runner, program, "add", &k_add);
  def_kernel(runner, program, "silu_mul", &k_silu_mul);
  def_kernel(runner, program, "widen", &k_widen);
  def_kernel(runner, program, "sigmoid", &k_sigmoid);
  def_kernel(runner, program, "copy_rows", &k_copy_rows);
  def_kernel(runner, program, "store_rows", &k_store_rows);
  def_kernel(runner, program, "gather_rows", &k_gather_rows);
  def_kernel(slot_call, program, "expert_submit", &k_expert_submit);
  def_kernel(slot_call, program, "expert_wait", &k_expert_wait);
  def_kernel(collectives, program, "all_reduce", &k_all_reduce);

  py::class_<SlotServer>(m, "SlotServer")
      .def(py::init([](uintptr_t slot, const SlotOffsets& o, MoeRunner& runner, std::map<int, ExpertLayer> layers,
                       int isa, int spin_us) {
             return new SlotServer(reinterpret_cast<uint8_t*>(slot), o, &runner, std::move(layers),
                                   static_cast<Isa>(isa), spin_us);
           }),
           py::arg("slot"), py::arg("offsets"), py::arg("runner"), py::arg("layers"), py::arg("isa"),
           py::arg("spin_us"), py::keep_alive<1, 4>())
      .def("serve", &SlotServer::serve, py::call_guard<py::gil_scoped_release>())
      .def("stop", &SlotServer::stop)
      .def_property_readonly("calls", &SlotServer::calls)
      .def_property_readonly("busy_s", &SlotServer::busy_s);

  py::class_<ShmGroup>(m, "ShmGroup")
      .def(py::init([](uintptr_t base, int world, int rank, int64_t capacity, int spin_us, bool watch) {
             return ShmGroup{reinterpret_cast<uint8_t*>(base), world, rank, capacity, spin_us, watch};
           }),
           py::arg("base"), py::arg("world"), py::arg("rank"), py::arg("capacity"), py::arg("spin_us"),
           py::arg("watch") = false);
  m.def("shm_publish_pid", &hybridd::shm_publish_pid);
  m.def("shm_pid_namespace", &hybridd::shm_pid_namespace);
  m.def("shm_broadcast_send_bytes", [](const ShmGroup& g, int64_t seq, const py::bytes& payload, int64_t timeout_us) {
    char* data = nullptr;
    Py_ssize_t length = 0;
    PyBytes_AsStringAndSize(payload.ptr(), &data, &length);
    py::gil_scoped_release release;
    return hybridd::shm_broadcast_send(g, seq, data, length, timeout_us);
  });
  // The root's message `seq` (as sent by shm_broadcast_send_bytes), None when it has not come within timeout_us.
  m.def("shm_broadcast_receive_bytes", [](const ShmGroup& g, int64_t seq, int root, int64_t timeout_us) -> py::object {
    bool arrived;
    {
      py::gil_scoped_release release;
      arrived = hybridd::shm_broadcast_wait(g, seq, root, timeout_us);
    }
    if (!arrived) return py::none();
    const uint8_t* buf = g.base + hybridd::shm_buffer(g, seq, root);
    int64_t length;
    std::memcpy(&length, buf, 8);
    if (length < 0 || length > g.capacity - 8)
      throw std::runtime_error("a channel message of " + std::to_string(length) + " bytes does not fit its buffer");
    return py::bytes(reinterpret_cast<const char*>(buf + 8), static_cast<size_t>(length));
  });
  m.def("shm_buffer", &hybridd::shm_buffer);
}
