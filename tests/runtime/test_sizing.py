"""deepcomm.sizing reports the layouts the CUDA backend allocates (needs the extension, not a GPU)."""
import pytest

from deepcomm import sizing

pytestmark = pytest.mark.skipif(sizing.nvl_buffer_bytes(2, 8, 128) is None, reason="deepcomm._C is not built")


def test_nvl_buffer_parts_add_up_and_hold_the_outputs():
    got = sizing.nvl_buffer_bytes(2, 1024, 7168)
    assert got["signals"] + got["combine_stage"] + got["arena"] <= got["total"]
    # the arena holds at least four worst-case bf16 outputs: every rank's 1024 tokens, 7168 bf16 each
    assert got["arena"] >= 4 * 2 * 1024 * 7168 * 2
    # rows coming back for combine: one per (source rank, token)
    assert got["combine_stage"] >= 2 * 1024 * 7168 * 2


def test_ll_buffer_holds_both_receive_slots_and_grows_with_the_shape():
    R, E, M, H = 2, 16, 32, 1024
    got = sizing.ll_buffer_bytes(R, E, M, H)
    # two slots of bf16 receive rows [E / R experts, R * M rows, H]
    assert got >= 2 * (E // R) * (R * M) * H * 2
    assert sizing.ll_buffer_bytes(R, E, M, 2 * H) > got
    assert sizing.ll_buffer_bytes(R, 2 * E, M, H) > got


def test_cli_prints_both_buffers(capsys):
    assert sizing.main(["--ranks", "2", "--tokens", "64", "--hidden", "1024", "--experts", "16"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "low-latency buffer" in out


def test_the_arena_holds_as_many_worst_case_outputs_as_deepcomm_arena_outputs_says(monkeypatch):
    from deepcomm.nvlink.arena_sizing import ARENA_OUTPUTS_ENV, arena_sizes, worst_output_bytes
    from deepcomm._ext import load_extension
    C = load_extension()
    worst = worst_output_bytes(C, 2 * 1024, 7168)
    monkeypatch.delenv(ARENA_OUTPUTS_ENV, raising=False)
    assert arena_sizes(C, 2, 1024, 7168) == (4 * worst, worst)
    default = sizing.nvl_buffer_bytes(2, 1024, 7168)["arena"]
    monkeypatch.setenv(ARENA_OUTPUTS_ENV, " 12 ")
    assert arena_sizes(C, 2, 1024, 7168) == (12 * worst, worst)
    assert sizing.nvl_buffer_bytes(2, 1024, 7168)["arena"] >= default + 8 * worst  # the sizes reported follow it
    for bad in ("0", "-3", "four"):
        monkeypatch.setenv(ARENA_OUTPUTS_ENV, bad)
        with pytest.raises(ValueError, match=ARENA_OUTPUTS_ENV):
            arena_sizes(C, 2, 1024, 7168)


def test_notify_counts_hold_a_half_for_each_call_parity():
    # a call that bad expert ids stop has no payload handshake: a fast rank's next call writes its count row into
    # the other half, never over the one a slow rank still reads (csrc/runtime/nvl_layout.hpp notify_counts_at)
    from deepcomm._ext import load_extension
    C = load_extension()
    for R, L in ((2, 1), (8, C.COUNTS_MAX_EXPERTS)):
        lay = C.NvlContext(0, R, L, 128, 1024, C.TOPK_MAX, 1 << 20).layout()
        assert lay["notify_flag"] - lay["notify_counts"] >= 2 * R * (R + L + 1) * 4
