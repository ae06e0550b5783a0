// The llama.cpp side of benchmarks/peers: one model, token ids in, timings and top-1 ids out,
// through libllama's public API alone (built by benchmarks/peers/llama_build.py).
//
//   llama_driver MODEL.gguf IDS.bin PROMPT DECODE THREADS mmap|repack|lazy|nommap OUT.json
//
// IDS.bin holds PROMPT + DECODE little-endian int32 token ids. The first PROMPT ids go in as one
// batch (the prompt, timed), then the next DECODE ids one at a time (teacher-forced decode: the
// same tokens route in every engine, whatever each one would have sampled), each timed. After
// every decoded id the argmax of the logits is recorded, so runs can be compared position by
// position. `mmap` is llama.cpp's mmap path with the CPU repack off (the page cache streams the
// weights: `--no-repack`), `repack` its default CPU path (weights repacked into its own buffers
// at load), `lazy` the mmap path reading the rows of the expert tensors on demand (its
// LLAMA_LAZY_MODE_ON: llama.cpp's own expert streaming), `nommap` reads the file into memory.
#include <llama.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int argmax(const float* logits, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

std::vector<llama_token> read_ids(const char* path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<llama_token> ids;
  int32_t v = 0;
  while (in.read(reinterpret_cast<char*>(&v), sizeof v)) ids.push_back(v);
  return ids;
}

// Bytes this process has caused to be read from storage (/proc/self/io read_bytes): mmap page
// faults and their read-ahead included, which is how llama.cpp's mmap path reads weights.
long long storage_read_bytes() {
  std::ifstream io("/proc/self/io");
  std::string key;
  long long value = -1;
  while (io >> key >> value) {
    if (key == "read_bytes:") return value;
  }
  return -1;
}

int fail(const char* what) {
  std::fprintf(stderr, "llama_driver: %s\n", what);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) return fail("usage: MODEL IDS PROMPT DECODE THREADS mmap|repack|lazy|nommap OUT");
  const int n_prompt = std::atoi(argv[3]);
  const int n_decode = std::atoi(argv[4]);
  const int threads = std::atoi(argv[5]);
  const std::string mode = argv[6];
  std::vector<llama_token> ids = read_ids(argv[2]);
  if (n_prompt < 1 || n_decode < 1 || static_cast<int>(ids.size()) < n_prompt + n_decode)
    return fail("IDS.bin holds fewer than PROMPT + DECODE ids");
  if (mode != "mmap" && mode != "repack" && mode != "lazy" && mode != "nommap")
    return fail("unknown mode");

  llama_backend_init();
  llama_log_set([](ggml_log_level level, const char* text, void*) {
    if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
  }, nullptr);
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  // repack keeps llama.cpp's defaults (load mode, extra buffer types: what llama-cli does).
  if (mode != "repack") {
    mp.load_mode = mode == "nommap" ? LLAMA_LOAD_MODE_NONE : LLAMA_LOAD_MODE_MMAP;
    mp.lazy_mode = mode == "lazy" ? LLAMA_LAZY_MODE_ON : LLAMA_LAZY_MODE_OFF;
    mp.use_extra_bufts = false;
  }
  const auto t_load = Clock::now();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) return fail("the model did not load");
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(n_prompt + n_decode + 8);
  cp.n_batch = static_cast<uint32_t>(n_prompt);
  cp.n_ubatch = static_cast<uint32_t>(n_prompt);
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  cp.no_perf = true;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) return fail("no context");
  const double load_s = seconds_since(t_load);
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  const auto t_prompt = Clock::now();
  if (llama_decode(ctx, llama_batch_get_one(ids.data(), n_prompt)) != 0)
    return fail("the prompt did not decode");
  const double prompt_s = seconds_since(t_prompt);
  std::vector<int> top1{argmax(llama_get_logits_ith(ctx, -1), n_vocab)};
  std::vector<double> step_s;
  const long long read_before = storage_read_bytes();
  for (int i = 0; i < n_decode; ++i) {
    const auto t0 = Clock::now();
    if (llama_decode(ctx, llama_batch_get_one(&ids[n_prompt + i], 1)) != 0)
      return fail("a decode step failed");
    top1.push_back(argmax(llama_get_logits_ith(ctx, -1), n_vocab));
    step_s.push_back(seconds_since(t0));
  }

  const long long decode_read = storage_read_bytes() - read_before;
  std::FILE* out = std::fopen(argv[7], "w");
  if (out == nullptr) return fail("cannot write OUT.json");
  std::fprintf(out,
               "{\"load_s\": %.6f, \"prompt_s\": %.6f, \"n_vocab\": %d, "
               "\"decode_read_bytes\": %lld, \"step_s\": [",
               load_s, prompt_s, n_vocab, decode_read);
  for (size_t i = 0; i < step_s.size(); ++i) std::fprintf(out, "%s%.6f", i ? ", " : "", step_s[i]);
  std::fprintf(out, "], \"top1\": [");
  for (size_t i = 0; i < top1.size(); ++i) std::fprintf(out, "%s%d", i ? ", " : "", top1[i]);
  std::fprintf(out, "]}\n");
  std::fclose(out);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
