// Python binding: tensors cross as raw addresses and sizes, validated by cpu_kernels/moe.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "moe.h"

namespace py = pybind11;
using hybridd::ExpertLayer;
using hybridd::Format;
using hybridd::Isa;
using hybridd::MoeRunner;
using hybridd::PackedMatrices;

namespace {
PackedMatrices matrices(uintptr_t data, int64_t data_stride, uintptr_t scales, int64_t scales_stride, uintptr_t comp,
                        int64_t comp_stride, int tiles, int kp) {
  PackedMatrices m;
  m.data = reinterpret_cast<const uint8_t*>(data);
  m.data_stride = data_stride;
  m.scales = reinterpret_cast<const float*>(scales);
  m.scales_stride = scales_stride;
  m.comp = reinterpret_cast<const int32_t*>(comp);
  m.comp_stride = comp_stride;
  m.tiles = tiles;
  m.kp = kp;
  return m;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hybridd CPU MoE kernels";
  m.def("best_isa", [] { return static_cast<int>(hybridd::best_isa()); });
  m.def("fp8_to_bf16_lines", [](uintptr_t src, int64_t lines, uintptr_t dst, int isa) {
    hybridd::fp8_to_bf16_lines(reinterpret_cast<const uint8_t*>(src), lines, reinterpret_cast<uint16_t*>(dst),
                               static_cast<Isa>(isa));
  });
  m.def("isa_name", [](int isa) { return std::string(hybridd::isa_name(static_cast<Isa>(isa))); });

  py::class_<PackedMatrices>(m, "PackedMatrices")
      .def(py::init(&matrices), py::arg("data"), py::arg("data_stride"), py::arg("scales"), py::arg("scales_stride"),
           py::arg("comp"), py::arg("comp_stride"), py::arg("tiles"), py::arg("kp"));

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

  py::class_<MoeRunner>(m, "MoeRunner")
      .def(py::init<std::vector<int>>(), py::arg("cpus"))
      .def_property_readonly("num_threads", &MoeRunner::num_threads)
      .def(
          "forward",
          [](MoeRunner& r, const ExpertLayer& layer, uintptr_t x, bool f32_io, int tokens, int topk, uintptr_t ids,
             uintptr_t weights, float scale, uintptr_t out, int isa) {
            r.forward(layer, reinterpret_cast<const void*>(x), f32_io, tokens, topk,
                      reinterpret_cast<const int32_t*>(ids), reinterpret_cast<const float*>(weights), scale,
                      reinterpret_cast<void*>(out), static_cast<Isa>(isa));
          },
          py::call_guard<py::gil_scoped_release>())
      .def(
          "linear",
          [](MoeRunner& r, int fmt, const PackedMatrices& w, int n, int k, int block_k, int group, uintptr_t x,
             bool f32_io, int tokens, uintptr_t out, int isa) {
            r.linear(static_cast<Format>(fmt), w, n, k, block_k, group, reinterpret_cast<const void*>(x), f32_io,
                     tokens, reinterpret_cast<void*>(out), static_cast<Isa>(isa));
          },
          py::call_guard<py::gil_scoped_release>());
}
