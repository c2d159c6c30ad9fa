"""``laplace_diffjac.budget``: reading sizes, setting the budget, its defaults."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

import laplace_diffjac
from laplace_diffjac.budget import (
    CPU_DEFAULT_BYTES,
    format_bytes,
    get_memory_budget,
    memory_budget,
    parse_bytes,
    set_memory_budget,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        (1.5e9, 1_500_000_000),
        ("512 MiB", 512 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5 gb", 1_500_000_000),
        (" 100 ", 100),
        ("3 KiB", 3072),
    ],
)
def test_sizes_are_read_in_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["two GiB", "2 GiBs", "", "0", -5, "1e-3"])
def test_unreadable_or_empty_sizes_are_refused_with_the_form_to_use(bad):
    with pytest.raises(ValueError, match="memory"):
        parse_bytes(bad)


def test_sizes_are_written_in_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"
    assert format_bytes(2.5 * 2**30) == "2.50 GiB"


def test_the_cpu_default_is_two_gib():
    assert CPU_DEFAULT_BYTES == 2 * 2**30
    ctx = contextvars.Context()  # a context in which nothing was set
    assert ctx.run(get_memory_budget, "cpu") == 2 * 2**30
    assert ctx.run(get_memory_budget) == 2 * 2**30


def test_a_with_block_sets_the_budget_and_puts_the_previous_one_back():
    outer = get_memory_budget()
    with memory_budget("1 GiB"):
        assert get_memory_budget() == 2**30
        with memory_budget(4096):
            assert get_memory_budget() == 4096
        assert get_memory_budget() == 2**30
    assert get_memory_budget() == outer
    with pytest.raises(KeyError), memory_budget("8 MiB"):
        raise KeyError("inside")
    assert get_memory_budget() == outer


def test_set_memory_budget_holds_in_its_context_and_none_restores_the_default():
    def body():
        assert set_memory_budget("3 GiB") is None
        assert get_memory_budget("cpu") == 3 * 2**30
        assert set_memory_budget(None) == 3 * 2**30
        assert get_memory_budget("cpu") == CPU_DEFAULT_BYTES

    contextvars.Context().run(body)
    assert get_memory_budget() == CPU_DEFAULT_BYTES  # this context was never touched


def test_a_thread_started_elsewhere_does_not_see_a_with_blocks_budget():
    seen = []
    with memory_budget("1 MiB"):
        worker = threading.Thread(target=lambda: seen.append(get_memory_budget()))
        worker.start()
        worker.join()
    assert seen == [CPU_DEFAULT_BYTES]


def test_the_package_exports_the_setting():
    assert laplace_diffjac.set_memory_budget is set_memory_budget
    assert laplace_diffjac.memory_budget is memory_budget
    assert issubclass(laplace_diffjac.MemoryBudgetError, MemoryError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_gpu_default_is_a_quarter_of_the_free_memory():
    free, _ = torch.cuda.mem_get_info()
    got = contextvars.Context().run(get_memory_budget, "cuda")
    assert abs(got - free / 4) <= 0.05 * free
