"""Every module class names a default gradient contract."""
import pytest

from megatron_vllm_align.contracts import get_default_contract
from megatron_vllm_align.modules import (
    VllmDenseLinear,
    VllmFP8Linear,
    VllmRMSNorm,
    VllmRotaryEmbedding,
    VllmSelectedLogprob,
    VllmSiluAndMul,
)


@pytest.mark.parametrize("cls", [VllmRMSNorm, VllmSiluAndMul, VllmRotaryEmbedding, VllmDenseLinear,
                                 VllmFP8Linear, VllmSelectedLogprob])
def test_contract_name_is_a_default_contract(cls):
    assert get_default_contract(cls.contract_name) is not None
