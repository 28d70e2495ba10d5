"""dev/profile_sweep.py's comparison of a variant's outputs with the default's: it must catch any difference."""
import torch

from dev.profile_sweep import _kernel_us, _same, _snapshot, _ugly_ids


class _FakeHandle:
    def __init__(self, n):
        self.num_recv = n
        self.count_matrix = torch.tensor([[n]], dtype=torch.int32)
        self.send_pos = torch.arange(n, dtype=torch.int32).view(n, 1)
        self.recv_src_idx = torch.arange(n, dtype=torch.int32)
        self.is_token_in_rank = torch.ones(n, 1, dtype=torch.bool)


def _result(n=4):
    x = torch.arange(n * 8, dtype=torch.float32).view(n, 8).to(torch.bfloat16)
    fp8 = (torch.ones(n, 8).to(torch.float8_e4m3fn), torch.ones(n, 1))
    return (x, fp8), None, torch.zeros(n, 2), [n, 0], _FakeHandle(n)


def test_equal_results_compare_equal_and_snapshots_are_copies():
    out = _result()
    a = _snapshot(out)
    out[0][0].zero_()  # the buffer reuses its outputs: the snapshot must not change with them
    assert not _same(a, _snapshot(out))
    assert _same(_snapshot(_result()), _snapshot(_result()))


def test_any_changed_element_dtype_shape_or_count_differs():
    base = _snapshot(_result())
    changed = _result()
    changed[0][0][1, 3] += 1
    assert not _same(base, _snapshot(changed))
    changed = _result()
    changed[0][1][0].view(torch.uint8)[2, 5] ^= 1  # one bit of an fp8 value
    assert not _same(base, _snapshot(changed))
    changed = _result()
    changed[4].send_pos[1, 0] = -1
    assert not _same(base, _snapshot(changed))
    assert not _same(base, _snapshot(_result(5)))
    assert not _same(base, _snapshot(_result()[:4]))
    out = _result()
    assert not _same(base, _snapshot((out[0], out[1], out[2].double(), out[3], out[4])))


def test_ugly_ids_leave_slots_and_whole_tokens_unrouted():
    idx = torch.arange(30 * 8).view(30, 8) % 256
    ugly = _ugly_ids(idx)
    assert (ugly[13] == -1).all() and (ugly[7, :3] == -1).all() and (ugly[7, 3:] == idx[7, 3:]).all()
    assert (ugly[1] == idx[1]).all()


def test_kernel_names_pick_the_payload_not_the_notify_or_layout_kernel():
    kernels = {"dc::(anonymous namespace)::notify_dispatch_kernel(dc::Notify": 12.9,
               "dc::dispatch_kernel(dc::DispatchArgs, dc::NvlLayout, dc::Pee": 12.2,
               "dc::(anonymous namespace)::dispatch_layout_kernel(dc::Layout": 3.3,
               "void dc::(anonymous namespace)::combine_kernel<6, 18, 4, fal": 15.3}
    assert _kernel_us(kernels, "dc::dispatch_kernel") == 12.2
    assert _kernel_us(kernels, "notify_dispatch") == 12.9
    assert _kernel_us(kernels, "::combine_kernel") == 15.3
