// The llama.cpp side of the peer comparison's GPU rows (benchmarks/peers/gpu_rows.py): the same
// token ids and JSON as llama_driver.cpp, with the model on a GPU as llama-cli places it.
//
//   llama_gpu_driver MODEL.gguf IDS.bin PROMPT DECODE THREADS NGL NCPUMOE WARMUP OUT.json
//
// NGL is llama-cli's -ngl (layers kept on the GPU; 99: every layer), NCPUMOE its --n-cpu-moe
// (the experts of the first NCPUMOE layers stay in host memory and run on the CPU): the same
// tensor-buffer overrides common/arg.cpp builds, the CPU device's buffer type for every tensor
// matching `blk\.<i>\.ffn_(up|down|gate|gate_up)_(ch|)exps`. Everything else keeps llama.cpp's
// defaults (flash attention "auto", the CPU repack of host-side weights). The first PROMPT ids go
// in as one batch, then DECODE ids one at a time (teacher-forced), each timed; the argmax of every
// position's logits is recorded. Before that, unless WARMUP is 0, the same prompt and WARMUP
// decode steps run on the ids rotated by one, untimed, and the KV cache is cleared: a GPU's first
// calls (library handles, kernels loaded, graphs captured) are not the model's, and the Python
// driver beside this one warms up the same way. GPU memory: the first GPU device's free memory
// (ggml_backend_dev_memory, device-wide) before the model loads, after the context is made and
// after the last decode step (llama.cpp's compute buffers grow at first use).
#include <ggml-backend.h>
#include <llama.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <list>
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

int fail(const char* what) {
  std::fprintf(stderr, "llama_gpu_driver: %s\n", what);
  return 2;
}

// Free bytes on the first GPU device; -1 where there is none (a CPU-only build).
long long gpu_free_bytes() {
  ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
  if (dev == nullptr) return -1;
  size_t free = 0, total = 0;
  ggml_backend_dev_memory(dev, &free, &total);
  return static_cast<long long>(free);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 10) return fail("usage: MODEL IDS PROMPT DECODE THREADS NGL NCPUMOE WARMUP OUT");
  const int n_prompt = std::atoi(argv[3]);
  const int n_decode = std::atoi(argv[4]);
  const int threads = std::atoi(argv[5]);
  const int ngl = std::atoi(argv[6]);
  const int n_cpu_moe = std::atoi(argv[7]);
  const int n_warmup = std::atoi(argv[8]);
  std::vector<llama_token> ids = read_ids(argv[2]);
  if (n_prompt < 1 || n_decode < 1 || static_cast<int>(ids.size()) < n_prompt + n_decode)
    return fail("IDS.bin holds fewer than PROMPT + DECODE ids");
  if (n_cpu_moe < 0 || n_warmup < 0 || n_warmup > n_decode)
    return fail("NCPUMOE must be >= 0, WARMUP from 0 to DECODE");

  llama_backend_init();
  llama_log_set([](ggml_log_level level, const char* text, void*) {
    if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
  }, nullptr);
  ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  if (cpu == nullptr) return fail("no CPU device");
  // The patterns outlive the model's load (llama.cpp keeps the pointers).
  std::list<std::string> patterns;
  std::vector<llama_model_tensor_buft_override> overrides;
  for (int i = 0; i < n_cpu_moe; ++i) {
    patterns.push_back("blk\\." + std::to_string(i) + "\\.ffn_(up|down|gate|gate_up)_(ch|)exps");
    overrides.push_back({patterns.back().c_str(), ggml_backend_dev_buffer_type(cpu)});
  }
  overrides.push_back({nullptr, nullptr});

  const long long free_before = gpu_free_bytes();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = ngl;
  if (n_cpu_moe > 0) mp.tensor_buft_overrides = overrides.data();
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
  const long long free_loaded = gpu_free_bytes();
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

  if (n_warmup > 0) {
    std::vector<llama_token> rotated(ids.begin() + 1, ids.end());
    rotated.push_back(ids.front());
    if (llama_decode(ctx, llama_batch_get_one(rotated.data(), n_prompt)) != 0)
      return fail("the warm-up prompt did not decode");
    for (int i = 0; i < n_warmup; ++i) {
      if (llama_decode(ctx, llama_batch_get_one(&rotated[n_prompt + i], 1)) != 0)
        return fail("a warm-up step failed");
      llama_get_logits_ith(ctx, -1);
    }
    llama_memory_clear(llama_get_memory(ctx), true);
  }
  const auto t_prompt = Clock::now();
  if (llama_decode(ctx, llama_batch_get_one(ids.data(), n_prompt)) != 0)
    return fail("the prompt did not decode");
  std::vector<int> top1{argmax(llama_get_logits_ith(ctx, -1), n_vocab)};  // waits for the GPU
  const double prompt_s = seconds_since(t_prompt);
  std::vector<double> step_s;
  for (int i = 0; i < n_decode; ++i) {
    const auto t0 = Clock::now();
    if (llama_decode(ctx, llama_batch_get_one(&ids[n_prompt + i], 1)) != 0)
      return fail("a decode step failed");
    top1.push_back(argmax(llama_get_logits_ith(ctx, -1), n_vocab));
    step_s.push_back(seconds_since(t0));
  }
  const long long free_after = gpu_free_bytes();

  std::FILE* out = std::fopen(argv[9], "w");
  if (out == nullptr) return fail("cannot write OUT.json");
  auto used = [&](long long free_now) {
    return free_before < 0 || free_now < 0 ? -1 : free_before - free_now;
  };
  std::fprintf(out,
               "{\"load_s\": %.6f, \"prompt_s\": %.6f, \"n_vocab\": %d, \"ngl\": %d, "
               "\"n_cpu_moe\": %d, \"gpu_used_loaded_bytes\": %lld, \"gpu_used_bytes\": %lld, "
               "\"step_s\": [",
               load_s, prompt_s, n_vocab, ngl, n_cpu_moe, used(free_loaded), used(free_after));
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
