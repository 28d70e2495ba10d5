"""Run-time settings of the low-latency kernels, on the host: DEEPCOMM_LL_PDL picks how they launch (plain, or
programmatic dependent launch with or without the early trigger); a bad value raises ValueError naming the variable
before any buffer exists, and the extension refuses a mode it does not know."""
import pytest

from deepcomm._ext import load_extension
from deepcomm.cuda.ll_buffer import PDL_DEFAULT, PDL_ENV, pdl_mode

C = load_extension()


def test_pdl_mode_default_and_values(monkeypatch):
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert pdl_mode() == PDL_DEFAULT == 2
    for value in ("0", "1", "2", " 1 "):
        monkeypatch.setenv(PDL_ENV, value)
        assert pdl_mode() == int(value)


@pytest.mark.parametrize("value", ["3", "on", "-1", "1.0"])
def test_pdl_mode_rejects_bad_values(monkeypatch, value):
    monkeypatch.setenv(PDL_ENV, value)
    with pytest.raises(ValueError, match=PDL_ENV):
        pdl_mode()


@pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")
def test_context_refuses_unknown_pdl_mode():
    ctx = C.LlContext(0, 2, 16, 8, 256, 4)
    for mode in (0, 1, 2):
        ctx.set_pdl(mode)
    with pytest.raises(Exception, match="set_pdl"):
        ctx.set_pdl(3)
