// A few int32 words the host must learn from the device (the internode kernels' fresh dispatch: the counts of its
// count round), without a device-to-host copy or a stream sync: a kernel queued after the words' producer copies
// them into pinned, device-mapped host memory, then writes the tag (the host's number for the call) with release
// at system scope; the host polls the tag (wait_host_tag, GIL released by the binding), bounded by a timeout and
// by the error records of the waits queued before (a device wait that timed out ends the host's wait at once).
//
// The mapped block: u64 tag | u64 unused | int32 words [n]   (host_words_bytes(n) bytes)
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../runtime/error_record.cuh"

namespace dc {

constexpr int64_t kHostWordsOffset = 16;  // the words start here, after the tag
inline int64_t host_words_bytes(int64_t n) { return kHostWordsOffset + 4 * n; }

// Queue on `stream`: copy src[0, n) (device int32) into the mapped block at `mapped_dev` (its device address), then
// store `tag` into its tag word (release, system scope).
void launch_words_to_host(const int32_t* src, int64_t n, uint8_t* mapped_dev, uint64_t tag, cudaStream_t stream);

// What a wait for the tag ended with.
enum HostTagWait : int { kHostTagArrived = 0, kHostTagDeviceError = 1, kHostTagTimeout = 2 };

// Poll the tag of the mapped block at `mapped_host` until it equals `tag` (acquire: the words are then readable),
// until one of `errors` (host addresses of ErrorRecords) has its flag set, or until timeout_s passed.
HostTagWait wait_host_tag(const uint8_t* mapped_host, uint64_t tag, double timeout_s,
                          const std::vector<const ErrorRecord*>& errors);

}  // namespace dc
