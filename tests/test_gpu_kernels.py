"""The shared attention suite on a real GPU: the Pallas kernels compiled by Triton, not
interpreted. Skipped without a GPU; scripts/gpu_check.sh runs it first on a GPU machine."""

import jax
import pytest

from llmserve.ops import attention as attn
from llmserve.ops import flash_attention as fa
from tests.test_attention import AttentionSuite

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


class TestPallasGpu(AttentionSuite):
    """The kernels natively; small blocks so every loop runs several steps."""

    def contiguous(self, *args):
        return fa.flash_attention(*args, block_q=16, block_k=16)

    def paged(self, *args):
        return attn.paged_attention(*args, backend="pallas")


class TestPallasGpuDefaultBlocks(AttentionSuite):
    """The dispatcher's own block sizes, as the engine runs them."""

    def contiguous(self, *args):
        return attn.attention(*args, backend="pallas")

    def paged(self, *args):
        return attn.paged_attention(*args, backend="pallas")
