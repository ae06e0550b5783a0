// strata_stream._bench: the native halves of benchmarks/kernels.py and benchmarks/io_bandwidth.py,
// an extension of their own so that the product's _core carries no benchmark code. Each call
// opens what it measures itself (the pack by path), so no engine object crosses between the two
// extensions. The GIL is released while anything is timed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "error_translation.h"
#include "exec/backend.h"
#include "kernel_bench.h"
#include "raw_read_bench.h"
#include "residency/expert_stream.h"

namespace py = pybind11;
using namespace strata;

PYBIND11_MODULE(_bench, m) {
  m.doc() = "strata-stream benchmark helpers (C++); used by benchmarks/, not by the library";

  m.def(
      "bench_kernels",
      [](const std::string& path, std::uint32_t layer, std::uint32_t rows, std::uint32_t repeats,
         unsigned threads, std::uint32_t seed, std::uint64_t flush_bytes) {
        if (rows == 0 || rows > (1u << 16)) throw py::value_error("rows must be 1..65536");
        if (repeats == 0 || repeats > 100000) throw py::value_error("repeats must be 1..100000");
        if (threads > 1024) throw py::value_error("threads must be 0..1024");
        std::vector<KernelTiming> t;
        {
          py::gil_scoped_release nogil;
          const PackLayout L = read_pack_layout(path);
          if (layer >= L.n_layers)
            throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                                    std::to_string(L.n_layers) + ")");
          StreamOptions o;  // every expert of the layer resident, and one slot to spare
          o.arena_bytes = (std::uint64_t(L.n_experts) + 1) * L.record_stride;
          ExpertStream stream(path, o);
          auto backend = make_cpu_backend(threads);
          t = bench_kernels(stream, *backend, layer, rows, repeats, seed, flush_bytes, threads);
        }
        py::list out;
        for (const auto& k : t) {
          py::dict d;
          d["op"] = k.op;
          d["seconds"] = k.seconds;
          d["flops"] = k.flops;
          d["weight_bytes"] = k.weight_bytes;
          d["paired_read_bytes_per_s"] = k.paired_read_bytes_per_s;
          d["paired_ratio"] = k.paired_ratio;
          out.append(d);
        }
        return out;
      },
      py::arg("path"), py::kw_only(), py::arg("layer"), py::arg("rows"), py::arg("repeats") = 5,
      py::arg("threads") = 0, py::arg("seed") = 0, py::arg("flush_bytes") = 0,
      "Times each kernel of one MoE layer call of `layer` on the CPU backend (median of "
      "`repeats`), every expert of the layer resident: [{op, seconds, flops, weight_bytes, "
      "paired_read_bytes_per_s, paired_ratio}]. flush_bytes > 0: a buffer that large is read "
      "before each timed expert pass, and before the plain read of what the pass reads that "
      "each expert pass is paired with.");

  m.def(
      "bench_read_bandwidth",
      [](std::uint64_t bytes, unsigned threads, std::uint32_t repeats) {
        if (bytes < 8 || bytes > (std::uint64_t(1) << 40))
          throw py::value_error("bytes must be 8..2^40");
        if (repeats == 0 || repeats > 100000) throw py::value_error("repeats must be 1..100000");
        if (threads > 1024) throw py::value_error("threads must be 0..1024");
        py::gil_scoped_release nogil;
        return read_bandwidth(bytes, threads, repeats);
      },
      py::arg("bytes"), py::kw_only(), py::arg("threads") = 0, py::arg("repeats") = 5,
      "The host's streaming read bandwidth (bytes/s) over a buffer of `bytes`, `threads` "
      "threads (0: every core), median of `repeats`.");

  // benchmarks/io_bandwidth.py --page-cache: the fair raw reference.
  m.def(
      "bench_raw_read",
      [](const std::string& path, std::uint64_t first, std::uint64_t count,
         std::uint64_t part_bytes, unsigned threads, std::uint64_t dest_bytes, bool direct,
         bool crc) {
        RawReadResult r;
        {
          py::gil_scoped_release nogil;
          r = raw_read_records(path, first, count, part_bytes, threads, dest_bytes, direct, crc);
        }
        py::dict d;
        d["seconds"] = r.seconds;
        d["bytes"] = r.bytes;
        return d;
      },
      py::arg("path"), py::arg("first"), py::arg("count"), py::arg("part_bytes"),
      py::arg("threads"), py::arg("dest_bytes"), py::arg("direct") = false,
      py::arg("crc") = false,
      "Threaded preads of records [first, first + count), split as ExpertStream splits them, "
      "into dest_bytes (0: two part-sized buffers a thread), each part's CRC32C with crc: "
      "{seconds, bytes}.");

  // Engine errors as strata_stream.errors, as in _core (csrc/python/errors.cpp).
  py::register_local_exception_translator(&strata::python::translate_engine_errors);
}
