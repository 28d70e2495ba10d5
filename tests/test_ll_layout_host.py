"""The low-latency buffer layout (csrc/runtime/ll_layout.hpp, through deepcomm._C): what must be zeroed when the
call numbers restart (unmask_ranks: reset_signals zeroes [0, signal_bytes)) covers the tagged combine weights,
whose tags would otherwise match the restarted calls, and the per-block arrival words; and every region fits the
total."""
import pytest

from deepcomm._ext import load_extension

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")
TOPK_MAX = 32  # deepcomm/cuda/ll_buffer.py


@pytest.mark.parametrize("ranks,experts,max_tokens,hidden", [(2, 256, 128, 7168), (8, 256, 128, 7168),
                                                             (4, 32, 1, 2048), (2, 2, 256, 5120)])
def test_tagged_weights_are_zeroed_with_the_signals(ranks, experts, max_tokens, hidden):
    lay = C.LlContext(0, ranks, experts, max_tokens, hidden, TOPK_MAX).layout()
    weights_end = lay["weights"] + 2 * ranks * max_tokens * TOPK_MAX * 8
    assert 0 < lay["weights"] and weights_end <= lay["signal_bytes"], lay
    assert lay["mask"] < lay["signal_bytes"], lay
    # one arrival word per (kind, slot, rank, block): the call numbers restart from zero after unmasking
    assert 0 < lay["arrivals"] < lay["arrivals_end"] <= lay["signal_bytes"], lay
    assert lay["arrivals_end"] - lay["arrivals"] == 2 * 2 * ranks * C.MAX_BLOCKS * 8, lay
    # the words that tell every rank about bad input hold call counts too
    assert 0 < lay["input_err"] and lay["input_err"] + 2 * 2 * ranks * 8 <= lay["signal_bytes"], lay
    slots = [lay[k][1] for k in ("recv_x_slot", "out_count_slot", "out_recv_pos_slot")]
    assert all(lay["signal_bytes"] <= s < lay["total"] for s in slots), lay
