// The pack file as Python sees it: its layout (the metadata every wrapper sizes itself by), the
// header parser (pack/header.py reads headers through it: one parser for C++ and Python) and
// CRC32C, the record checksum of pack format v2, one implementation for C++ and Python.
#include "pack.h"

#include <pybind11/stl.h>

#include <memory>
#include <optional>

#include "pack/checksum.h"

namespace strata::python {

// Every field the header stores or implies, format codes as stored: what ExpertStream.layout
// gives, and what the Python reader builds its PackHeader from (pack/header.py).
py::dict layout_dict(const PackLayout& L) {
  py::dict d;
  d["version"] = L.version();
  d["n_layers"] = L.n_layers;
  d["n_experts"] = L.n_experts;
  d["top_k"] = L.top_k;
  d["hidden"] = L.hidden;
  d["moe_intermediate"] = L.moe_intermediate;
  d["routing"] = L.routing == Routing::SoftmaxTopk   ? "softmax_topk"
                 : L.routing == Routing::TopkSoftmax ? "topk_softmax"
                                                     : "external";
  d["activation"] = activation_name(L.activation);
  d["gated"] = L.gated;
  d["act_alpha"] = L.act_alpha;
  d["act_limit"] = L.act_limit;
  d["bias_format"] = L.bias_format;
  d["norm_topk_prob"] = L.norm_topk_prob;
  d["weight_format"] = static_cast<std::uint32_t>(L.weight_format);
  d["group_size"] = L.group_size;
  d["scale_format"] = L.scale_format;
  d["record_bytes"] = L.record_bytes;
  d["record_stride"] = L.record_stride;
  d["meta_offset"] = L.meta_offset;
  d["meta_bytes"] = L.meta_bytes;
  d["meta_crc"] = L.meta_crc;
  d["router_offset"] = L.router_offset;
  d["router_bytes"] = L.router_bytes;
  d["router_crc"] = L.router_crc;
  d["checksum_offset"] = L.checksum_offset;
  d["checksum_bytes"] = L.checksum_bytes;
  d["records_offset"] = L.records_offset;
  d["file_bytes"] = L.file_bytes;
  py::list classes, class_tensors;
  for (const LayerFormat& lf : L.classes) {
    py::list mats;
    for (const MatrixFormat& f : lf)
      mats.append(py::make_tuple(static_cast<std::uint32_t>(f.format), f.group_size,
                                 f.scale_format));
    classes.append(py::tuple(mats));
  }
  for (const std::vector<TensorEntry>& table : L.class_tensors) {
    py::list entries;
    for (const TensorEntry& t : table)
      entries.append(py::make_tuple(t.matrix, t.role, t.offset, t.nbytes, t.rows, t.cols));
    class_tensors.append(entries);
  }
  d["classes"] = classes;
  d["class_tensors"] = class_tensors;
  d["layer_class"] =
      py::cast(std::vector<std::uint32_t>(L.layer_class.begin(), L.layer_class.end()));
  return d;
}

void init_pack(py::module_& m) {
  // Header bytes first: pybind11 would take bytes for the path's std::string too.
  m.def(
      "read_layout",
      [](py::buffer header, const std::string& where, std::optional<std::uint64_t> file_bytes) {
        const py::buffer_info b = header.request();
        if (b.ndim != 1 || b.itemsize != 1)
          throw py::type_error("read_layout: header must be a 1-d buffer of bytes");
        return layout_dict(decode_pack_header(static_cast<const unsigned char*>(b.ptr),
                                              std::size_t(b.size), where, file_bytes));
      },
      py::arg("header"), py::arg("where"), py::arg("file_bytes") = py::none(),
      "Decodes and validates pack header bytes: PackError beginning with `where` (\"pack "
      "<path>\") names the field; `file_bytes`, the file's size, must equal the header's.");
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
