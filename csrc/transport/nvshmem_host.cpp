// Run-time loading of NVSHMEM's host library (see nvshmem_host.hpp). Compiled only when setup.py finds the
// NVSHMEM headers (the nvidia-nvshmem wheel or NVSHMEM_HOME): they give the versioned init structs and, through
// decltype, the exact prototype of every function looked up with dlsym. Nothing from NVSHMEM is linked.
#include "nvshmem_host.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nvshmem_host.h>

#include <cstring>
#include <stdexcept>

#include "../runtime/cuda_check.hpp"

namespace dc::nvshmem {
namespace {

// Every function we call: (exported name, field of Api). One list drives the struct, the dlsym lookups and
// symbol_names(), so they cannot drift apart.
#define DC_NVSHMEM_SYMBOLS(X)                                        \
  X(nvshmemx_vendor_get_version_info, vendor_get_version_info)       \
  X(nvshmemx_init_status, init_status)                               \
  X(nvshmemx_get_uniqueid, get_uniqueid)                             \
  X(nvshmemx_set_attr_uniqueid_args, set_attr_uniqueid_args)         \
  X(nvshmemx_hostlib_init_attr, hostlib_init_attr)                   \
  X(nvshmemx_hostlib_finalize, hostlib_finalize)                     \
  X(nvshmem_my_pe, my_pe)                                            \
  X(nvshmem_n_pes, n_pes)                                            \
  X(nvshmem_malloc, malloc)                                          \
  X(nvshmem_free, free)                                              \
  X(nvshmem_ptr, ptr)                                                \
  X(nvshmem_barrier_all, barrier_all)                                \
  X(nvshmemx_putmem_signal_on_stream, putmem_signal_on_stream)       \
  X(nvshmemx_signal_op_on_stream, signal_op_on_stream)               \
  X(nvshmemx_quiet_on_stream, quiet_on_stream)

// One pointer per function, typed by the header's own declaration.
struct Api {
#define DC_API_FIELD(name, field) decltype(&::name) field;
  DC_NVSHMEM_SYMBOLS(DC_API_FIELD)
#undef DC_API_FIELD
};

Api g_api{};
void* g_handle = nullptr;
std::string g_path;
bool g_initialized = false;

template <typename F>
bool resolve(void* handle, const char* name, F& out, std::string& missing) {
  out = reinterpret_cast<F>(dlsym(handle, name));
  if (out == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
  return out != nullptr;
}

// Empty when every symbol resolved, else the missing names.
std::string resolve_all(void* h, Api& a) {
  std::string missing;
#define DC_RESOLVE(name, field) resolve(h, #name, a.field, missing);
  DC_NVSHMEM_SYMBOLS(DC_RESOLVE)
#undef DC_RESOLVE
  return missing;
}

void require_loaded(const char* what) {
  if (g_handle == nullptr)
    throw std::runtime_error(std::string("deepcomm: ") + what + ": NVSHMEM's host library is not loaded");
}

void require_initialized(const char* what) {
  require_loaded(what);
  if (!g_initialized)
    throw std::runtime_error(std::string("deepcomm: ") + what + ": NVSHMEM is not initialized in this process");
}

void check_status(int status, const char* call) {
  if (status != 0)
    throw std::runtime_error(std::string("deepcomm: ") + call + " failed with status " + std::to_string(status) +
                             " (NVSHMEM_DEBUG=WARN or INFO prints NVSHMEM's own reason)");
}

}  // namespace

std::string load(const std::vector<std::string>& candidates) {
  if (g_handle != nullptr) return g_path;
  std::string tried;
  for (const auto& c : candidates) {
    dlerror();
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      tried += "\n  " + c + ": " + (e ? e : "dlopen failed");
      continue;
    }
    Api a{};
    std::string missing = resolve_all(h, a);
    if (!missing.empty()) {
      dlclose(h);
      tried += "\n  " + c + ": missing symbols " + missing + " (not an NVSHMEM 3.x host library)";
      continue;
    }
    int major = 0, minor = 0, patch = 0;
    a.vendor_get_version_info(&major, &minor, &patch);
    if (major != NVSHMEM_VENDOR_MAJOR_VERSION) {
      dlclose(h);
      tried += "\n  " + c + ": NVSHMEM " + std::to_string(major) + "." + std::to_string(minor) + "." +
               std::to_string(patch) + ", but deepcomm was built against NVSHMEM " +
               std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + ".x headers";
      continue;
    }
    g_api = a;
    g_handle = h;  // never closed: NVSHMEM keeps threads and plugins that point into it
    g_path = c;
    return g_path;
  }
  throw std::runtime_error("deepcomm: could not load NVSHMEM's host library; tried:" +
                           (tried.empty() ? std::string(" nothing (no candidates)") : tried));
}

bool loaded() { return g_handle != nullptr; }
std::string loaded_path() { return g_path; }

Version library_version() {
  require_loaded("library_version");
  Version v{};
  g_api.vendor_get_version_info(&v.major, &v.minor, &v.patch);
  return v;
}

Version header_version() {
  return {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

int init_status() {
  require_loaded("init_status");
  return g_api.init_status();
}

int unique_id_bytes() { return int(sizeof(nvshmemx_uniqueid_t)); }

std::string get_unique_id() {
  require_loaded("get_unique_id");
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  check_status(g_api.get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void init_with_unique_id(const std::string& unique_id, int rank, int world_size, int device) {
  require_loaded("init_with_unique_id");
  if (g_initialized) throw std::runtime_error("deepcomm: NVSHMEM is already initialized by deepcomm in this process");
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::invalid_argument("deepcomm: NVSHMEM unique id has " + std::to_string(unique_id.size()) +
                                " bytes, expected " + std::to_string(sizeof(nvshmemx_uniqueid_t)));
  if (world_size < 1 || rank < 0 || rank >= world_size)
    throw std::invalid_argument("deepcomm: NVSHMEM init: rank " + std::to_string(rank) + " outside world of " +
                                std::to_string(world_size));
  const int before = g_api.init_status();
  if (before != NVSHMEM_STATUS_NOT_INITIALIZED)
    throw std::runtime_error("deepcomm: NVSHMEM was already initialized in this process by someone else (status " +
                             std::to_string(before) + "); deepcomm cannot share it");
  // NVSHMEM binds to the calling thread's current device; with no current context it would defer (two-stage
  // init). Make the device and its primary context current first.
  DC_CUDA_CHECK(cudaSetDevice(device));
  DC_CUDA_CHECK(cudaFree(nullptr));
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  // The initializer stamps the struct versions; set_attr_uniqueid_args fills only the id, rank and size.
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  check_status(g_api.set_attr_uniqueid_args(rank, world_size, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
  check_status(g_api.hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr), "nvshmemx_hostlib_init_attr");
  g_initialized = true;
  // Bootstrapped (1) is enough here: NVSHMEM completes a deferred initialization at the first nvshmem_malloc.
  const int status = g_api.init_status();
  if (status == NVSHMEM_STATUS_NOT_INITIALIZED || status == NVSHMEM_STATUS_INVALID)
    throw std::runtime_error("deepcomm: nvshmemx_hostlib_init_attr returned 0 but NVSHMEM reports status " +
                             std::to_string(status));
  if (g_api.my_pe() != rank || g_api.n_pes() != world_size)
    throw std::runtime_error("deepcomm: NVSHMEM initialized as PE " + std::to_string(g_api.my_pe()) + " of " +
                             std::to_string(g_api.n_pes()) + ", expected " + std::to_string(rank) + " of " +
                             std::to_string(world_size));
}

bool initialized() { return g_initialized; }

int my_pe() {
  require_initialized("my_pe");
  return g_api.my_pe();
}

int n_pes() {
  require_initialized("n_pes");
  return g_api.n_pes();
}

uintptr_t symmetric_alloc(int64_t bytes) {
  require_initialized("symmetric_alloc");
  if (bytes <= 0) throw std::invalid_argument("deepcomm: symmetric_alloc: bytes must be positive");
  void* p = g_api.malloc(size_t(bytes));
  if (p == nullptr)
    throw std::runtime_error("deepcomm: nvshmem_malloc(" + std::to_string(bytes) +
                             ") returned NULL: the symmetric heap is too small; raise NVSHMEM_SYMMETRIC_SIZE "
                             "(bytes per GPU, set before NVSHMEM is initialized)");
  return reinterpret_cast<uintptr_t>(p);
}

void symmetric_free(uintptr_t ptr) {
  require_initialized("symmetric_free");
  g_api.free(reinterpret_cast<void*>(ptr));
}

uintptr_t peer_ptr(uintptr_t local_ptr, int pe) {
  require_initialized("peer_ptr");
  if (pe < 0 || pe >= g_api.n_pes())
    throw std::invalid_argument("deepcomm: peer_ptr: PE " + std::to_string(pe) + " out of range");
  return reinterpret_cast<uintptr_t>(g_api.ptr(reinterpret_cast<const void*>(local_ptr), pe));
}

void barrier_all() {
  require_initialized("barrier_all");
  g_api.barrier_all();
}

std::vector<std::string> symbol_names() {
  return {
#define DC_NAME(name, field) #name,
      DC_NVSHMEM_SYMBOLS(DC_NAME)
#undef DC_NAME
  };
}

int signal_set() { return NVSHMEM_SIGNAL_SET; }
int signal_add() { return NVSHMEM_SIGNAL_ADD; }

namespace {

void check_remote(const char* what, int sig_op, int pe) {
  require_initialized(what);
  if (sig_op != NVSHMEM_SIGNAL_SET && sig_op != NVSHMEM_SIGNAL_ADD)
    throw std::invalid_argument(std::string("deepcomm: ") + what + ": sig_op must be NVSHMEM_SIGNAL_SET (" +
                                std::to_string(NVSHMEM_SIGNAL_SET) + ") or NVSHMEM_SIGNAL_ADD (" +
                                std::to_string(NVSHMEM_SIGNAL_ADD) + "), got " + std::to_string(sig_op));
  if (pe < 0 || pe >= g_api.n_pes())
    throw std::invalid_argument(std::string("deepcomm: ") + what + ": PE " + std::to_string(pe) + " out of range");
}

}  // namespace

void putmem_signal_on_stream(uintptr_t dest, uintptr_t source, size_t bytes, uintptr_t sig_addr, uint64_t signal,
                             int sig_op, int pe, uintptr_t stream) {
  check_remote("putmem_signal_on_stream", sig_op, pe);
  g_api.putmem_signal_on_stream(reinterpret_cast<void*>(dest), reinterpret_cast<const void*>(source), bytes,
                                reinterpret_cast<uint64_t*>(sig_addr), signal, sig_op, pe,
                                reinterpret_cast<cudaStream_t>(stream));
}

void signal_op_on_stream(uintptr_t sig_addr, uint64_t signal, int sig_op, int pe, uintptr_t stream) {
  check_remote("signal_op_on_stream", sig_op, pe);
  g_api.signal_op_on_stream(reinterpret_cast<uint64_t*>(sig_addr), signal, sig_op, pe,
                            reinterpret_cast<cudaStream_t>(stream));
}

void quiet_on_stream(uintptr_t stream) {
  require_initialized("quiet_on_stream");
  g_api.quiet_on_stream(reinterpret_cast<cudaStream_t>(stream));
}

void finalize() {
  require_initialized("finalize");
  g_initialized = false;
  g_api.hostlib_finalize();
}

}  // namespace dc::nvshmem
