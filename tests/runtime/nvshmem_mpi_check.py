"""Run by tests/runtime/test_nvshmem.py under launch/mpirun.sh with DEEPCOMM_LL_MEMORY=nvshmem: deepcomm.launch_mpi
has bootstrapped NVSHMEM through MPI before this runs; check it, then one low-latency round trip on it."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import deepcomm  # noqa: E402
from deepcomm.cuda import nvshmem_session as ns  # noqa: E402
from deepcomm.reference.device_adapter import DeviceAdapter  # noqa: E402
from tests.low_latency.test_ll_kernels import M, check_cases  # noqa: E402

rank, world = dist.get_rank(), dist.get_world_size()
session = ns.current()
assert session is not None and session.how == "MPI", session and session.how
assert session.ranks == tuple(range(world)), session.ranks
n = ns.load_library()
assert (n.my_pe(), n.n_pes()) == (rank, world)
dev = torch.device("cuda", torch.cuda.current_device())
cuda = deepcomm.Buffer(max_tokens_per_rank=64, hidden=2048, backend="cuda", num_max_low_latency_tokens=M,
                       num_sms=8, timeout_s=20)
# on a gloo group (ranks sharing a GPU) the reference runs on the CPU: the adapter moves tensors there and back
ref = DeviceAdapter(deepcomm.Buffer(max_tokens_per_rank=64, hidden=2048, backend="reference",
                                    num_max_low_latency_tokens=M), dev)
check_cases(cuda, ref, [(33, 2048, 32, 4, "masked", "fp8")], torch.Generator().manual_seed(900 + rank), dev, world)
assert cuda.low_latency_buffer_info()["memory"] == "nvshmem"
cuda.destroy()
ref.destroy()
print(f"rank {rank}: NVSHMEM over MPI: OK", flush=True)
