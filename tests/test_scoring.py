"""Prompt logprobs: per-position log_softmax of a Hugging Face model's logits."""

import numpy as np
import pytest

from llmserve.checkpoint import load_checkpoint
from llmserve.sampling_params import SamplingParams
from llmserve.scoring import PromptScorer, default_buckets


@pytest.fixture(scope="module")
def hf(hf_dir_factory):
    d, torch_model = hf_dir_factory("llama", 4, 2)
    cfg, params = load_checkpoint(d, dtype="float32")
    return cfg, params, torch_model


def hf_logprobs(torch_model, ids):
    import torch

    with torch.no_grad():
        logits = torch_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()  # [T, V]


def test_prompt_logprobs_match_transformers(hf):
    cfg, params, torch_model = hf
    scorer = PromptScorer(cfg, params, max_len=64, num_top=3, buckets=(16, 64))
    rng = np.random.default_rng(0)
    before = scorer.num_compilations()
    for n in (2, 9, 16, 17, 40):  # both buckets, and both edges of the first
        ids = rng.integers(0, cfg.vocab_size, n).tolist()
        got = scorer.score(ids, num_top=3)
        want = hf_logprobs(torch_model, ids)
        assert len(got) == n and got[0] is None
        for i in range(1, n):
            entry = got[i]
            assert list(entry)[0] == ids[i]  # the prompt token comes first
            np.testing.assert_allclose(entry[ids[i]], want[i - 1, ids[i]], atol=2e-4)
            top = np.argsort(-want[i - 1])[:3]
            assert set(top) <= set(entry)
            for t in top:
                np.testing.assert_allclose(entry[int(t)], want[i - 1, t], atol=2e-4)
    assert scorer.num_compilations() - before <= 2  # one per bucket, never per length


def test_num_top_zero_gives_only_the_prompt_token(hf):
    cfg, params, _ = hf
    scorer = PromptScorer(cfg, params, max_len=64, num_top=3, buckets=(16, 64))
    got = scorer.score([5, 6, 7])
    assert [None if e is None else list(e) for e in got] == [None, [6], [7]]


def test_errors(hf):
    cfg, params, _ = hf
    scorer = PromptScorer(cfg, params, max_len=32, num_top=2, buckets=(32,))
    with pytest.raises(ValueError, match="exceeds the scorer's max_len"):
        scorer.score(list(range(33)))
    with pytest.raises(ValueError, match="max_logprobs=2"):
        scorer.score([1, 2], num_top=3)
    with pytest.raises(ValueError, match="empty"):
        scorer.score([])
    with pytest.raises(ValueError, match="largest bucket"):
        PromptScorer(cfg, params, max_len=64, buckets=(16,))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    assert default_buckets(2048) == (64, 256, 1024, 2048)
    assert default_buckets(64) == (64,)
