"""The host batch (llmserve/batch.py): bucket choice stays inside the compiled shapes, tokens land
where their block tables say, and the host modules import no jax."""

import ast
import pathlib

import numpy as np
import pytest

from llmserve.batch import BatchBuilder, ScheduledRow
from llmserve.kv_cache import DUMMY_PAGE

ROOT = pathlib.Path(__file__).resolve().parents[1] / "llmserve"
HOST_MODULES = ["batch.py", "engine.py", "scheduler.py", "block_manager.py", "outputs.py",
                "speculative/policy.py", "speculative/controller.py"]


def _builder(**kw):
    args = dict(vocab_size=50, page_size=4, pages_per_seq=8, max_slots=8,
                decode_buckets=[1, 4, 8], prefill_buckets=[(1, 8), (2, 16)],
                num_speculative_tokens=2)
    args.update(kw)
    return BatchBuilder(**args)


def _row(start, tokens, table, slot):
    return ScheduledRow(tokens=tokens, start=start, block_table=table, slot=slot, emit=True,
                        sampling={})


@pytest.mark.parametrize("module", HOST_MODULES)
def test_host_modules_import_no_jax(module):
    """DESIGN's rule: host files import no jax or flax (the runner owns every device call)."""
    tree = ast.parse((ROOT / module).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in names if m.split(".")[0] in ("jax", "flax")], module


def test_every_prepared_shape_is_compiled():
    """Whatever mix of rows is scheduled, the batch takes one of ``step_shapes()``."""
    b = _builder()
    shapes = set(b.step_shapes())
    for n_dec in range(0, 9):
        for n_pre, chunk in [(0, 0), (1, 5), (2, 12)]:
            for verify in (False, True):
                dec = [_row(10, [1, 2, 3][: 3 if verify else 1], [1, 2, 3, 4], i)
                       for i in range(n_dec)]
                pre = [_row(0, list(range(chunk)), [5, 6, 7, 8], 8 - i) for i in range(n_pre)]
                if not dec and not pre:
                    continue
                batch = b.prepare(dec, pre, verify=verify)
                parts = [(p.block_tables.shape[0], p.t) for p in batch.parts]
                d = parts[0][0] if dec else 0
                w = parts[0][1] if dec else 1
                p = parts[-1] if pre else None
                assert (d, p, w if batch.verify else 1) in shapes, (n_dec, n_pre, verify)
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        b.decode_bucket(9)


def test_verify_token_cap_narrows_the_rows_of_large_verify_buckets():
    """``max_verify_tokens``: a verify bucket of b rows carries max(1, cap // b - 1) drafts a
    row (at most D), its compiled width follows, a verify step of that bucket is built at that
    width (and is one of the compiled shapes), and a row with more tokens is refused."""
    b = _builder(num_speculative_tokens=5, max_verify_tokens=16,
                 verify_buckets=[1, 2, 4, 8])
    assert [b.verify_drafts(n) for n in (1, 2, 4, 8)] == [5, 5, 3, 1]
    verify_shapes = [s for s in b.step_shapes() if s[2] > 1]
    assert verify_shapes == [(1, None, 6), (2, None, 6), (4, None, 4), (8, None, 2),
                             (8, (1, 8), 2), (8, (2, 16), 2)]
    for n, width in [(1, 6), (3, 4), (5, 2)]:
        rows = [_row(10, [1] * width, [1, 2, 3, 4], i) for i in range(n)]
        batch = b.prepare(rows, verify=True)
        part = batch.parts[0]
        assert part.t == width
        assert (part.block_tables.shape[0], None, part.t) in verify_shapes
    with pytest.raises(ValueError, match="takes at most 4"):
        b.prepare([_row(10, [1] * 5, [1, 2, 3, 4], i) for i in range(3)], verify=True)
    assert _builder(num_speculative_tokens=5).verify_drafts(8) == 5  # no cap: D everywhere
    with pytest.raises(ValueError, match="max_verify_tokens"):
        _builder(max_verify_tokens=1)


def test_live_counts_end_at_the_last_real_token_and_row():
    """``StepInput.live`` = (tokens, rows): every real token sits before live[0] and every real
    sampled row before live[1] (the native matmuls skip what follows); a verify row counts
    whole (a device lookup may fill drafts past its tokens); all padding gives (0, 0)."""
    b = _builder()
    for n_dec in range(0, 9):
        for n_pre, chunk in [(0, 0), (1, 5), (2, 12)]:
            for verify in (False, True):
                dec = [_row(10, [1, 2][: 2 if verify else 1], [1, 2, 3, 4], i)
                       for i in range(n_dec)]
                pre = [_row(0, list(range(chunk)), [5, 6, 7, 8], 8 - i) for i in range(n_pre)]
                if not dec and not pre:
                    continue
                batch = b.prepare(dec, pre, verify=verify)
                tok, rows = (int(v) for v in batch.live)
                real = np.flatnonzero(batch.write_page != DUMMY_PAGE)
                # The last verify row holds 2 tokens in a part 3 wide: one more counts.
                whole_row = 1 if verify and n_dec and not pre else 0
                assert tok == real.max() + 1 + whole_row, (n_dec, n_pre, verify)
                assert rows == np.flatnonzero(batch.emit).max() + 1  # padding rows never emit
    assert list(b.prepare([_row(3, [4], [1], 0), _row(5, [6], [2, 3], 1)]).live) == [2, 2]
    assert list(b.empty_batch((8, (2, 16), 1)).live) == [0, 0]
    # A timing batch (``full``) computes every padding token and row, as real ones would be:
    # 8 decode tokens + 2 x 16 prefill tokens, 8 + 2 sampled rows; 4 verify rows of 3 tokens.
    assert list(b.empty_batch((8, (2, 16), 1), full=True).live) == [8 + 32, 8 + 2]
    assert list(b.empty_batch((4, None, 3), full=True).live) == [12, 4]


def test_tokens_land_where_their_block_tables_say():
    """Each real token's position, page and offset follow its row's block table; padding
    writes to the dummy page; each row samples from its last real token."""
    b = _builder()
    dec = [_row(6, [7], [3, 9], 0), _row(2, [4], [5], 1)]
    pre = [_row(4, [11, 12, 13], [2, 6, 10], 2)]
    batch = b.prepare(dec, pre)
    d = batch.parts[0].block_tables.shape[0]  # decode rows [d, 1], then the chunk row
    flat = [(row, 0) for row in dec] + [(pre[0], i) for i in range(3)]
    flat_index = list(range(len(dec))) + [d + i for i in range(3)]
    for k, (row, i) in zip(flat_index, flat):
        pos = row.start + i
        assert batch.tokens[k] == row.tokens[i] and batch.positions[k] == pos
        assert batch.write_page[k] == row.block_table[pos // 4]
        assert batch.write_offset[k] == pos % 4
    pad = np.setdiff1d(np.arange(len(batch.tokens)), flat_index)
    assert (batch.write_page[pad] == DUMMY_PAGE).all()
    assert list(batch.sample_index[:2]) == [0, 1] and batch.sample_index[d] == d + 2
    assert list(batch.slot_ids[:2]) == [0, 1] and batch.slot_ids[d] == 2
    assert batch.sample_pos[d] == 7  # the token after the chunk's last, at position 6


def test_default_decode_buckets_follow_the_measured_matmul_costs():
    """bf16 on XLA's dot starts at 8 rows (1-8 rows cost the same there); fp32, and bf16 on the
    native matmul (no slow one-row path), keep a 1-row bucket for the last running request."""
    from llmserve.batch import default_decode_buckets

    assert default_decode_buckets(32, "bfloat16") == [8, 16, 24, 32]
    assert default_decode_buckets(32, "bfloat16", native_bf16_matmul=True) == [1, 8, 16, 24, 32]
    assert default_decode_buckets(32, "float32") == [1, 8, 16, 24, 32]
    assert default_decode_buckets(16, "float32") == [1, 8, 16]
    assert default_decode_buckets(100, "float32") == [1, 8, 16, 24, 32, 48, 64, 96, 100]
    assert default_decode_buckets(4, "bfloat16") == [4]


def test_a_long_chunk_spans_consecutive_rows_and_samples_once():
    """Chunks longer than the part's t take ceil(len / t) rows of one sequence (q_start and
    lengths per block, the same block table); tokens stay contiguous in flat order, and each
    chunk, not each block, gets one sampled row (the part samples min(B, max_prefill_seqs))."""
    b = _builder(prefill_buckets=[(2, 4), (8, 4)], max_prefill_seqs=3)
    pre = [_row(4, list(range(10, 19)), [2, 6, 10, 11], 2), _row(0, [1, 2], [3], 5)]
    assert b.prefill_bucket([9, 2]) == (8, 4)  # 3 + 1 rows: only the 8-row bucket holds them
    batch = b.prepare([], pre)
    (part,) = batch.parts
    assert (part.block_tables.shape[0], part.t, part.num_samples) == (8, 4, 3)
    assert list(part.q_start[:4]) == [4, 8, 12, 0]
    assert list(part.lengths[:4]) == [8, 12, 13, 2]
    assert (part.block_tables[:3, :4] == [2, 6, 10, 11]).all() and part.block_tables[3, 0] == 3
    assert (part.lengths[4:] == 0).all()
    assert list(batch.tokens[:9]) == list(range(10, 19)) and list(batch.tokens[12:14]) == [1, 2]
    assert list(batch.positions[:9]) == list(range(4, 13))
    assert batch.write_page[8] == 11 and batch.write_offset[8] == 0  # position 12
    assert (batch.write_page[9:12] == DUMMY_PAGE).all()  # the first chunk's partial block
    assert list(batch.sample_index) == [8, 13, batch.sample_index[2]]
    assert list(batch.sample_pos[:2]) == [13, 2]
    assert list(batch.slot_ids) == [2, 5, 8] and list(batch.emit) == [True, True, False]
    shapes = set(b.step_shapes())
    assert (0, (8, 4), 1) in shapes
    with pytest.raises(ValueError, match="no prefill bucket"):
        b.prefill_bucket([4] * 4)  # four chunks: more than max_prefill_seqs


def test_fit_chunk_fills_buckets_and_defers_a_small_spill():
    """The next chunk takes what fits; when a few tokens would spill into a bucket twice the
    size, it stops at the smaller bucket's room and the rest waits a step."""
    b = _builder(prefill_buckets=[(2, 16), (8, 16), (16, 16), (32, 16)], max_prefill_seqs=4,
                 trim_from=128)
    assert b.fit_chunk([], 40) == 40  # the 128 bucket: nothing smaller is worth trimming to
    assert b.fit_chunk([], 140) == 128  # 140 would need the 256 bucket for 12 tokens
    assert b.fit_chunk([], 200) == 200  # 72 past 128: the 256 bucket pays for itself
    assert b.fit_chunk([], 1000) == 512  # at most the largest part
    assert b.fit_chunk([128], 10) == 0  # 128 fills its bucket: 10 more wait a step
    assert b.fit_chunk([128], 100) == 100
    assert b.fit_chunk([16] * 4, 16) == 0  # four chunks: max_prefill_seqs reached
    assert b.fit_chunk([], 1) == 1
    assert _builder(prefill_buckets=[(2, 16), (8, 16), (16, 16)], trim_from=512).fit_chunk(
        [], 140) == 140  # trimming only from trim_from tokens up
    for lengths in ([], [5], [20, 3], [64, 64], [128]):
        for want in (1, 7, 33, 90, 300):
            got = b.fit_chunk(lengths, want)
            assert 0 <= got <= want and (got or lengths)
            if got:
                b.prefill_bucket([*lengths, got])  # what it gives always fits a bucket


def test_packed_step_inputs_round_trip():
    """runner.pack_inputs / unpack_inputs: a built verify + prefill StepInput (int32, uint32,
    float32 and bool leaves) travels as one int32 buffer and comes back bit for bit, with its
    static fields; NaN and negative floats and the high uint32 bits survive the bitcasts."""
    import jax

    from llmserve.runner import pack_inputs, unpack_inputs

    b = _builder()
    rows = [_row(5, [7, 8, 9], [1, 2], 0)]
    pre = [ScheduledRow(tokens=list(range(1, 12)), start=0, block_table=[3, 4, 5], slot=1,
                        emit=True, sampling={"temperature": 0.7, "seed": 2**32 - 3})]
    batch = b.prepare(rows, pre, verify=True)
    batch = batch.replace(sampling=batch.sampling.replace(
        top_p=np.array([np.nan, -0.0] + [1.0] * (len(batch.sampling.top_p) - 2), np.float32)))
    buf, layout = pack_inputs(batch)
    assert buf.dtype == np.int32 and buf.ndim == 1
    back = jax.jit(unpack_inputs, static_argnums=1)(buf, layout)
    assert back.verify and [p.t for p in back.parts] == [p.t for p in batch.parts]
    want, got = jax.tree_util.tree_leaves(batch), jax.tree_util.tree_leaves(back)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        w, g = np.asarray(w), np.asarray(g)
        assert w.dtype == g.dtype and w.shape == g.shape
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))  # bit for bit
    with pytest.raises(TypeError, match="int64"):
        pack_inputs({"x": np.zeros(3, np.int64)})


def test_default_buckets_pad_a_freed_slots_prompt_by_less_than_half_its_length():
    """The engine's default prefill buckets step by at most 1.5x: one prompt of 65-512 tokens
    (a freed slot's admission) pads by less than half its length, so a 90-token prompt rides
    in 96 flat tokens (the powers of two alone padded a 65-token prompt to 128)."""
    from llmserve.engine_config import EngineConfig

    b = _builder(prefill_buckets=EngineConfig().prefill_buckets, page_size=16, pages_per_seq=64)
    for n in range(65, 513):
        rows, c = b.prefill_bucket([n])
        assert n <= rows * c < 1.5 * n, (n, rows, c)
    assert b.prefill_bucket([90]) == (12, 8)
