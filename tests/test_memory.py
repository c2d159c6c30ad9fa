"""``laplace_diffjac.memory``: the opt-in allocator setting changes what the kernel
sees, ends with its block (also after an exception), and nothing calls it unasked.

The setting is process-wide and glibc cannot turn its dynamic mmap threshold back
on, so every test that sets it runs in a fresh subprocess; the observables are the
process's minor page faults while a freed 64 MiB tensor is allocated again, and the
resident memory left after freeing it (``/proc/self/status``), never a timing.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

import pytest

import laplace_diffjac
from laplace_diffjac import memory
from tests.docs import block, page
from tests.processes import ROOT, python_env

GLIBC = pytest.mark.skipif(
    not memory.can_keep_freed_memory(),
    reason="needs glibc's malloc on Linux (not macOS, Windows, musl or a preloaded "
    "allocator): the setting is a no-op there",
)

#: Variables that would change glibc's or PyTorch's allocator in the subprocess.
ALLOCATOR_VARIABLES = (
    "GLIBC_TUNABLES",
    "MALLOC_MMAP_MAX_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "THP_MEM_ALLOC_ENABLE",
)

#: ``cycle(size)`` allocates, frees and reallocates a tensor of ``size`` MiB,
#: ``rounds`` times, and reports the last round: the MiB glibc mapped for it on its
#: own (``mallinfo2``'s ``hblkhd``), the MiB the kernel got back at the free, and the
#: page faults of the reallocation. Kept blocks need a few rounds before one fits
#: the next request (``posix_memalign`` asks for a little more than it keeps).
CYCLE = """
import ctypes, json, resource, torch

LIBC = ctypes.CDLL(None)
INFO, FIELD = (
    ("mallinfo2", ctypes.c_size_t) if hasattr(LIBC, "mallinfo2")
    else ("mallinfo", ctypes.c_int)  # glibc < 2.33
)

class Info(ctypes.Structure):
    _fields_ = [(name, FIELD) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

getattr(LIBC, INFO).restype = Info

def info(field):
    return getattr(getattr(LIBC, INFO)(), field) / 2**20

def rss_mib():
    with open("/proc/self/status") as fh:
        line = next(line for line in fh if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def cycle(size=64, rounds=6):
    n = (size << 20) // 4
    for _ in range(rounds):
        mapped = info("hblkhd")
        x = torch.ones(n)
        mapped = info("hblkhd") - mapped
        held = rss_mib()
        del x
        returned = held - rss_mib()
        count = faults()
        y = torch.ones(n)
        count = faults() - count
        del y
    return {"size": size, "mapped_mib": mapped, "returned_mib": returned,
            "faults": count}

def beyond_the_heap():
    return int(info("fordblks")) + 16  # MiB: no free chunk of the heap fits it
"""


def _run(code: str) -> dict:
    """Run ``CYCLE + code`` in a fresh interpreter; the JSON of its last line."""
    env = {k: v for k, v in python_env().items() if k not in ALLOCATOR_VARIABLES}
    proc = subprocess.run(
        [sys.executable, "-c", CYCLE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _is_default(row: dict) -> bool:
    """glibc mapped the block, unmapped it at the free, and faulted in a fresh one."""
    size = row["size"]
    mapped, returned = row["mapped_mib"], row["returned_mib"]
    return mapped >= size and returned > 0.75 * size and row["faults"] >= 16


def _keeps(row: dict, default: dict) -> bool:
    """The block came from the heap, stayed resident and was reused in place."""
    unmapped = row["mapped_mib"] < 1 and row["returned_mib"] < 16
    return unmapped and 4 * row["faults"] < default["faults"]


@GLIBC
@pytest.mark.slow
def test_the_setting_keeps_freed_memory_and_ends_with_its_block():
    rows = _run(
        """
        from torch import nn
        from laplace_diffjac import DiffBackPackGGN, ntk
        from laplace_diffjac.memory import keep_freed_memory

        # the package's own work leaves the allocator as it was
        model = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 10))
        backend = DiffBackPackGGN(model, "classification")
        x = torch.randn(64, 20, requires_grad=True)
        J, _ = backend.jacobians(x, enable_backprop=True)
        torch.autograd.grad(ntk(backend, x).square().sum() + J.sum(), x)
        rows = {"default": cycle(rounds=1)}
        with keep_freed_memory() as applied:
            pass
        rows["after an empty block"] = cycle(rounds=1)
        try:
            with keep_freed_memory():
                raise KeyError("inside the block")
        except KeyError:
            pass
        rows["after an exception"] = cycle(rounds=1)
        with keep_freed_memory():
            rows["inside"] = cycle()
            with keep_freed_memory(trim_threshold=1 << 29):
                pass
            rows["after an inner block"] = cycle(beyond_the_heap(), rounds=1)
            held = rss_mib()
        rows["returned_mib"] = held - rss_mib()
        rows["after"] = cycle(beyond_the_heap(), rounds=1)
        print(json.dumps({**rows, "applied": applied}))
        """
    )
    assert rows.pop("applied") is True
    default = rows["default"]
    for name in ("default", "after an empty block", "after an exception", "after"):
        assert _is_default(rows[name]), (name, rows)
    for name in ("inside", "after an inner block"):
        assert _keeps(rows[name], default), (name, rows)
    assert rows["returned_mib"] > 48, rows  # malloc_trim(0) at the end


@GLIBC
@pytest.mark.slow
def test_start_and_stop_and_the_memory_returned_at_the_end():
    rows = _run(
        """
        from laplace_diffjac import memory

        rows = {"stop before start": memory.stop_keeping_freed_memory()}
        rows["default"] = cycle(rounds=1)
        rows["started"] = memory.start_keeping_freed_memory()
        rows["kept"] = cycle()
        held = rss_mib()
        rows["stopped"] = memory.stop_keeping_freed_memory()
        rows["returned_mib"] = held - rss_mib()
        rows["after"] = cycle(beyond_the_heap(), rounds=1)
        rows["stop again"] = memory.stop_keeping_freed_memory()
        print(json.dumps(rows))
        """
    )
    assert rows["stop before start"] is False and rows["stop again"] is False
    assert rows["started"] is True and rows["stopped"] is True
    assert _keeps(rows["kept"], rows["default"]), rows
    assert rows["returned_mib"] > 48, rows  # malloc_trim(0) gave the kept blocks back
    assert _is_default(rows["after"]), rows


@GLIBC
@pytest.mark.slow
def test_the_speed_page_example_runs_and_puts_the_allocator_back():
    code = block("docs-keep-freed-memory", page("speed.md"))
    rows = _run(
        code
        + """
print(json.dumps({"after": cycle(beyond_the_heap(), rounds=1)}))
"""
    )
    assert _is_default(rows["after"]), rows


def test_elsewhere_every_function_is_a_no_op_or_raises_when_required(monkeypatch):
    monkeypatch.setattr(memory._MALLOC, "library", None)  # as on macOS or musl
    assert memory.can_keep_freed_memory() is False
    assert memory.start_keeping_freed_memory() is False
    assert memory.stop_keeping_freed_memory() is False
    with memory.keep_freed_memory() as applied:
        assert applied is False
    with pytest.raises(OSError, match="glibc's malloc on Linux"):
        memory.start_keeping_freed_memory(required=True)
    with pytest.raises(OSError, match="glibc's malloc on Linux"):
        with memory.keep_freed_memory(required=True):
            pass  # pragma: no cover
    assert memory._MALLOC.current is None


@pytest.mark.parametrize("threshold", [-1, 2**31])
def test_a_trim_threshold_outside_a_c_int_is_refused(monkeypatch, threshold):
    monkeypatch.setattr(memory._MALLOC, "library", None)  # nothing is ever set
    with pytest.raises(ValueError, match="trim_threshold"):
        memory.start_keeping_freed_memory(threshold)
    with pytest.raises(ValueError, match="trim_threshold"):
        with memory.keep_freed_memory(threshold):
            pass  # pragma: no cover


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, (65536, 128 * 1024)),
        ({"MALLOC_MMAP_MAX_": "7", "MALLOC_TRIM_THRESHOLD_": "010"}, (7, 8)),
        (
            {
                "GLIBC_TUNABLES": "glibc.malloc.mmap_max=5:glibc.malloc.trim_threshold"
                "=0x100:glibc.cpu.hwcaps=-AVX2",
                "MALLOC_MMAP_MAX_": "7",
            },
            (5, 256),
        ),
        ({"MALLOC_TRIM_THRESHOLD_": "lots", "MALLOC_MMAP_MAX_": "-3"}, (65536, 131072)),
        ({"MALLOC_TRIM_THRESHOLD_": str(1 << 40)}, (65536, 2**31 - 1)),
    ],
)
def test_the_values_restored_are_those_glibc_started_with(environment, expected):
    values = memory._start_values(environment)
    assert (values.mmap_max, values.trim_threshold) == expected


def test_nothing_in_the_package_calls_the_setting():
    """Only ``memory.py`` names ``mallopt``; no module imports or calls it."""
    package = ROOT / "laplace_diffjac"
    public = set(memory.__all__)
    for path in sorted(package.rglob("*.py")):
        if path == package / "memory.py":
            continue
        text = path.read_text()
        assert "mallopt" not in text and "malloc_trim" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                names = {a.name for a in node.names} | {node.module or ""}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            elif isinstance(node, (ast.Name, ast.Attribute)):
                names = {getattr(node, "id", None) or getattr(node, "attr", "")}
            else:
                continue
            assert not names & (public | {"memory", "laplace_diffjac.memory"}), path
    assert not public & set(laplace_diffjac.__all__)
