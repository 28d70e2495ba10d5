"""The CUDA backend's output arena over many dispatches with outputs kept alive and let go at random, on the CPU with
the NVLink stand-ins (tests/helpers/nvl_stand_ins.py): every dispatch's "kernel" fills the rows it places with a
byte of its own, so a dispatch whose rows land where a live output lies, or an output that does not show its own
rows (worst-case block, exact block, bounce area), fails here. The GPU side of the same paths: test_intranode.py
and `python -m deepcomm.soak --keep`."""
import random

import pytest
import torch

from tests.helpers.nvl_stand_ins import C, cpu_backend

pytestmark = pytest.mark.skipif(C is None, reason="needs the extension deepcomm._C (its layouts and flags)")

if C is not None:
    from deepcomm.nvlink import backend as B

# positions in NvlContext.dispatch_call's arguments (FakeCtx.dispatch_call)
FLAGS, X_ROW_BYTES, OUT_BLOCK = 0, 15, 21


def _filling(env):
    """Make the stand-in's payload write its recv_x rows: the call's byte over n rows at its out_block."""
    ctx, b = env.ctx, env.b
    plain = ctx.dispatch_call
    env.byte = 0

    def call(*args):
        res = plain(*args)
        if args[FLAGS] & B.PAYLOAD and res[0] == 0 and res[1] > 0:
            at = args[OUT_BLOCK] - b._arena_at  # the stand-in's memory starts at the arena
            env.memory[at:at + res[1] * args[X_ROW_BYTES]] = env.byte
        return res
    ctx.dispatch_call = call


def _bounced(env, first_call: int) -> bool:
    """Whether a crossing recorded since ``first_call`` launched a payload into the bounce area."""
    bounce = env.b._arena_at + env.b.bounce_offset
    return any(c["flags"] & B.PAYLOAD and c["out_block"] == bounce for c in env.ctx.calls[first_call:])


def _holds(recv_x: torch.Tensor, byte: int) -> bool:
    return bool((recv_x.view(torch.uint8) == byte).all())


@pytest.mark.parametrize("seed,way", [(1, "place"), (2, "place"), (3, "place"), (4, "copy"), (5, "copy")])
def test_kept_outputs_are_never_written_and_each_dispatch_shows_its_rows(monkeypatch, seed, way):
    env = cpu_backend(monkeypatch.setattr)
    _filling(env)
    b, rng = env.b, random.Random(seed)
    b._full_copies = way == "copy"  # DEEPCOMM_ARENA_FULL: exact placement after the counts, or the bounce area
    H, K, E = 1024, 4, 8
    kept = []  # (byte, recv_x, the whole output or None)
    paths = {"arena": 0, "exact": 0, "bounce": 0, "cached": 0, "worst-case sized": 0}
    bounces = 0  # dispatches whose payload went to the bounce area, as the stand-in saw their crossings
    for step in range(240):
        env.byte = step % 251 + 1
        env.ctx.recv = rng.choice([0, 1, rng.randint(1, 256), 256, rng.randint(200, 256)])
        T = rng.randint(0, 64)
        x, idx, w = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K)
        live = [entry for entry in kept if entry[2] is not None]
        calls = len(env.ctx.calls)
        kind = rng.random()
        if live and kind < 0.2:  # a cached dispatch of a kept output's handle
            out = b.dispatch(x, None, w, E, rng.choice(live)[2][4], 1)
            paths["cached"] += 1
            bounced = _bounced(env, calls)
            assert b.last_placement == ("bounce" if bounced else "arena"), step
        elif kind < 0.35:  # worst-case sized, as in a CUDA graph: no wait, every row of the capacity placed
            out = b.dispatch(x, idx, w, E, None, 1, num_worst_tokens=256)
            paths["worst-case sized"] += 1
            bounced = _bounced(env, calls)
            assert b.last_placement == ("bounce" if bounced else "arena"), step
        else:  # a waited fresh dispatch, plain or on the communication stream
            out = b.dispatch(x, idx, w, E, None, 1, async_finish=rng.random() < 0.3)
            bounced = _bounced(env, calls)
            if bounced:
                path = "bounce"
            else:
                path = "exact" if len(env.ctx.calls) - calls == 2 else "arena"
            paths[path] += 1
            assert b.last_placement == path, f"step {step}: a {path} placement reported as {b.last_placement}"
        bounces += bounced
        recv_x = out[0]
        assert _holds(recv_x, env.byte), f"step {step}: the dispatch's recv_x does not hold its own rows"
        # keep the whole output, or only recv_x (its block stays with it), or nothing
        choice = rng.random()
        if choice < 0.5:
            kept.append((env.byte, recv_x, out))
        elif choice < 0.8:
            kept.append((env.byte, recv_x, None))
        del out, recv_x
        while len(kept) > rng.randint(0, 24):  # let go of some, oldest or at random
            kept.pop(0 if rng.random() < 0.5 else rng.randrange(len(kept)))
        for byte, rx, _ in kept:
            assert _holds(rx, byte), f"step {step}: a kept output (byte {byte}) was written by a later dispatch"
    # every placement taken; with "copy" a full arena sends a fresh dispatch to the bounce area at once, never exact
    assert all(v > 0 for k, v in paths.items() if not (way == "copy" and k == "exact")), paths
    assert way == "place" or paths["exact"] == 0, paths
    assert sum(b.placements.values()) == 240 and b.placements["bounce"] == b.bounced_calls == bounces, b.placements
