"""The invariance tests switch MVA_INVARIANT per test (the patches read it at every call)."""
import pytest

from megatron_vllm_align import invariance


@pytest.fixture
def invariant():
    """MVA_INVARIANT=1 for one test, patches installed; the previous value is restored."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(invariance.ENV_VAR, "1")
        invariance.install()
        yield


@pytest.fixture
def not_invariant():
    """MVA_INVARIANT=0 for one test (installed patches then leave vLLM's behaviour unchanged)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(invariance.ENV_VAR, "0")
        yield
