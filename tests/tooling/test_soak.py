"""The soak harness: a clean run passes, and a run that corrupts one received byte (--self-check) fails, so the
comparison the GPU soak relies on is live."""
from deepcomm import soak

SMALL = ["--device", "cpu", "--iterations", "24", "--max-hidden", "1024", "--max-tokens", "48",
         "--max-ll-tokens", "24", "--seed", "3"]


def test_soak_passes_on_matching_backends():
    assert soak.main(SMALL) == 0


def test_soak_catches_a_corrupted_byte():
    assert soak.main(SMALL + ["--self-check"]) == 1
