"""The soak with faults (llmserve/testing/soak.py) on a tiny preset: every check passes, the
faults really happen, and the checks catch a broken engine."""

import pytest

from llmserve.scheduler import Scheduler
from llmserve.testing import soak
from llmserve.testing.soak import SoakConfig, run_soak

SMALL = SoakConfig(requests=60, seed=1)


@pytest.fixture(scope="module")
def report():
    return run_soak(SMALL)


def test_soak_passes_every_check(report):
    assert report.failures == [], "\n".join(report.failures[:30])
    total = report.figures["total"]
    assert total["requests"] == 60 and total["completions"] > 60  # some n > 1
    # The faults and features the soak claims to exercise did happen.
    assert total["preemptions"] > 0 and total["aborted_requests"] > 0
    assert total["aborted_completions"] >= total["aborted_requests"]
    assert total["bad_requests"] > 0 and total["aborts_twice"] > 0
    assert total["stop_strings_hit"] > 0 and total["finish_length"] > 0
    assert total["prefix_hit_pages"] > 0 and total["cow_copies"] > 0
    assert total["compared_with_lone_run"] > total["requests"] // 2
    assert total["lone_engine_compilations"] == 0  # the lone runs reuse the soak's shapes
    for run in ("ngram", "draft"):
        assert report.figures[run]["spec_acceptance_rate"] > 0
    assert len(report.timeline["plain"]) >= report.figures["plain"]["steps"]


def test_soak_catches_wrong_outputs_and_leaked_pages(monkeypatch):
    """The checks are not vacuous: a wrong oracle seed or a leaked page fails the soak."""
    small = SoakConfig(requests=16, runs=("plain",), seed=2)
    with monkeypatch.context() as m:  # lone runs seeded unlike the children: sampled differ
        m.setattr(soak, "child_seed", lambda seed, i: (seed + i + 1) & 0x7FFFFFFF)
        failures = run_soak(small).failures
    assert any("differs from its lone run" in f for f in failures)
    assert not any("pages still referenced" in f for f in failures)

    finish = Scheduler.finish

    def leaky_finish(self, seq, reason, stop_reason=None):
        finish(self, seq, reason, stop_reason)
        if not self.blocks.has_seq("leak"):  # a phantom sequence that is never freed
            self.blocks.allocate("leak", [1, 2, 3])

    monkeypatch.setattr(Scheduler, "finish", leaky_finish)
    failures = run_soak(small).failures
    assert any("pages still referenced" in f for f in failures)
