// The pack file as the engine sees it: the fixed binary header (docs/pack-format.md) and an
// open file descriptor for part reads. The JSON metadata is for people and Python; the engine
// needs only the header, so it carries no JSON parser.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace strata {

constexpr std::uint64_t kPage = 16384;       // Apple SSD page; O_DIRECT-safe on Linux
constexpr std::uint64_t kDirectAlign = 4096;  // O_DIRECT length/offset granularity
constexpr std::uint32_t kHeaderBytes = 4096;
// Version 2: CRC32C record checksums (1 had zlib's CRC-32), the model block, expert biases and
// external routing.
constexpr std::uint32_t kPackVersion = 2;
// Version 3: the experts' formats differ by layer or matrix (mlx-lm's quantization predicates):
// format classes (a format per matrix) at kFormatsOffset and each layer's class, a nibble per
// layer, at kLayerClassOffset. Everything else is version 2's.
constexpr std::uint32_t kMixedPackVersion = 3;
constexpr std::uint32_t kFormatsOffset = 1040;
constexpr std::uint32_t kMaxFormatClasses = 16;
constexpr std::uint32_t kLayerClassOffset = 1632;
// Version 4: what the experts compute differs from versions 2 and 3 (an activation of kind 2 or
// more, or experts without a gate matrix). Its header is version 2's (n_classes 0 at
// kFormatsOffset) or version 3's (format classes) plus the layout flags at kLayoutFlagsOffset;
// a pack that uses none of it keeps its version 2 or 3 bytes.
constexpr std::uint32_t kFeaturePackVersion = 4;
constexpr std::uint32_t kLayoutFlagsOffset = 3680;
constexpr std::uint32_t kFlagGateless = 1;  // records hold up and down only (no gate matrix)
// Version 2's model block: activation u32, act_alpha f32, act_limit f32, bias_format u32.
constexpr std::uint32_t kModelBlockOffset = 1024;
// The routers' CRC-32 (u32), near the header's end; the header's own is the last u32.
constexpr std::uint32_t kRouterCrcOffset = 4088;
// The engine's limits, inside the format's u32 fields: every key fits the u32 smap index.
constexpr std::uint32_t kMaxLayers = 4096;
constexpr std::uint32_t kMaxExperts = 65536;

// Q4/Q8: MLX affine (w = s * q + b per group). Mxfp4: OCP microscaling FP4 as MLX stores it
// (gpt-oss checkpoints): E2M1 codes packed like Q4, one E8M0 scale per 32, no biases.
enum class WeightFormat : std::uint32_t { F32 = 0, F16 = 1, BF16 = 2, Q4 = 3, Q8 = 4, Mxfp4 = 5 };
// scale_format codes: 0 f32, 1 f16, 2 bf16 (affine), 3 e8m0 (a u8 exponent; Mxfp4 only).
constexpr std::uint32_t kScaleE8m0 = 3;
// External: the pack holds no routers; the model routes and calls Window::moe_routed.
enum class Routing : std::uint32_t { SoftmaxTopk = 0, TopkSoftmax = 1, External = 2 };
// SwiGLU: silu(g) * u. SwigluOai (gpt-oss): (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha g')
// with g' = min(g, limit). Version 4 only: SwigluClamp (deepseek_v4, hy_v4, glm5_next):
// silu(min(g, limit)) * clip(u, -limit, limit); GegluTanh (gemma4): gelu_tanh(g) * u;
// SwigluSoftcap (inkling2): cap(g, alpha) * sigmoid(g) * cap(u, limit) with
// cap(x, c) = tanh(x / c) * c; Relu2 (nemotron_h, gateless experts only): relu(u)^2.
enum class Activation : std::uint32_t {
  SwiGLU = 0,
  SwigluOai = 1,
  SwigluClamp = 2,
  GegluTanh = 3,
  SwigluSoftcap = 4,
  Relu2 = 5,
};
constexpr std::uint32_t kActivations = 6;
// The activation's name as the JSON metadata and every message say it ("swiglu", ...).
const char* activation_name(Activation a);

struct TensorEntry {
  std::uint32_t matrix;  // 0 gate, 1 up, 2 down
  std::uint32_t role;    // 0 weight, 1 scales, 2 biases
  std::uint64_t offset;  // inside the record
  std::uint64_t nbytes;
  std::uint32_t rows;
  std::uint32_t cols;
};

// Tensor roles: 0 weight, 1 scales, 2 biases (affine quantization), 3 bias (the Linear's own).
constexpr std::uint32_t kRoleBias = 3;

// How one matrix of a record is stored. group_size and scale_format are 0 for float formats.
struct MatrixFormat {
  WeightFormat format = WeightFormat::F32;
  std::uint32_t group_size = 0, scale_format = 0;
  bool operator==(const MatrixFormat&) const = default;
};
// A layer's formats: gate, up, down.
using LayerFormat = std::array<MatrixFormat, 3>;

struct PackLayout {
  std::uint32_t n_layers = 0, n_experts = 0, top_k = 0, hidden = 0, moe_intermediate = 0;
  Routing routing = Routing::SoftmaxTopk;
  bool norm_topk_prob = false;
  WeightFormat weight_format = WeightFormat::F32;
  std::uint32_t group_size = 0, scale_format = 0;  // scale_format: see kScaleE8m0
  Activation activation = Activation::SwiGLU;
  float act_alpha = 0, act_limit = 0;  // the activation's constants (0 where it has none)
  bool gated = true;  // false: the records hold no gate matrix (version 4's kFlagGateless)
  // 0: the experts have no Linear biases; else 1 + scale-format code (1 f32, 2 f16, 3 bf16).
  std::uint32_t bias_format = 0;
  std::uint64_t record_bytes = 0, record_stride = 0;
  std::uint64_t meta_offset = 0, meta_bytes = 0;
  std::uint64_t router_offset = 0, router_bytes = 0;
  std::uint64_t checksum_offset = 0, checksum_bytes = 0;
  std::uint64_t records_offset = 0, file_bytes = 0;
  // zlib CRC-32s of the JSON metadata and of the routers, as stored (checked by who reads them).
  std::uint32_t meta_crc = 0, router_crc = 0;
  std::vector<TensorEntry> tensors;  // class 0's table (every layer's, unless mixed())
  // Format classes (version 3; one, the pack format in every matrix, for version 2), each
  // one's tensor table, and each layer's class (empty unless mixed(): every layer is class 0).
  std::vector<LayerFormat> classes;
  std::vector<std::vector<TensorEntry>> class_tensors;
  std::vector<std::uint8_t> layer_class;

  bool mixed() const { return !layer_class.empty(); }
  // Whether the pack needs version 4: a new activation kind or gateless experts.
  bool extended() const { return std::uint32_t(activation) > 1 || !gated; }
  std::uint32_t version() const {
    return extended() ? kFeaturePackVersion : mixed() ? kMixedPackVersion : kPackVersion;
  }
  std::uint32_t class_of(std::uint32_t layer) const { return mixed() ? layer_class[layer] : 0; }
  const std::vector<TensorEntry>& tensors_of(std::uint32_t layer) const {
    return class_tensors[class_of(layer)];
  }
  const LayerFormat& formats_of(std::uint32_t layer) const { return classes[class_of(layer)]; }
  std::uint32_t n_keys() const { return n_layers * n_experts; }
  bool has_routers() const { return routing != Routing::External; }
  std::uint64_t record_offset(std::uint32_t key) const {
    return records_offset + std::uint64_t(key) * record_stride;
  }
};

// The weight-format-to-tensor-table rule, the engine's one statement of it (docs/pack-format.md):
// gate, up, down; each matrix's weight, then its scales (and biases, for affine q4/q8), then its
// own Linear bias when the pack has them, each at the previous end rounded up to kTensorAlign.
// Fills `out` for L's geometry and a layer's formats (already validated) and returns the
// record's bytes, the end of its last tensor. Throws std::overflow_error when a size overflows
// 64 bits.
constexpr std::uint64_t kTensorAlign = 256;
std::uint64_t canonical_tensors(const PackLayout& L, const LayerFormat& formats,
                                std::vector<TensorEntry>* out);

// Parses and validates the header of `path`. Throws EngineError(Pack) naming the file and the
// field on bad magic, version, crc, a file size that disagrees, or any field that differs from
// the canonical layout its geometry, format and meta_bytes imply (docs/pack-format.md), so a
// crafted header (with a valid crc) cannot put a tensor outside its record or a record outside
// the file. The one parser of the header: the Python reader calls it too (_core.read_layout).
PackLayout read_pack_layout(const std::string& path);

// Decodes and validates `n` header bytes already in memory. `where` begins every error ("pack
// <path>"). `file_bytes`, the size of the file they came from, must equal the header's
// file_bytes; nullopt checks the header alone.
PackLayout decode_pack_header(const unsigned char* header, std::size_t n, const std::string& where,
                              std::optional<std::uint64_t> file_bytes);

// decode_pack_header for the file `path` of `actual_file_bytes` bytes (the tests' entry).
PackLayout parse_pack_header(const unsigned char* header, std::size_t n, const std::string& path,
                             std::uint64_t actual_file_bytes);

// An open pack: RAII file descriptor, O_DIRECT when asked and allowed (falls back, and says why).
class PackFile {
 public:
  PackFile(const std::string& path, bool want_direct);
  ~PackFile();
  PackFile(const PackFile&) = delete;
  PackFile& operator=(const PackFile&) = delete;

  const std::string& path() const { return path_; }
  const PackLayout& layout() const { return layout_; }
  bool direct() const { return direct_; }
  const std::string& direct_note() const { return direct_note_; }

  // Reads exactly `len` bytes at `offset` into `dst` (retrying short reads and EINTR).
  // Returns 0, or an errno; `*got` is the bytes read before a failure or EOF (EOF -> EIO-free
  // short read reported as error code -1).
  int read_fully(std::uint64_t offset, void* dst, std::size_t len, std::size_t* got) const;

  // The stored CRC32C (pack/checksum.h) of every record, [n_layers * n_experts].
  const std::vector<std::uint32_t>& checksums() const { return checksums_; }

  // Reads a layer's router weights as float32 [n_experts, hidden].
  std::vector<float> read_router(std::uint32_t layer) const;
  // Every layer's, [n_layers][n_experts][hidden].
  std::vector<float> read_routers() const;

 private:
  std::string path_;
  PackLayout layout_;
  int fd_ = -1;
  bool direct_ = false;
  std::string direct_note_;
  std::vector<std::uint32_t> checksums_;
};

// zlib's CRC-32: the header, metadata and router checksums (record checksums are CRC32C).
std::uint32_t crc32_bytes(const void* data, std::size_t n);
// The header_crc a parser expects for these 4096 header bytes (covers bytes [0, 4092)).
std::uint32_t header_crc(const unsigned char* header);

}  // namespace strata
