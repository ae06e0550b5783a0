#include "pack/pack_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>

#include "common/errors.h"

namespace strata {
namespace {

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw EngineError(ErrorKind::Pack, "pack " + path + ": " + what);
}

template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // the format is little-endian, as are all our targets
  return v;
}

std::uint64_t element_bytes(std::uint32_t fmt) {
  switch (fmt) {
    case 0: return 4;
    case 1: case 2: return 2;
    default: return 0;
  }
}

}  // namespace

std::uint32_t crc32_bytes(const void* data, std::size_t n) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // zlib takes uInt lengths
    uInt chunk = n > (1u << 30) ? (1u << 30) : static_cast<uInt>(n);
    crc = crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

PackLayout parse_pack_header(const unsigned char* h, std::size_t n, const std::string& path,
                             std::uint64_t actual) {
  if (n < kHeaderBytes)
    bad(path, "file is " + std::to_string(actual) + " bytes, shorter than the " +
                  std::to_string(kHeaderBytes) + "-byte header (truncated?)");
  if (std::memcmp(h, "STRATAPK", 8) != 0) bad(path, "bad magic (expected STRATAPK)");
  std::uint32_t version = load<std::uint32_t>(h + 8);
  if (version != kPackVersion)
    bad(path, "version " + std::to_string(version) + " not supported (this reader knows " +
                  std::to_string(kPackVersion) + ")");
  if (load<std::uint32_t>(h + 12) != kHeaderBytes) bad(path, "header_bytes is not 4096");
  std::uint32_t stored_crc = load<std::uint32_t>(h + 4092);
  if (crc32_bytes(h, 4092) != stored_crc) bad(path, "header_crc mismatch (header corrupt)");

  PackLayout L;
  L.n_layers = load<std::uint32_t>(h + 16);
  L.n_experts = load<std::uint32_t>(h + 20);
  L.top_k = load<std::uint32_t>(h + 24);
  L.hidden = load<std::uint32_t>(h + 28);
  L.moe_intermediate = load<std::uint32_t>(h + 32);
  std::uint32_t routing = load<std::uint32_t>(h + 36);
  std::uint32_t norm = load<std::uint32_t>(h + 40);
  std::uint32_t fmt = load<std::uint32_t>(h + 44);
  L.group_size = load<std::uint32_t>(h + 48);
  L.scale_format = load<std::uint32_t>(h + 52);
  L.record_bytes = load<std::uint64_t>(h + 56);
  L.record_stride = load<std::uint64_t>(h + 64);
  L.meta_offset = load<std::uint64_t>(h + 72);
  L.meta_bytes = load<std::uint64_t>(h + 80);
  L.router_offset = load<std::uint64_t>(h + 88);
  L.router_bytes = load<std::uint64_t>(h + 96);
  L.checksum_offset = load<std::uint64_t>(h + 104);
  L.checksum_bytes = load<std::uint64_t>(h + 112);
  L.records_offset = load<std::uint64_t>(h + 120);
  L.file_bytes = load<std::uint64_t>(h + 128);
  std::uint32_t n_tensors = load<std::uint32_t>(h + 136);
  const std::uint32_t activation = load<std::uint32_t>(h + kModelBlockOffset);
  L.act_alpha = load<float>(h + kModelBlockOffset + 4);
  L.act_limit = load<float>(h + kModelBlockOffset + 8);
  L.bias_format = load<std::uint32_t>(h + kModelBlockOffset + 12);

  if (L.n_layers == 0 || L.n_layers > 4096) bad(path, "field n_layers out of range");
  if (L.n_experts == 0 || L.n_experts > 65536) bad(path, "field n_experts out of range");
  if (L.top_k == 0 || L.top_k > L.n_experts) bad(path, "field top_k out of range");
  if (L.hidden == 0 || L.moe_intermediate == 0) bad(path, "field hidden/moe_intermediate is 0");
  if (routing > 2) bad(path, "field routing " + std::to_string(routing) + " unknown");
  if (activation > 1) bad(path, "field activation " + std::to_string(activation) + " unknown");
  if (L.bias_format > 3) bad(path, "field bias_format " + std::to_string(L.bias_format) + " unknown");
  L.activation = static_cast<Activation>(activation);
  if (L.activation == Activation::SwigluOai &&
      !(L.act_alpha > 0 && L.act_limit > 0 && std::isfinite(L.act_alpha) &&
        std::isfinite(L.act_limit)))
    bad(path, "fields act_alpha/act_limit must be finite and positive for swiglu_oai");
  if (norm > 1) bad(path, "field norm_topk_prob must be 0 or 1");
  if (fmt > 4) bad(path, "field weight_format " + std::to_string(fmt) + " unknown");
  L.routing = static_cast<Routing>(routing);
  L.norm_topk_prob = norm == 1;
  L.weight_format = static_cast<WeightFormat>(fmt);
  bool quant = fmt >= 3;
  if (quant && L.group_size != 32 && L.group_size != 64 && L.group_size != 128)
    bad(path, "field group_size " + std::to_string(L.group_size) + " (expected 32, 64, 128)");
  if (quant && L.scale_format > 2) bad(path, "field scale_format unknown");
  const std::uint32_t per_matrix = (quant ? 3u : 1u) + (L.bias_format ? 1u : 0u);
  if (n_tensors != 3 * per_matrix) bad(path, "field n_tensors " + std::to_string(n_tensors));
  if (L.record_stride == 0 || L.record_stride % kPage || L.record_stride < L.record_bytes ||
      L.record_stride - L.record_bytes >= kPage)
    bad(path, "field record_stride " + std::to_string(L.record_stride) +
                  " is not record_bytes rounded up to 16384");
  std::uint64_t keys = std::uint64_t(L.n_layers) * L.n_experts;
  if (L.router_bytes != (L.has_routers() ? keys * L.hidden * 4 : 0))
    bad(path, "field router_bytes disagrees");
  if (L.checksum_bytes != keys * 4) bad(path, "field checksum_bytes disagrees");
  if (L.records_offset % kPage || L.router_offset % kPage || L.checksum_offset % kPage)
    bad(path, "section offsets not 16 KiB aligned");
  if (L.meta_offset != kHeaderBytes || L.meta_offset + L.meta_bytes > L.router_offset ||
      L.router_offset + L.router_bytes > L.checksum_offset ||
      L.checksum_offset + L.checksum_bytes > L.records_offset)
    bad(path, "section offsets overlap or are out of order");
  if (L.file_bytes != L.records_offset + keys * L.record_stride)
    bad(path, "field file_bytes disagrees with records_offset + records * record_stride");
  if (actual != L.file_bytes)
    bad(path, "file is " + std::to_string(actual) + " bytes but header field file_bytes says " +
                  std::to_string(L.file_bytes) + (actual < L.file_bytes ? " (truncated?)" : ""));

  // Tensor table: ordered, 256-aligned, within record_bytes, sizes matching the shapes.
  std::uint64_t end = 0;
  for (std::uint32_t i = 0; i < n_tensors; ++i) {
    const unsigned char* t = h + 144 + 32 * i;
    TensorEntry e{load<std::uint32_t>(t), load<std::uint32_t>(t + 4), load<std::uint64_t>(t + 8),
                  load<std::uint64_t>(t + 16), load<std::uint32_t>(t + 24),
                  load<std::uint32_t>(t + 28)};
    const std::uint32_t want_matrix = i / per_matrix, pos = i % per_matrix;
    const std::uint32_t want_role = L.bias_format && pos == per_matrix - 1 ? kRoleBias : pos;
    std::string name = "tensor " + std::to_string(i);
    if (e.matrix != want_matrix || e.role != want_role) bad(path, name + " out of order");
    if (e.offset % 256 || e.offset < end) bad(path, name + " offset misaligned or overlapping");
    std::uint32_t rows = e.matrix == 2 ? L.hidden : L.moe_intermediate;
    std::uint32_t cols = e.matrix == 2 ? L.moe_intermediate : L.hidden;
    std::uint64_t want_cols, eb;
    if (e.role == kRoleBias) {  // [1, rows]
      want_cols = rows;
      rows = 1;
      eb = element_bytes(L.bias_format - 1);
    } else if (!quant) {
      want_cols = cols;
      eb = element_bytes(fmt);
    } else if (e.role == 0) {
      want_cols = std::uint64_t(cols) * (fmt == 3 ? 4 : 8) / 32;
      eb = 4;
    } else {
      want_cols = cols / L.group_size;
      eb = element_bytes(L.scale_format);
    }
    if (e.rows != rows || e.cols != want_cols || e.nbytes != rows * want_cols * eb)
      bad(path, name + " shape or size disagrees with the geometry");
    end = e.offset + e.nbytes;
    L.tensors.push_back(e);
  }
  if (end > L.record_bytes) bad(path, "tensors extend past record_bytes");
  return L;
}

PackLayout read_pack_layout(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw EngineError(ErrorKind::Pack, "pack " + path + ": cannot open: " +
                                                     std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  unsigned char header[kHeaderBytes] = {};
  ssize_t got = ::pread(fd, header, kHeaderBytes, 0);
  ::close(fd);
  return parse_pack_header(header, got < 0 ? 0 : std::size_t(got), path,
                           std::uint64_t(st.st_size));
}

PackFile::PackFile(const std::string& path, bool want_direct) : path_(path) {
  layout_ = read_pack_layout(path);
  int flags = O_RDONLY | O_CLOEXEC;
#ifdef O_DIRECT
  if (want_direct) {
    fd_ = ::open(path.c_str(), flags | O_DIRECT);
    if (fd_ >= 0) {
      // Some file systems accept O_DIRECT at open and reject it at read time: probe once.
      void* probe = nullptr;
      if (posix_memalign(&probe, kPage, kDirectAlign) == 0) {
        ssize_t r = ::pread(fd_, probe, kDirectAlign, 0);
        std::free(probe);
        if (r == ssize_t(kDirectAlign)) {
          direct_ = true;
        } else {
          direct_note_ = std::string("O_DIRECT read failed (") + std::strerror(errno) +
                         "); using buffered reads";
          ::close(fd_);
          fd_ = -1;
        }
      }
    } else {
      direct_note_ = std::string("O_DIRECT not allowed here (") + std::strerror(errno) +
                     "); using buffered reads";
    }
  }
#endif
  if (fd_ < 0) {
    fd_ = ::open(path.c_str(), flags);
    if (fd_ < 0)
      throw EngineError(ErrorKind::Pack, "pack " + path + ": cannot open: " +
                                             std::strerror(errno));
#ifdef __APPLE__
    if (want_direct) {
      // F_NOCACHE is macOS's way to keep expert reads out of the unified buffer cache.
      if (::fcntl(fd_, F_NOCACHE, 1) == 0) direct_ = true;
    }
#endif
  }
  if (!want_direct) direct_note_ = "buffered reads (direct_io off)";

  checksums_.resize(layout_.n_keys());
  std::size_t got = 0;
  // The checksum table is small; read it buffered-style into an aligned bounce buffer.
  std::uint64_t span = (layout_.checksum_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  void* buf = nullptr;
  if (posix_memalign(&buf, kPage, span) != 0) throw std::bad_alloc();
  std::unique_ptr<void, void (*)(void*)> hold(buf, std::free);
  int err = read_fully(layout_.checksum_offset, buf, span, &got);
  if (err != 0 || got < layout_.checksum_bytes)
    throw EngineError(ErrorKind::Pack, "pack " + path + ": cannot read the checksum table");
  std::memcpy(checksums_.data(), buf, layout_.checksum_bytes);
}

PackFile::~PackFile() {
  if (fd_ >= 0) ::close(fd_);
}

int PackFile::read_fully(std::uint64_t offset, void* dst, std::size_t len,
                         std::size_t* got) const {
  auto* p = static_cast<unsigned char*>(dst);
  std::size_t done = 0;
  while (done < len) {
    ssize_t r = ::pread(fd_, p + done, len - done, off_t(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      *got = done;
      return errno;
    }
    if (r == 0) break;  // EOF: a short read
    done += std::size_t(r);
  }
  *got = done;
  return done == len ? 0 : -1;
}

std::vector<float> PackFile::read_router(std::uint32_t layer) const {
  std::uint64_t per = std::uint64_t(layout_.n_experts) * layout_.hidden * 4;
  std::uint64_t off = layout_.router_offset + layer * per;
  // Aligned bounce: the fd may be O_DIRECT.
  std::uint64_t start = off / kDirectAlign * kDirectAlign;
  std::uint64_t span = (off + per - start + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  void* buf = nullptr;
  if (posix_memalign(&buf, kPage, span) != 0) throw std::bad_alloc();
  std::unique_ptr<void, void (*)(void*)> hold(buf, std::free);
  std::size_t got = 0;
  read_fully(start, buf, span, &got);
  if (got < off - start + per)
    throw EngineError(ErrorKind::Pack, "pack " + path_ + ": cannot read router of layer " +
                                           std::to_string(layer));
  std::vector<float> out(per / 4);
  std::memcpy(out.data(), static_cast<unsigned char*>(buf) + (off - start), per);
  return out;
}

std::vector<float> PackFile::read_routers() const {
  std::vector<float> all;
  if (!layout_.has_routers()) return all;
  all.reserve(std::size_t(layout_.n_layers) * layout_.n_experts * layout_.hidden);
  for (std::uint32_t l = 0; l < layout_.n_layers; ++l) {
    std::vector<float> r = read_router(l);
    all.insert(all.end(), r.begin(), r.end());
  }
  return all;
}

}  // namespace strata
