"""The one-pass accepted cases of the per-call checks (deepcomm/validation.py: routing_accepted, the fast paths of
check_dispatch_x and check_combine_x) accept exactly what the checks one by one accept, over many good and bad
inputs: a fast path that accepted more would let a bad argument through silently, one that accepted less only
costs time."""
import itertools
import types

import pytest
import torch

import deepcomm.validation as v
from deepcomm.handle import Handle

CPU = torch.device("cpu")
T, K, E, R = 6, 4, 8, 2


def _passes(fn) -> bool:
    try:
        fn()
    except ValueError:
        return False
    return True


def _idx_variants():
    good = torch.zeros(T, K, dtype=torch.int64)
    yield "good", good
    yield "int32", good.int()
    yield "rows", torch.zeros(T + 1, K, dtype=torch.int64)
    yield "1-d", torch.zeros(T * K, dtype=torch.int64)
    yield "strided", torch.zeros(K, T, dtype=torch.int64).t()
    yield "wide", torch.zeros(T, v.MAX_TOPK + 1, dtype=torch.int64)
    yield "list", [[0] * K] * T
    yield "none", None


def _weights_variants():
    yield "none", None
    yield "good", torch.zeros(T, K)
    yield "f64", torch.zeros(T, K, dtype=torch.float64)
    yield "cols", torch.zeros(T, K + 1)
    yield "strided", torch.zeros(K, T).t()
    yield "param", torch.nn.Parameter(torch.zeros(T, K))


@pytest.mark.parametrize("num_experts", [E, 7, 0, True, 8.0, None])
def test_routing_accepted_is_the_checks_one_by_one(num_experts):
    for (iname, idx), (wname, w) in itertools.product(_idx_variants(), _weights_variants()):
        def slow():
            if idx is None:
                v.fail("topk_idx", "required")
            v.check_num_experts(num_experts, R)
            v.check_topk_idx(idx, T, num_experts, CPU, check_values=False)
            if w is not None:
                v.check_topk_weights(w, tuple(idx.shape), CPU)
        fast = v.routing_accepted(idx, w, T, num_experts, R, CPU)
        assert not fast or _passes(slow), (iname, wname, num_experts)  # never accepts what the checks refuse
        plain = type(w) is not torch.nn.Parameter
        if plain:
            assert fast == _passes(slow), (iname, wname, num_experts)


def test_the_combine_fast_path_is_the_checks_one_by_one():
    handle = types.SimpleNamespace(num_recv=5)
    xs = {"good": torch.zeros(5, 64, dtype=torch.bfloat16), "good128": torch.zeros(5, 128, dtype=torch.bfloat16),
          "rows": torch.zeros(6, 64, dtype=torch.bfloat16), "f32": torch.zeros(5, 64),
          "hidden": torch.zeros(5, 60, dtype=torch.bfloat16), "wide": torch.zeros(5, 2048, dtype=torch.bfloat16),
          "strided": torch.zeros(64, 5, dtype=torch.bfloat16).t(),
          "offset": torch.zeros(5 * 64 + 1, dtype=torch.bfloat16)[1:].view(5, 64), "pair": (None, None)}
    for (name, x), use_fp8 in itertools.product(xs.items(), [False, True, 0]):
        ok = _passes(lambda: v.check_combine_x(x, handle, CPU, (torch.bfloat16,), 1024, use_fp8))
        # use_fp8 must be a bool; the FP8 combine needs H % 128 == 0
        want = type(use_fp8) is bool and (name == "good128" or (name == "good" and not use_fp8))
        assert ok == want, (name, use_fp8)


def test_a_handle_of_another_class_or_buffer_is_refused():
    h = Handle(buffer_id=3, num_experts=E, num_tokens=T, hidden=64, num_recv=0, is_token_in_rank=None,
               send_pos=None, count_matrix=None, recv_src_idx=None, num_recv_tokens_per_expert=[])
    with pytest.raises(ValueError, match="handle"):
        v.check_handle(h, Handle, 4)
    with pytest.raises(ValueError, match="handle"):
        v.check_handle(types.SimpleNamespace(buffer_id=3), Handle, 3)
