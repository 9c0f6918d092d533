"""The one enum of engine quantization names: its members are the strings recipes, ``check`` and vLLM
take, and every place that accepts a quantization accepts exactly the aligned ones."""
import pytest

from megatron_vllm_align.check import main as check_main
from megatron_vllm_align.invariance.coverage import COVERED_QUANTIZATIONS
from megatron_vllm_align.train.config import ALIGN_QUANTIZATIONS, AlignSection, RecipeError
from megatron_vllm_align.utils.quantization_names import ALIGNED_QUANTIZATIONS, Quantization


def test_members_are_their_strings():
    assert Quantization("fp8_per_channel") is Quantization.FP8_PER_CHANNEL
    assert Quantization.FP8_PER_CHANNEL == "fp8_per_channel"
    assert (str(Quantization.COMPRESSED_TENSORS), f"{Quantization.COMPRESSED_TENSORS}") == ("compressed-tensors",) * 2
    with pytest.raises(ValueError):
        Quantization("fp8")


def test_recipes_check_and_invariance_take_the_same_strings(capsys):
    aligned = [q.value for q in ALIGNED_QUANTIZATIONS]
    assert list(ALIGN_QUANTIZATIONS) == [None, *aligned]
    assert set(aligned) <= set(COVERED_QUANTIZATIONS), "every aligned quantization is covered by MVA_INVARIANT=1"
    assert AlignSection(quantization="fp8_per_channel").quantization == "fp8_per_channel"
    with pytest.raises(RecipeError, match="align.quantization"):   # control: a name outside the enum
        AlignSection(quantization="compressed-tensors")
    with pytest.raises(SystemExit) as refused:
        check_main(["--model", "unused", "--quantization", "compressed-tensors"])
    assert refused.value.code == 2 and "invalid choice: 'compressed-tensors'" in capsys.readouterr().err
