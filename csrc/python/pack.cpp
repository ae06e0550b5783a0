// The pack file as Python sees it: its layout (the metadata every wrapper sizes itself by) and
// CRC32C, the record checksum of pack format v2, one implementation for C++ and Python.
#include "pack.h"

#include <memory>

#include "pack/checksum.h"

namespace strata::python {

py::dict layout_dict(const PackLayout& L) {
  py::dict d;
  d["n_layers"] = L.n_layers;
  d["n_experts"] = L.n_experts;
  d["top_k"] = L.top_k;
  d["hidden"] = L.hidden;
  d["moe_intermediate"] = L.moe_intermediate;
  d["routing"] = L.routing == Routing::SoftmaxTopk   ? "softmax_topk"
                 : L.routing == Routing::TopkSoftmax ? "topk_softmax"
                                                     : "external";
  d["activation"] = L.activation == Activation::SwiGLU ? "swiglu" : "swiglu_oai";
  d["bias_format"] = L.bias_format;
  d["norm_topk_prob"] = L.norm_topk_prob;
  d["weight_format"] = static_cast<std::uint32_t>(L.weight_format);
  d["group_size"] = L.group_size;
  d["record_bytes"] = L.record_bytes;
  d["record_stride"] = L.record_stride;
  d["records_offset"] = L.records_offset;
  d["file_bytes"] = L.file_bytes;
  return d;
}

void init_pack(py::module_& m) {
  m.def(
      "read_layout", [](const std::string& path) { return layout_dict(read_pack_layout(path)); },
      py::arg("path"), "The layout of the pack at `path`, as ExpertStream.layout gives it.");
  m.def(
      "crc32c",
      [](py::object buffer, std::uint32_t seed) {
        Py_buffer view;
        // PyBUF_SIMPLE: a contiguous run of bytes, or BufferError naming the problem.
        if (PyObject_GetBuffer(buffer.ptr(), &view, PyBUF_SIMPLE) != 0)
          throw py::error_already_set();
        std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> hold(&view, PyBuffer_Release);
        const std::size_t n = std::size_t(view.len);
        if (n < (std::size_t(64) << 10)) return crc32c(view.buf, n, seed);
        // Large records: let other threads (the pack writer's producer, verify's pool) run.
        py::gil_scoped_release nogil;
        return crc32c(view.buf, n, seed);
      },
      py::arg("buffer"), py::arg("seed") = 0,
      "CRC32C (Castagnoli) of a contiguous buffer, continuing from `seed` like zlib.crc32: "
      "crc32c(b, crc32c(a)) == crc32c(a + b). Releases the GIL for buffers of 64 KiB or more.");
  m.attr("CRC32C_IMPL") = std::string(crc32c_impl());
}

}  // namespace strata::python
