#include "pack/pack_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <utility>
#include <sstream>

#include "common/errors.h"

namespace strata {
namespace {

// `where` names the pack ("pack <path>"): every error begins with it.
[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw EngineError(ErrorKind::Pack, where + ": " + what);
}

template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);  // the format is little-endian, as are all our targets
  return v;
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

std::uint32_t header_crc(const unsigned char* header) { return crc32_bytes(header, 4092); }

namespace {

// The canonical layout (docs/pack-format.md, "Canonical layout") is a function of the
// geometry, the format and meta_bytes. Every field can be anything in a crafted file, so each
// step is checked for 64-bit overflow: a wrapped sum would let an absurd offset pass a
// comparison against record_bytes or the file size.
class LayoutMath {
 public:
  explicit LayoutMath(const std::string& where) : where_(where) {}
  std::uint64_t add(std::uint64_t a, std::uint64_t b, const char* field) const {
    std::uint64_t r;
    if (__builtin_add_overflow(a, b, &r)) overflow(field);
    return r;
  }
  std::uint64_t mul(std::uint64_t a, std::uint64_t b, const char* field) const {
    std::uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) overflow(field);
    return r;
  }
  std::uint64_t align(std::uint64_t v, std::uint64_t a, const char* field) const {
    return add(v, a - 1, field) / a * a;
  }

 private:
  [[noreturn]] void overflow(const char* field) const {
    bad(where_, std::string("header field ") + field +
                   ": the layout the geometry and format imply overflows 64 bits");
  }
  const std::string& where_;
};

std::string field_value(const char* name, std::uint64_t value) {
  return std::string("header field ") + name + " is " + std::to_string(value);
}

// weight_format codes' names, as docs/pack-format.md and the Python writer spell them.
const char* const kFormatNames[] = {"f32", "f16", "bf16", "q4", "q8", "mxfp4"};

// Element bytes of a stored float dtype (weight_format 0..2, scale_format 0..2).
std::uint64_t float_bytes(std::uint32_t fmt) { return fmt == 0 ? 4 : 2; }

// One matrix format, checked against the geometry: the pack's own fields (`where` empty) or a
// version 3 format class's ("format class C gate: ").
// The widths a matrix's groups run along (its input width): gate and up read hidden, down reads
// moe_intermediate; a format for every matrix must divide both.
enum class Widths { GateUp, Down, All };

MatrixFormat checked_format(const std::string& pack, const std::string& where, std::uint32_t fmt,
                            std::uint32_t group, std::uint32_t scale, const PackLayout& L,
                            Widths widths = Widths::All) {
  if (fmt > 5)
    bad(pack, where + field_value("weight_format", fmt) +
                  " (known: 0 f32, 1 f16, 2 bf16, 3 q4, 4 q8, 5 mxfp4)");
  if (scale > kScaleE8m0)
    bad(pack, where + field_value("scale_format", scale) +
                  " (known: 0 f32, 1 f16, 2 bf16, 3 e8m0)");
  const bool quant = fmt >= 3, mxfp4 = fmt == std::uint32_t(WeightFormat::Mxfp4);
  if (!quant && (group != 0 || scale != 0))
    bad(pack, where + "header fields group_size " + std::to_string(group) + " and scale_format " +
                  std::to_string(scale) + " must be 0 for weight_format " + kFormatNames[fmt]);
  if (mxfp4 && (group != 32 || scale != kScaleE8m0))
    bad(pack, where + "header fields group_size " + std::to_string(group) + " and scale_format " +
                  std::to_string(scale) + " must be 32 and 3 (e8m0) for mxfp4");
  if (quant && !mxfp4 && scale == kScaleE8m0)
    bad(pack, where + "header field scale_format 3 (e8m0) is for mxfp4 only, not affine q4/q8");
  if (quant) {
    if (group != 32 && group != 64 && group != 128)
      bad(pack, where + field_value("group_size", group) + " (expected 32, 64 or 128)");
    if (widths != Widths::Down && L.hidden % group)
      bad(pack, where + field_value("hidden", L.hidden) + ", not a multiple of group_size " +
                    std::to_string(group));
    if (widths != Widths::GateUp && L.moe_intermediate % group)
      bad(pack, where + field_value("moe_intermediate", L.moe_intermediate) +
                    ", not a multiple of group_size " + std::to_string(group));
  }
  return MatrixFormat{static_cast<WeightFormat>(fmt), group, scale};
}

// Version 3's format classes and each layer's class, into L (its geometry already checked).
// The writer's canonical form: classes in order of first use, all used, class 0's gate the
// pack format, and not one uniform class (that is a version 2 pack).
void read_format_classes(const std::string& pack, const unsigned char* h,
                         const MatrixFormat& pack_format, PackLayout* L) {
  static const char* const kMatrix[] = {"gate", "up", "down"};
  const std::uint32_t n_classes = load<std::uint32_t>(h + kFormatsOffset);
  if (n_classes == 0 || n_classes > kMaxFormatClasses)
    bad(pack, field_value("n_classes", n_classes) + " (expected 1..16)");
  for (std::uint32_t c = 0; c < n_classes; ++c) {
    LayerFormat formats;
    for (std::uint32_t mat = 0; mat < 3; ++mat) {
      const unsigned char* p = h + kFormatsOffset + 4 + (c * 3 + mat) * 12;
      const std::string where =
          "format class " + std::to_string(c) + " " + kMatrix[mat] + ": ";
      formats[mat] = checked_format(pack, where, load<std::uint32_t>(p),
                                    load<std::uint32_t>(p + 4), load<std::uint32_t>(p + 8), *L,
                                    mat == 2 ? Widths::Down : Widths::GateUp);
    }
    L->classes.push_back(formats);
  }
  std::uint32_t next = 0;  // the first class not yet used
  for (std::uint32_t layer = 0; layer < L->n_layers; ++layer) {
    const std::uint32_t c = (h[kLayerClassOffset + layer / 2] >> (4 * (layer % 2))) & 15u;
    if (c > next || c >= n_classes)
      bad(pack, "layer " + std::to_string(layer) + " is of format class " + std::to_string(c) +
                    " (classes are numbered in order of first use, " + std::to_string(n_classes) +
                    " of them)");
    if (c == next) ++next;
    L->layer_class.push_back(std::uint8_t(c));
  }
  const LayerFormat& first = L->classes[0];
  if (next != n_classes) bad(pack, "format class " + std::to_string(next) + " is never used");
  if (!(first[0] == pack_format))
    bad(pack, "format class 0's gate differs from the header's weight_format/group_size/"
              "scale_format");
  if (n_classes == 1 && first[1] == first[0] && first[2] == first[0])
    bad(pack, "format classes in a header whose experts share one format (n_classes is 0 for "
              "them: version 2, or version 4 without classes)");
}

}  // namespace

std::uint64_t canonical_tensors(const PackLayout& L, const LayerFormat& formats,
                                std::vector<TensorEntry>* out) {
  auto add = [](std::uint64_t a, std::uint64_t b) {
    std::uint64_t r;
    if (__builtin_add_overflow(a, b, &r)) throw std::overflow_error("record_bytes");
    return r;
  };
  auto mul = [](std::uint64_t a, std::uint64_t b) {
    std::uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) throw std::overflow_error("record_bytes");
    return r;
  };
  out->clear();
  std::uint64_t at = 0;
  auto tensor = [&](std::uint32_t matrix, std::uint32_t role, std::uint32_t rows,
                    std::uint64_t cols, std::uint64_t elem) {
    at = add(at, kTensorAlign - 1) / kTensorAlign * kTensorAlign;
    const std::uint64_t nbytes = mul(mul(rows, cols), elem);
    // cols is at most a u32 (a quantized row has fewer words than elements).
    out->push_back(TensorEntry{matrix, role, at, nbytes, rows, std::uint32_t(cols)});
    at = add(at, nbytes);
  };
  // Gateless experts (version 4) store up and down only.
  for (std::uint32_t mat = L.gated ? 0 : 1; mat < 3; ++mat) {
    const std::uint32_t rows = mat == 2 ? L.hidden : L.moe_intermediate;
    const std::uint32_t cols = mat == 2 ? L.moe_intermediate : L.hidden;
    const MatrixFormat& f = formats[mat];
    const std::uint32_t fmt = static_cast<std::uint32_t>(f.format);
    if (fmt < 3) {
      tensor(mat, 0, rows, cols, float_bytes(fmt));
    } else if (f.format == WeightFormat::Mxfp4) {  // codes, then a u8 exponent a group
      tensor(mat, 0, rows, std::uint64_t(cols) * 4 / 32, 4);
      tensor(mat, 1, rows, cols / f.group_size, 1);
    } else {
      const std::uint64_t bits = f.format == WeightFormat::Q4 ? 4 : 8;
      tensor(mat, 0, rows, std::uint64_t(cols) * bits / 32, 4);  // cols % 32 == 0 (group_size)
      tensor(mat, 1, rows, cols / f.group_size, float_bytes(f.scale_format));
      tensor(mat, 2, rows, cols / f.group_size, float_bytes(f.scale_format));
    }
    // The expert's own Linear bias [1, rows] (gpt-oss), after the weight's tensors.
    if (L.bias_format) tensor(mat, kRoleBias, 1, rows, float_bytes(L.bias_format - 1));
  }
  return at;
}

namespace {

// A Python bytes literal of what the file starts with (b'hello'), as the user's tools show it.
std::string bytes_literal(const unsigned char* p, std::size_t n) {
  const bool dq = std::memchr(p, '\'', n) && !std::memchr(p, '"', n);
  const char quote = dq ? '"' : '\'';
  std::string s = "b";
  s += quote;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char c = p[i];
    if (c == '\\' || c == quote) {
      s += '\\';
      s += char(c);
    } else if (c == '\t' || c == '\n' || c == '\r') {
      s += c == '\t' ? "\\t" : c == '\n' ? "\\n" : "\\r";
    } else if (c < 0x20 || c >= 0x7f) {
      static const char* const kHex = "0123456789abcdef";
      s += "\\x";
      s += kHex[c >> 4];
      s += kHex[c & 15];
    } else {
      s += char(c);
    }
  }
  return s + quote;
}

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// Magic, length, version, crc and header_bytes: what must hold before any field means anything.
// A wrong file is likelier than a truncated one, so a magic that differs is said first. Returns
// the version.
std::uint32_t check_preamble(const unsigned char* h, std::size_t n, const std::string& where,
                             std::uint64_t size) {
  static const unsigned char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'P', 'K'};
  const std::size_t head = std::min<std::size_t>(n, 8);
  if (head > 0 && std::memcmp(h, kMagic, head) != 0)
    bad(where, "bad magic " + bytes_literal(h, head) + " (expected b'STRATAPK')");
  if (n < kHeaderBytes)
    bad(where, "file is " + std::to_string(size) + " bytes, shorter than the " +
                   std::to_string(kHeaderBytes) + "-byte header (truncated?)");
  const std::uint32_t version = load<std::uint32_t>(h + 8);
  if (version == 1)
    bad(where, "format version 1 is no longer read (version 2 checksums records with CRC32C); "
               "repack with strata-stream pack/convert");
  if (version != kPackVersion && version != kMixedPackVersion && version != kFeaturePackVersion)
    bad(where, "version " + std::to_string(version) + " not supported (this reader knows " +
                   std::to_string(kPackVersion) + ", " + std::to_string(kMixedPackVersion) +
                   " and " + std::to_string(kFeaturePackVersion) + ")" +
                   (version > kFeaturePackVersion
                        ? " (written by a newer strata-stream: upgrade to read it)"
                        : ""));
  const std::uint32_t stored = load<std::uint32_t>(h + 4092), computed = header_crc(h);
  if (stored != computed)
    bad(where, "header_crc mismatch (stored " + hex32(stored) + ", computed " + hex32(computed) +
                   ")");
  if (load<std::uint32_t>(h + 12) != kHeaderBytes)
    bad(where, field_value("header_bytes", load<std::uint32_t>(h + 12)) + " (expected 4096)");
  return version;
}

// The fields stored as codes, checked before they are converted into the layout's enums.
struct HeaderCodes {
  std::uint32_t routing, norm, fmt, activation, n_tensors;
};

// Every fixed field into L, as stored; the codes beside it.
HeaderCodes load_fields(const unsigned char* h, PackLayout* L) {
  L->n_layers = load<std::uint32_t>(h + 16);
  L->n_experts = load<std::uint32_t>(h + 20);
  L->top_k = load<std::uint32_t>(h + 24);
  L->hidden = load<std::uint32_t>(h + 28);
  L->moe_intermediate = load<std::uint32_t>(h + 32);
  L->group_size = load<std::uint32_t>(h + 48);
  L->scale_format = load<std::uint32_t>(h + 52);
  L->record_bytes = load<std::uint64_t>(h + 56);
  L->record_stride = load<std::uint64_t>(h + 64);
  L->meta_offset = load<std::uint64_t>(h + 72);
  L->meta_bytes = load<std::uint64_t>(h + 80);
  L->router_offset = load<std::uint64_t>(h + 88);
  L->router_bytes = load<std::uint64_t>(h + 96);
  L->checksum_offset = load<std::uint64_t>(h + 104);
  L->checksum_bytes = load<std::uint64_t>(h + 112);
  L->records_offset = load<std::uint64_t>(h + 120);
  L->file_bytes = load<std::uint64_t>(h + 128);
  L->meta_crc = load<std::uint32_t>(h + 140);
  L->router_crc = load<std::uint32_t>(h + kRouterCrcOffset);
  L->act_alpha = load<float>(h + kModelBlockOffset + 4);
  L->act_limit = load<float>(h + kModelBlockOffset + 8);
  L->bias_format = load<std::uint32_t>(h + kModelBlockOffset + 12);
  return HeaderCodes{load<std::uint32_t>(h + 36), load<std::uint32_t>(h + 40),
                     load<std::uint32_t>(h + 44), load<std::uint32_t>(h + kModelBlockOffset),
                     load<std::uint32_t>(h + 136)};
}

// The activation's constants: each kind's own finite positive ones, and for version 4's kinds
// zero where it has none (one canonical header per kind; versions 2 and 3 never checked that of
// swiglu, so it is not checked now); relu2 is the gateless experts' and only theirs.
void check_activation(const std::string& where, const PackLayout* L) {
  const Activation a = L->activation;
  const bool alpha = a == Activation::SwigluOai || a == Activation::SwigluSoftcap;
  const bool limit = alpha || a == Activation::SwigluClamp;
  const bool v4 = std::uint32_t(a) > 1;
  const std::string name = activation_name(a);
  auto positive = [](float v) { return v > 0 && std::isfinite(v); };
  if (alpha && !(positive(L->act_alpha) && positive(L->act_limit)))
    bad(where, "header fields act_alpha/act_limit must be finite and positive for " + name);
  if (limit && !positive(L->act_limit))
    bad(where, "header field act_limit must be finite and positive for " + name);
  if (v4 && !alpha && L->act_alpha != 0)
    bad(where, "header field act_alpha must be 0 for " + name);
  if (v4 && !limit && L->act_limit != 0)
    bad(where, "header field act_limit must be 0 for " + name);
  if ((a == Activation::Relu2) == L->gated)
    bad(where, L->gated ? "activation relu2 is for gateless experts (layout flag 1)"
                        : "gateless experts (layout flag 1) compute relu2 only, not " + name);
}

// The geometry and the model block. The engine's own limits (keys fit a u32 smap index) are
// tighter than the format's u32 fields.
void check_geometry(const std::string& where, const HeaderCodes& c, PackLayout* L) {
  if (L->n_layers == 0 || L->n_layers > kMaxLayers)
    bad(where, field_value("n_layers", L->n_layers) + " (expected 1.." +
                   std::to_string(kMaxLayers) + ")");
  if (L->n_experts == 0 || L->n_experts > kMaxExperts)
    bad(where, field_value("n_experts", L->n_experts) + " (expected 1.." +
                   std::to_string(kMaxExperts) + ")");
  if (L->top_k == 0 || L->top_k > L->n_experts)
    bad(where, field_value("top_k", L->top_k) + " (expected 1..n_experts " +
                   std::to_string(L->n_experts) + ")");
  if (L->hidden == 0) bad(where, field_value("hidden", 0) + " (expected >= 1)");
  if (L->moe_intermediate == 0)
    bad(where, field_value("moe_intermediate", 0) + " (expected >= 1)");
  if (c.routing > 2)
    bad(where, field_value("routing", c.routing) +
                   " (known: 0 softmax_topk, 1 topk_softmax, 2 external)");
  if (c.activation >= kActivations)
    bad(where, field_value("activation", c.activation) +
                   " (known: 0 swiglu, 1 swiglu_oai, 2 swiglu_clamp, 3 geglu_tanh, "
                   "4 swiglu_softcap, 5 relu2)");
  if (L->bias_format > 3)
    bad(where,
        field_value("bias_format", L->bias_format) + " (known: 0 none, 1 f32, 2 f16, 3 bf16)");
  L->activation = static_cast<Activation>(c.activation);
  check_activation(where, L);
  if (c.norm > 1) bad(where, field_value("norm_topk_prob", c.norm) + " (expected 0 or 1)");
  L->routing = static_cast<Routing>(c.routing);
  L->norm_topk_prob = c.norm == 1;
}

// Each format class's canonical tensor table into L, and the record_bytes they imply: the
// largest class's (every record takes its room).
std::uint64_t derive_tensor_tables(const std::string& where, PackLayout* L) {
  std::uint64_t record_bytes = 0;
  for (const LayerFormat& formats : L->classes) {
    std::vector<TensorEntry> table;
    try {
      record_bytes = std::max(record_bytes, canonical_tensors(*L, formats, &table));
    } catch (const std::overflow_error&) {
      bad(where, "header field record_bytes: the layout the geometry and format imply overflows "
                 "64 bits");
    }
    L->class_tensors.push_back(std::move(table));
  }
  return record_bytes;
}

// The sections' offsets and sizes the geometry, the formats and meta_bytes imply, each against
// the stored field.
void check_derived_fields(const std::string& where, std::uint32_t n_tensors, PackLayout* L) {
  const std::uint64_t record_bytes = derive_tensor_tables(where, L);
  const LayoutMath m(where);
  const std::uint64_t keys = std::uint64_t(L->n_layers) * L->n_experts;  // <= 2^28
  const std::uint64_t stride = m.align(record_bytes, kPage, "record_stride");
  const std::uint64_t router_offset =
      m.align(m.add(kHeaderBytes, L->meta_bytes, "meta_bytes"), kPage, "meta_bytes");
  // An externally routed pack (the model's own gates route) carries no routers.
  const std::uint64_t router_bytes =
      L->has_routers() ? m.mul(m.mul(keys, L->hidden, "router_bytes"), 4, "router_bytes") : 0;
  const std::uint64_t checksum_offset =
      m.align(m.add(router_offset, router_bytes, "checksum_offset"), kPage, "checksum_offset");
  const std::uint64_t checksum_bytes = keys * 4;
  const std::uint64_t records_offset =
      m.align(m.add(checksum_offset, checksum_bytes, "records_offset"), kPage, "records_offset");
  const std::uint64_t file_bytes =
      m.add(records_offset, m.mul(keys, stride, "file_bytes"), "file_bytes");
  const std::pair<const char*, std::pair<std::uint64_t, std::uint64_t>> derived[] = {
      {"record_bytes", {L->record_bytes, record_bytes}},
      {"record_stride", {L->record_stride, stride}},
      {"meta_offset", {L->meta_offset, kHeaderBytes}},
      {"router_offset", {L->router_offset, router_offset}},
      {"router_bytes", {L->router_bytes, router_bytes}},
      {"checksum_offset", {L->checksum_offset, checksum_offset}},
      {"checksum_bytes", {L->checksum_bytes, checksum_bytes}},
      {"records_offset", {L->records_offset, records_offset}},
      {"file_bytes", {L->file_bytes, file_bytes}},
      {"n_tensors", {n_tensors, L->class_tensors[0].size()}},
  };
  for (const auto& [name, v] : derived)
    if (v.first != v.second)
      bad(where, field_value(name, v.first) + " but the geometry and format imply " +
                     std::to_string(v.second));
}

// The stored tensor table (class 0's), entry by entry against the canonical one, into L.
void check_tensor_table(const std::string& where, const unsigned char* h, PackLayout* L) {
  static const char* const kTensorFields[] = {"matrix", "role", "offset", "nbytes", "rows", "cols"};
  const std::vector<TensorEntry>& want = L->class_tensors[0];
  for (std::size_t i = 0; i < want.size(); ++i) {
    const unsigned char* t = h + 144 + 32 * i;
    const TensorEntry e{load<std::uint32_t>(t), load<std::uint32_t>(t + 4),
                        load<std::uint64_t>(t + 8), load<std::uint64_t>(t + 16),
                        load<std::uint32_t>(t + 24), load<std::uint32_t>(t + 28)};
    const TensorEntry& w = want[i];
    const std::uint64_t got[] = {e.matrix, e.role, e.offset, e.nbytes, e.rows, e.cols};
    const std::uint64_t exp[] = {w.matrix, w.role, w.offset, w.nbytes, w.rows, w.cols};
    for (int f = 0; f < 6; ++f)
      if (got[f] != exp[f])
        bad(where, "tensor table entry " + std::to_string(i) + " field " + kTensorFields[f] +
                       " is " + std::to_string(got[f]) + " but the geometry and format imply " +
                       std::to_string(exp[f]));
    L->tensors.push_back(e);
  }
}

}  // namespace

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::SwiGLU: return "swiglu";
    case Activation::SwigluOai: return "swiglu_oai";
    case Activation::SwigluClamp: return "swiglu_clamp";
    case Activation::GegluTanh: return "geglu_tanh";
    case Activation::SwigluSoftcap: return "swiglu_softcap";
    case Activation::Relu2: return "relu2";
  }
  return "unknown";
}

PackLayout decode_pack_header(const unsigned char* h, std::size_t n, const std::string& where,
                              std::optional<std::uint64_t> file_bytes) {
  const std::uint32_t version = check_preamble(h, n, where, file_bytes.value_or(n));
  PackLayout L;
  const HeaderCodes codes = load_fields(h, &L);
  // Version 4's layout flags; before it the bytes are unused (zero).
  const std::uint32_t flags = load<std::uint32_t>(h + kLayoutFlagsOffset);
  if (version == kFeaturePackVersion && (flags & ~kFlagGateless))
    bad(where, field_value("layout flags", flags) + " (known: 1 gateless)");
  L.gated = version != kFeaturePackVersion || !(flags & kFlagGateless);
  check_geometry(where, codes, &L);
  if (version < kFeaturePackVersion && L.extended())
    bad(where, std::string("activation ") + activation_name(L.activation) +
                   " needs format version 4 (the header says " + std::to_string(version) + ")");
  if (version == kFeaturePackVersion && !L.extended())
    bad(where, "version 4 header whose experts are gated swiglu or swiglu_oai (version 2 or 3)");
  const bool has_classes =
      version == kMixedPackVersion ||
      (version == kFeaturePackVersion && load<std::uint32_t>(h + kFormatsOffset) != 0);
  // With classes the pack format is class 0's gate: only its own width applies.
  const MatrixFormat pack_format = checked_format(where, "", codes.fmt, L.group_size,
                                                  L.scale_format, L,
                                                  has_classes ? Widths::GateUp : Widths::All);
  L.weight_format = pack_format.format;
  if (has_classes)
    read_format_classes(where, h, pack_format, &L);
  else
    L.classes.assign(1, LayerFormat{pack_format, pack_format, pack_format});
  check_derived_fields(where, codes.n_tensors, &L);
  check_tensor_table(where, h, &L);
  if (file_bytes && *file_bytes != L.file_bytes)
    bad(where, "file is " + std::to_string(*file_bytes) +
                   " bytes but header field file_bytes says " + std::to_string(L.file_bytes) +
                   (*file_bytes < L.file_bytes ? " (truncated?)" : " (trailing data?)"));
  return L;
}

PackLayout parse_pack_header(const unsigned char* h, std::size_t n, const std::string& path,
                             std::uint64_t actual) {
  return decode_pack_header(h, n, "pack " + path, actual);
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
