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

    assert default_decode_buckets(32, "bfloat16") == [8, 16, 32]
    assert default_decode_buckets(32, "bfloat16", native_bf16_matmul=True) == [1, 8, 16, 32]
    assert default_decode_buckets(32, "float32") == [1, 8, 16, 32]
    assert default_decode_buckets(4, "bfloat16") == [4]
