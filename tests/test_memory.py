"""The CPU KV pool's memory: zero-filled, an ordinary writable tensor, and backed by 2 MB pages where
Linux's transparent huge pages are on for memory that asks (``zeros_on_huge_pages``)."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.memory import HUGE_PAGE_BYTES, zeros_on_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_kib_under(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_pool_is_zero_and_behaves_as_any_tensor():
    shape = (2, 2, 40, 16, 3, 64)                       # 3.75 MiB: large enough to ask for huge pages
    pool = zeros_on_huge_pages(shape, torch.float32)
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert int(pool.count_nonzero()) == 0
    pool[1, 0, 7] = 2.5
    alias = pool.view(-1)                               # views share the memory, as with torch.zeros
    assert float(alias.sum()) == 2.5 * 16 * 3 * 64
    small = zeros_on_huge_pages((3, 5), torch.bfloat16)  # below a huge page: plain torch.zeros
    assert small.dtype == torch.bfloat16 and int(small.count_nonzero()) == 0


def test_the_memory_lives_as_long_as_the_tensor():
    pool = zeros_on_huge_pages((4 * HUGE_PAGE_BYTES // 4,), torch.float32)[HUGE_PAGE_BYTES // 4:]
    gc.collect()                                        # nothing but the view holds the mapping now
    pool.fill_(1.0)
    assert float(pool.sum()) == pool.numel()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP_SETTING.exists()
                    or "[never]" in THP_SETTING.read_text(),
                    reason="needs Linux with transparent huge pages not set to 'never'")
def test_linux_backs_the_engines_kv_pool_with_huge_pages(tiny_model):
    engine = Engine(tiny_model, num_blocks=2048, block_size=16)
    pool = engine.kv_cache
    assert pool.numel() * pool.element_size() >= 4 * HUGE_PAGE_BYTES
    assert huge_page_kib_under(pool.data_ptr()) >= 2 * HUGE_PAGE_BYTES // 1024
    out = engine.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
