"""The two choice settings of a Buffer (deepcomm/config.py, one resolver for both): the argument when given (exact),
else the environment variable (trimmed, any case), else the default; a bad value is a ValueError naming its source.
low_latency_memory / DEEPCOMM_LL_MEMORY and internode_transport / DEEPCOMM_INTERNODE_TRANSPORT."""
import pytest

from deepcomm.config import Config, resolve_internode_transport, resolve_low_latency_memory

# field, environment variable, default, the other choice, a bad environment value and what it raises, the
# resolver, a bad argument and what it raises
CHOICES = [
    ("low_latency_memory", "DEEPCOMM_LL_MEMORY", "ipc", "nvshmem",
     "shm", "DEEPCOMM_LL_MEMORY: expected one of ipc, nvshmem, got 'shm'",
     resolve_low_latency_memory, "cuda_ipc", "low_latency_memory"),
    ("internode_transport", "DEEPCOMM_INTERNODE_TRANSPORT", "emulated", "nvshmem",
     "ibgda", "DEEPCOMM_INTERNODE_TRANSPORT: expected one of emulated, nvshmem, nvshmem-host, got 'ibgda'",
     resolve_internode_transport, "NVSHMEM", "^internode_transport: expected one of 'emulated', 'nvshmem', 'nvshmem-host'"),
]


@pytest.mark.parametrize("field,env,default,other,bad_env,env_error,resolve,bad_arg,arg_error", CHOICES,
                         ids=[c[0] for c in CHOICES])
def test_choice_setting(monkeypatch, field, env, default, other, bad_env, env_error, resolve, bad_arg, arg_error):
    monkeypatch.delenv(env, raising=False)
    assert getattr(Config(), field) == default
    assert getattr(Config(**{field: other}), field) == other
    monkeypatch.setenv(env, " NVSHMEM ")
    assert getattr(Config(), field) == "nvshmem"
    assert getattr(Config(**{field: default}), field) == default  # the argument wins over the environment
    monkeypatch.setenv(env, bad_env)
    with pytest.raises(ValueError, match=env_error):
        Config()
    with pytest.raises(ValueError, match=arg_error):
        resolve(bad_arg)  # arguments are exact: no trimming, no case folding
