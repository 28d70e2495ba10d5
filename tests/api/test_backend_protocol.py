"""Every backend meets deepcomm/backend_protocol.py: each member of the Backend protocol is defined on its class,
with the protocol's arguments, and its capabilities are a Capabilities (Buffer reads them instead of probing)."""
import inspect

import pytest

from deepcomm.backend_protocol import Backend, Capabilities
from deepcomm.reference.backend import ReferenceBackend

MEMBERS = [name for name in dir(Backend) if not name.startswith("_")] + ["name", "capabilities"]


def _classes():
    classes = [ReferenceBackend]
    try:
        from deepcomm.nvlink.backend import CudaBackend
        from deepcomm.internode.backend import InternodeBackend
    except ImportError:  # the CUDA backends need nothing at import time but torch; kept optional all the same
        return classes
    return classes + [CudaBackend, InternodeBackend]


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_backend_classes_define_every_member(cls):
    missing = [name for name in MEMBERS if not hasattr(cls, name) and name not in _instance_attributes(cls)]
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert isinstance(cls.capabilities, Capabilities)
    for name in MEMBERS:
        want = getattr(Backend, name, None)
        got = getattr(cls, name, None)
        if inspect.isfunction(want) and inspect.isfunction(got):
            params = [p for p in inspect.signature(want).parameters.values() if p.kind is not p.VAR_KEYWORD]
            have = inspect.signature(got).parameters
            takes_any = any(p.kind is p.VAR_POSITIONAL for p in have.values())
            for p in params:
                assert takes_any or p.name in have, f"{cls.__name__}.{name} lacks argument {p.name}"


def _instance_attributes(cls):
    """Members set in __init__ (ReferenceBackend.masked is a plain attribute)."""
    return {"masked"} if cls is ReferenceBackend else set()
