"""Scheduler invariants under random workloads (hypothesis), with the device simulated."""

from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmserve.batch import BatchBuilder
from llmserve.block_manager import BlockManager
from llmserve.sampling_params import SamplingParams
from llmserve.scheduler import Scheduler, Sequence, Status


def check(sched: Scheduler, blocks: BlockManager, max_slots: int) -> None:
    slots = [s.slot for s in sched.running]
    assert len(set(slots)) == len(slots) and all(0 <= s < max_slots for s in slots)
    assert len(sched.free_slots) + len(slots) == max_slots
    assert all(s.status == Status.RUNNING for s in sched.running)
    assert all(s.status == Status.WAITING for s in sched.waiting)
    blocks.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(1, 3)),
                  min_size=1, max_size=12),
    num_pages=st.integers(13, 40),  # the engine's floor: one max_len sequence + dummy page
    policy=st.sampled_from(["continuous", "static", "mixed"]),
    lookahead=st.integers(0, 3),
    abort_every=st.integers(0, 7),
    packed=st.booleans(),
)
def test_every_request_finishes_and_pages_return(reqs, num_pages, policy, lookahead,
                                                 abort_every, packed):
    """``packed``: chunks packed into block buckets, the runner's ``fit_chunk`` deciding;
    ``mixed``: continuous without the prefill-first rule."""
    page, max_slots, max_len = 4, 4, 48
    prefill_first = policy != "mixed"
    policy = "static" if policy == "static" else "continuous"
    blocks = BlockManager(num_pages, page)
    builder = BatchBuilder(vocab_size=64, page_size=page, pages_per_seq=12,
                           max_slots=max_slots, decode_buckets=[4],
                           prefill_buckets=[(2, 4), (4, 4), (8, 4)], max_prefill_seqs=3,
                           trim_from=16)
    if packed:
        sched = Scheduler(blocks, max_slots=max_slots, max_prefill_rows=3, max_chunk=32,
                          max_num_batched_tokens=16, policy=policy,
                          fit_chunk=builder.fit_chunk, prefill_first=prefill_first)
    else:
        sched = Scheduler(blocks, max_slots=max_slots, max_prefill_rows=2, max_chunk=8,
                          max_num_batched_tokens=16, policy=policy, prefill_first=prefill_first)
    seqs = []
    for i, (plen, new, n) in enumerate(reqs):
        sp = SamplingParams(n=n, max_tokens=new)
        group = []
        for j in range(n):
            seq = Sequence(request_id=str(i), index=j, prompt_ids=[(i * 7 + k) % 50 + 1
                                                                   for k in range(plen)],
                           params=sp, seed=j)
            if j:
                seq.fork_from = group[0]
            group.append(seq)
            sched.add(seq)
        seqs += group
    steps = 0
    while sched.has_work():
        steps += 1
        assert steps < 5000, "scheduler made no progress"
        plan = sched.schedule(lookahead, max_len)
        check(sched, blocks, max_slots)
        assert not (set(map(id, plan.decode)) & {id(c.seq) for c in plan.prefill})
        if packed and plan.prefill:  # what the scheduler planned always fits a bucket
            builder.prefill_bucket([c.length for c in plan.prefill])
        for c in plan.prefill:
            c.seq.num_computed += c.length
            if c.final:
                c.seq.output_ids.append(1)
        for seq in plan.decode:  # a verify step may accept some drafts; pretend one
            seq.num_computed += 1
            seq.output_ids.append(2)
            blocks.truncate(seq.seq_id, seq.num_computed)
        for seq in list(sched.running):
            blocks.commit(seq.seq_id, seq.all_ids, min(seq.num_computed, seq.num_tokens))
            if seq.output_ids and (len(seq.output_ids) >= seq.params.max_tokens
                                   or seq.num_tokens >= max_len):
                sched.finish(seq, "length")
        if abort_every and steps % abort_every == 0 and sched.running:
            sched.finish(sched.running[0], "abort")
        check(sched, blocks, max_slots)
    assert all(s.finished for s in seqs)
    assert blocks.all_free()


def _plans(policy: str, prompt_lens: list[int], max_slots: int, prefill_first: bool = True,
           new_tokens: int = 3) -> list[tuple]:
    """Runs the scheduler with the device simulated; each step as (decode ids, prefill chunks)."""
    blocks = BlockManager(200, 4)
    sched = Scheduler(blocks, max_slots=max_slots, max_prefill_rows=3, max_chunk=8,
                      max_num_batched_tokens=12, policy=policy, prefill_first=prefill_first)
    for i, n in enumerate(prompt_lens):
        sched.add(Sequence(request_id=str(i), index=0, prompt_ids=list(range(1, n + 1)),
                           params=SamplingParams(max_tokens=new_tokens), seed=0))
    steps = []
    while sched.has_work():
        plan = sched.schedule()
        steps.append((tuple(s.request_id for s in plan.decode),
                      tuple((c.seq.request_id, c.start, c.length) for c in plan.prefill)))
        for c in plan.prefill:
            c.seq.num_computed += c.length
            if c.final:
                c.seq.output_ids.append(1)
        for seq in plan.decode:
            seq.num_computed += 1
            seq.output_ids.append(2)
        for seq in list(sched.running):
            blocks.commit(seq.seq_id, seq.all_ids, min(seq.num_computed, seq.num_tokens))
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
        assert len(steps) < 500
    return steps


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 30), min_size=1, max_size=8), spare=st.integers(0, 3),
       new_tokens=st.integers(1, 6))
@example(lens=[1, 9], spare=0, new_tokens=2)  # 10 tokens fit the budget, 9 not one chunk
def test_prefill_first_runs_static_batchings_steps_when_every_request_fits(lens, spare,
                                                                           new_tokens):
    """All requests at once, all fitting the slots: continuous plans the very steps static does
    (prefill-only steps, then decode), so it is never slower than static there."""
    slots = len(lens) + spare
    assert (_plans("continuous", lens, slots, new_tokens=new_tokens)
            == _plans("static", lens, slots, new_tokens=new_tokens))


def test_without_prefill_first_decode_joins_the_prompt_steps():
    lens = [7, 9, 5, 11, 6, 8]
    cont = _plans("continuous", lens, max_slots=6)
    # Without the rule, decode rows join the prompt steps, and the plan differs.
    mixed = _plans("continuous", lens, max_slots=6, prefill_first=False)
    assert any(d and p for d, p in mixed) and mixed != cont


def test_prefill_first_keeps_mixing_while_requests_wait_for_slots():
    """More requests than slots: a freed slot admits the next request beside the decode rows
    (no prefill-only stall), exactly as without the rule."""
    lens = [7, 9, 5, 11, 6, 8, 10, 4]
    cont = _plans("continuous", lens, max_slots=3)
    assert any(d and p for d, p in cont)
    assert cont == _plans("continuous", lens, max_slots=3, prefill_first=False)
