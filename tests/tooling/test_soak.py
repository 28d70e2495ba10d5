"""The soak harness: a clean run passes, and a run that corrupts one received byte (--self-check) fails, so the
comparison the GPU soak relies on is live."""
from deepcomm import soak

SMALL = ["--device", "cpu", "--iterations", "24", "--max-hidden", "1024", "--max-tokens", "48",
         "--max-ll-tokens", "24", "--seed", "3"]


def test_soak_passes_on_matching_backends():
    assert soak.main(SMALL) == 0


def test_soak_catches_a_corrupted_byte(capfd):
    assert soak.main(SMALL + ["--self-check"]) == 1
    # the mismatch line names the output, what its wrong row holds (deepcomm/row_diff.py), and which side differs
    # from every rank's inputs drawn again (the corrupted backend, not the reference)
    out = capfd.readouterr().out
    assert "recv_x (1 of" in out
    assert "drawn again here, 1 rows of this backend and 0 of the reference differ" in out


def test_soak_keeps_outputs_and_checks_them_when_let_go():
    assert soak.main(SMALL + ["--keep", "5"]) == 0


def test_a_kept_output_that_changed_is_a_mismatch():
    import collections

    import torch
    want = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    changed = want.clone()
    kept = collections.deque([(4, (want.clone(), want), ""), (7, (changed, want), " (rows placed: bounce)"),
                              (9, (want.clone(), want), "")])
    changed[1, 0] = 99  # written after its call was checked
    failures = []
    soak._let_go(kept, 1, failures, rank=2)
    assert failures == ["iteration 7 rank 2: a kept dispatch output changed after its call (rows placed: bounce)"]
    assert [it for it, _, _ in kept] == [9]


def test_placements_are_read_from_a_backend_that_reports_them():
    import types
    cuda = types.SimpleNamespace(_backend=types.SimpleNamespace(last_placement="exact",
                                                                placements={"arena": 3, "exact": 1, "bounce": 0}))
    assert soak._placement(cuda) == " (rows placed: exact)"
    assert soak._placements(cuda) == {"arena": 3, "exact": 1, "bounce": 0}
    reference = types.SimpleNamespace(_backend=object())  # says nothing: no suffix, no counts
    assert soak._placement(reference) == "" and soak._placements(reference) == {}
    assert soak._arena_setting(reference) == ""


def test_arena_setting_is_the_backends_own(monkeypatch):
    import types
    from deepcomm.nvlink import backend as B
    from tests.helpers.nvl_stand_ins import cpu_backend
    b = cpu_backend(monkeypatch.setattr).b
    outputs = b.arena.nbytes // b.bounce_bytes
    assert outputs >= 1 and b.arena_outputs == outputs
    setting = soak._arena_setting(types.SimpleNamespace(_backend=b))
    assert setting == f" | arena: {outputs} worst-case outputs, full: place"
    b._full_copies = True
    assert isinstance(b, B.CudaBackend) and b.arena_full == "copy"
    assert soak._arena_setting(types.SimpleNamespace(_backend=b)).endswith("full: copy")
