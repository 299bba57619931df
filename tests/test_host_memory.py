"""Opt-in host allocator settings (llmserve/host_memory.py): with ``LLMSERVE_MALLOC_TUNING=1``,
XLA:CPU's large per-call buffers stop page-faulting once ``import llmserve`` has set glibc's
malloc up, and a process that started JAX first is told how to get the same from the environment.

Each case is a fresh subprocess, since the settings only take effect before XLA's threads exist.
The oracle is the same program without the opt-in (``LLMSERVE_MALLOC_TUNING`` unset).
"""

import json
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc mallopt calls; elsewhere they are a no-op")

# A jitted call that allocates (and, once the result is dropped, frees) 64 MiB, over glibc's
# largest mmap threshold (32 MiB), like a wide step's logits: minor page faults per call are
# counted with getrusage.
FAULTS = r"""
import jax, jax.numpy as jnp
x = jnp.ones((512, 64), jnp.float32)
w = jnp.full((64, 32768), 1e-3, jnp.float32)

@jax.jit
def f(x, w):
    return jnp.tanh(x @ w)  # a 64 MiB buffer, freed when the caller drops it

for _ in range(20):  # until the heap has grown to its working size (a few calls to ~10)
    f(x, w).block_until_ready()
faults = []
for _ in range(9):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(faults)[len(faults) // 2]  # the median call (the heap may still grow once)
"""
PROGRAM = r"""
import json, logging, resource, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
if sys.argv[1] == "jax_first":
    import jax.numpy as jnp
    jnp.ones(1).block_until_ready()  # starts the CPU backend before llmserve is imported
import llmserve
from llmserve import host_memory
""" + FAULTS + r"""
print(json.dumps({"status": host_memory.status, "faults_per_call": faults}))
"""

PAGES = 64 * 2**20 // 4096  # pages in the temporary


def run(mode, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "LLMSERVE_MALLOC_TUNING"}
    env.update(JAX_PLATFORMS="cpu", **extra)
    proc = subprocess.run([sys.executable, "-c", PROGRAM, mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_import_sets_malloc_up_so_large_temporaries_stop_faulting():
    tuned, _ = run("llmserve_first", LLMSERVE_MALLOC_TUNING="1")
    default, _ = run("llmserve_first")
    assert tuned["status"] == "applied" and default["status"] == "disabled"
    # Without the settings every call maps the temporary afresh and faults on each of its pages;
    # with them the freed heap is reused: (almost) no faults.
    assert default["faults_per_call"] > 0.5 * PAGES, default
    assert tuned["faults_per_call"] < 0.02 * PAGES, tuned


def test_too_late_warns_with_the_environment_fix_and_changes_nothing():
    late, stderr = run("jax_first", LLMSERVE_MALLOC_TUNING="1")
    assert late["status"] == "too_late"
    assert "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0" in stderr  # says how to fix it
    assert late["faults_per_call"] > 0.5 * PAGES  # nothing was applied behind the backend's back
    # The environment route at process start does what the import would have done.
    env_fix, stderr = run("jax_first", LLMSERVE_MALLOC_TUNING="1", MALLOC_ARENA_MAX="1",
                          MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))
    assert env_fix["status"] == "environment" and "MALLOC_ARENA_MAX" not in stderr
    assert env_fix["faults_per_call"] < 0.02 * PAGES, env_fix


# ------------------------------------------------------------------ transparent huge pages
from llmserve import host_memory  # noqa: E402

HUGE = "glibc.malloc.hugetlb=1"
GLIBC = ("glibc", "2.36")


def test_hugepage_env_adds_the_tunable_once_and_only_where_it_changes_something():
    env = host_memory.hugepage_env({"A": "1"}, libc=GLIBC, thp="madvise", system="linux")
    assert env["GLIBC_TUNABLES"] == HUGE and env["A"] == "1"
    assert env[host_memory.REEXEC_MARK] == ""  # the launch value: none
    # The user's own tunables are kept (glibc's ':'-separated list) and remembered.
    env2 = host_memory.hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, libc=GLIBC,
                                    thp="madvise", system="linux")
    assert env2["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1:" + HUGE
    assert host_memory.launch_environ(env2) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}
    assert host_memory.launch_environ(env) == {"A": "1"}
    assert host_memory.hugepages_active(env) and not host_memory.hugepages_active({"A": "1"})
    # Nothing to do: already re-executed (never a loop), opted out, the user chose a value
    # (even 0), THP "always" (already huge) or "never" (refused), not glibc >= 2.35 on Linux.
    for environ, kw in (
            (env, {}),
            ({host_memory.HUGEPAGES_OPT_OUT: "0"}, {}),
            ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}),
            ({}, {"thp": "always"}), ({}, {"thp": "never"}), ({}, {"libc": ("glibc", "2.34")}),
            ({}, {"libc": ("", "")}), ({}, {"system": "darwin"})):
        kw = {"libc": GLIBC, "thp": "madvise", "system": "linux", **kw}
        assert host_memory.hugepage_env(environ, **kw) is None, (environ, kw)


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert host_memory.thp_mode(str(f)) == "madvise"
    assert host_memory.thp_mode(str(tmp_path / "missing")) is None


# An entry point that re-executes itself, then reports what its malloc does with the same 64 MiB
# temporary as PROGRAM (minor faults per call; 2 MiB pages fault 512x less often).
ENTRY = r"""
import json, os, resource, sys
from llmserve import host_memory
host_memory.reexec_with_hugepages()
""" + FAULTS + r"""
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES", ""),
                  "launch": host_memory.launch_environ().get("GLIBC_TUNABLES"),
                  "faults_per_call": faults}))
"""


@pytest.mark.skipif(host_memory.hugepage_env({}) is None,
                    reason="needs glibc >= 2.35 and a kernel whose THP mode is 'madvise'")
def test_an_entry_point_reexecutes_with_huge_pages_and_stops_faulting_per_4k_page(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)

    def run_entry(**extra):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LLMSERVE_"))}
        env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    huge = run_entry()
    plain = run_entry(**{host_memory.HUGEPAGES_OPT_OUT: "0"})  # the oracle: no re-exec
    assert huge["tunables"] == HUGE and huge["launch"] is None  # what the user launched with
    assert plain["tunables"] == ""
    # 4 KiB pages: a fault per page of the fresh temporary; huge pages: ~1 per 2 MiB.
    assert plain["faults_per_call"] > 0.5 * PAGES, plain
    assert huge["faults_per_call"] < 0.05 * PAGES, huge
