// NVSHMEM's host library (libnvshmem_host.so.3), opened at run time with dlopen: deepcomm._C never links it, so
// one build imports everywhere and NVSHMEM is only needed by the processes that select it. Only host-side
// calls: unique-id bootstrap, symmetric allocation, peer pointers, barrier, finalize, and the stream-ordered
// puts and signals of the internode NVSHMEM transport. No device library, no kernels that call NVSHMEM;
// deepcomm's own kernels use the peer pointers like CUDA IPC mappings.
//
// Every failure throws std::runtime_error naming the NVSHMEM call and its status; nothing exits the process.
// Not thread-safe: call from one thread per process (the Python main thread).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dc::nvshmem {

struct Version {
  int major, minor, patch;
};

// Opens the first candidate (a path, or a bare name for the dynamic loader's own search) that loads and exports
// every symbol used here; returns it. Throws listing each candidate and why it failed. Idempotent once loaded.
std::string load(const std::vector<std::string>& candidates);
bool loaded();
std::string loaded_path();

Version library_version();  // what the loaded library reports
Version header_version();   // the headers this file was compiled against
int init_status();          // nvshmemx_init_status(): 0 not initialized, 1 bootstrapped, 2 initialized, ...

// Bootstrap by unique id: one rank calls get_unique_id(), the bytes travel to every rank, and every rank calls
// init_with_unique_id with its rank and the world size, after making `device` current.
std::string get_unique_id();
int unique_id_bytes();
void init_with_unique_id(const std::string& unique_id, int rank, int world_size, int device);
bool initialized();  // by init_with_unique_id, and not finalized since

int my_pe();
int n_pes();
uintptr_t symmetric_alloc(int64_t bytes);                // nvshmem_malloc: collective, same size on every PE
void symmetric_free(uintptr_t ptr);                      // nvshmem_free: collective
uintptr_t peer_ptr(uintptr_t local_ptr, int pe);         // nvshmem_ptr: 0 when `pe` is not load/store reachable
void barrier_all();                                      // nvshmem_barrier_all
void finalize();                                         // nvshmemx_hostlib_finalize: collective

// Every NVSHMEM function load() resolves (and requires), by exported name.
std::vector<std::string> symbol_names();

// Stream-ordered one-sided operations (enqueued on `stream`, a cudaStream_t as an integer). `dest` and `sig_addr`
// are symmetric addresses as seen by this PE (the same object on `pe` is written); `source` is local memory.
// sig_op is signal_set() or signal_add() (NVSHMEM_SIGNAL_SET / _ADD). A reader that sees the signal sees the data.
int signal_set();
int signal_add();
void putmem_signal_on_stream(uintptr_t dest, uintptr_t source, size_t bytes, uintptr_t sig_addr, uint64_t signal,
                             int sig_op, int pe, uintptr_t stream);   // nvshmemx_putmem_signal_on_stream
void signal_op_on_stream(uintptr_t sig_addr, uint64_t signal, int sig_op, int pe,
                         uintptr_t stream);                           // nvshmemx_signal_op_on_stream
void quiet_on_stream(uintptr_t stream);                               // nvshmemx_quiet_on_stream

}  // namespace dc::nvshmem
