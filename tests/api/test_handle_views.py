"""Handle fields given as WorkspaceViews (how the CUDA backend returns a fresh dispatch's routing tensors): they
read as the views they describe, once made they stay the same tensor, and field_ptr gives their addresses without
making them."""
from __future__ import annotations

import dataclasses

import torch

from deepcomm.handle import Handle, WorkspaceViews, field_ptr

T, R = 3, 2
SPECS = {"is_token_in_rank": ((T, R), (R, 1), 4 * 20, torch.bool), "send_pos": ((T, R), (R, 1), 0, None),
         "count_matrix": ((R, R), (R, 1), 6, None), "recv_src_idx": (None, (1,), 10, None)}


def _handle(work: torch.Tensor) -> Handle:
    route = WorkspaceViews(work, SPECS, 5)
    return Handle(buffer_id=1, num_experts=4, num_tokens=T, hidden=8, num_recv=5, is_token_in_rank=route,
                  send_pos=route, count_matrix=route, recv_src_idx=work[10:15], num_recv_tokens_per_expert=[2, 3])


def test_views_read_as_the_tensors_they_describe():
    work = torch.arange(22, dtype=torch.int32)
    work.view(torch.bool)[80:86] = torch.tensor([True, False, False, True, True, True])
    h = _handle(work)
    assert field_ptr(h, "send_pos") == work.data_ptr()
    assert field_ptr(h, "count_matrix") == work.data_ptr() + 4 * 6
    assert field_ptr(h, "is_token_in_rank") == work.data_ptr() + 80
    assert field_ptr(h, "recv_src_idx") == work[10:].data_ptr()  # a plain tensor field
    assert type(h.__dict__["_send_pos"]) is WorkspaceViews  # field_ptr made nothing
    assert h.send_pos.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert type(h.__dict__["_count_matrix"]) is WorkspaceViews  # reading one field makes only that one
    assert h.count_matrix.tolist() == [[6, 7], [8, 9]]
    assert h.is_token_in_rank.tolist() == [[True, False], [False, True], [True, True]]
    assert h.send_pos is h.send_pos  # made once
    work[0] = 42  # a view, not a copy
    assert int(h.send_pos[0, 0]) == 42


def test_handles_stay_dataclasses():
    h = _handle(torch.zeros(22, dtype=torch.int32))
    h2 = dataclasses.replace(h, num_recv=7)
    assert h2.num_recv == 7 and torch.equal(h2.send_pos, h.send_pos) and h2.send_pos.shape == (3, 2)
    assert h2 == dataclasses.replace(h2)


def test_the_fresh_dispatch_constructor_stores_what_init_does():
    work = torch.arange(22, dtype=torch.int32)
    route = WorkspaceViews(work, SPECS, 5)
    fast = Handle.of_fresh_dispatch(4, 3, 8, 5, route, [2, 3])
    slow = Handle(buffer_id=-1, num_experts=4, num_tokens=3, hidden=8, num_recv=5, is_token_in_rank=route,
                  send_pos=route, count_matrix=route, recv_src_idx=route, num_recv_tokens_per_expert=[2, 3])
    assert fast.__dict__.keys() == slow.__dict__.keys()
    assert all(fast.__dict__[k] is slow.__dict__[k] or fast.__dict__[k] == slow.__dict__[k] for k in slow.__dict__)
    assert fast.recv_src_idx.tolist() == list(range(10, 15)) and fast.call == 0 and fast.node_route is None
    assert field_ptr(fast, "recv_src_idx") == work.data_ptr() + 40
