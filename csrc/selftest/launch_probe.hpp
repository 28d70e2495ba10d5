// Launch probes: what the host pays per kernel launch and per stream-order operation on this machine, so that
// dev/profile_host_parts.py can split a normal-mode call's crossing into launches and the rest.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <string>

namespace dc {

// Median host nanoseconds per operation (batches of 64, `batches` of them, the stream drained between batches):
// empty kernels launched with <<<>>> (one block, an 8-byte argument; 24 blocks, a 448-byte argument like the
// dispatch kernel's), with cudaLaunchKernelEx (the same, plain and with the programmatic-launch attribute),
// cudaEventRecord, cudaStreamWaitEvent, and a release and re-acquire of nothing (the clock's own cost).
std::map<std::string, double> launch_probe(int batches, cudaStream_t stream);

}  // namespace dc
