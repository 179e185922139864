"""The CPU KV pool's memory: zero-filled, an ordinary writable tensor, and backed by 2 MB pages where
Linux's transparent huge pages are on for memory that asks (``zeros_on_huge_pages``)."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.kernels.huge_pages import HUGE_PAGE_BYTES, copies_on_huge_pages, zeros_on_huge_pages

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


def test_weight_copies_share_one_buffer_and_keep_values_shapes_and_strides():
    """copies_on_huge_pages: every tensor copied end to end into one buffer (64-byte aligned), values, dtypes,
    shapes and strides kept, a transposed ([in, out]-stored) weight included; a small total is left alone."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(700, 577, generator=gen), torch.randn(96, 1000, generator=gen).t(),
               torch.randint(-127, 128, (1001, 513), dtype=torch.int8, generator=gen)]
    copies = copies_on_huge_pages(weights)
    for original, copy in zip(weights, copies):
        assert torch.equal(copy, original) and copy.dtype == original.dtype
        assert copy.stride() == original.stride() and copy.data_ptr() != original.data_ptr()
        assert copy.data_ptr() % 64 == 0
    starts = [c.data_ptr() for c in copies]
    assert starts == sorted(starts) and starts[-1] - starts[0] < sum(w.nbytes + 64 for w in weights[:-1])
    gc.collect()
    copies[0].fill_(1.0)                                 # the views keep the buffer alive and writable
    assert float(copies[0].sum()) == copies[0].numel()
    small = [torch.randn(3, 5)]
    assert copies_on_huge_pages(small)[0] is small[0]
    with pytest.raises(ValueError, match="contiguous"):
        copies_on_huge_pages([torch.randn(2000, 600)[:, ::2]])


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_the_engine_reads_its_weights_from_one_buffer(tmp_path, quantization):
    """On a CPU every layer matrix and the LM head (tied to the embedding here) are placed in one buffer, the
    weights transformers shares with the engine are re-pointed at it (never held twice), and greedy tokens are
    still transformers' (fp32) or the int8 engine's own (int8, placement changes no value)."""
    from minipaged.kernels.int8 import Int8Weight
    from minipaged.model.testing import build_tiny_llama
    path = str(build_tiny_llama(tmp_path / "m", hidden_size=512, intermediate_size=2048, num_layers=2))
    engine = Engine(path, num_blocks=64, block_size=16, quantization=quantization)
    model = engine.model

    def raw(w):
        return w.qweight if isinstance(w, Int8Weight) else w
    weights = [raw(getattr(layer, name)) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    weights.append(raw(model.lm_head))
    starts = [w.data_ptr() for w in weights]
    assert starts == sorted(starts)
    assert starts[-1] - starts[0] < sum(w.nbytes + 64 for w in weights[:-1])      # end to end: one buffer
    if quantization is None:
        assert model.embed.data_ptr() == model.lm_head.data_ptr()                 # tied: one copy for both
        hf = engine.loaded.hf_model
        assert hf.model.layers[0].self_attn.o_proj.weight.data_ptr() == model.layers[0].o.data_ptr()
        assert hf.model.layers[1].mlp.down_proj.weight.data_ptr() == model.layers[1].down.data_ptr()
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr() == model.lm_head.data_ptr()
        prompt = [5, 9, 200, 17, 3]
        ours = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        assert ours == want[0, len(prompt):].tolist()


def test_weights_are_placed_one_at_a_time_and_transformers_follows_each_at_once(tmp_path, monkeypatch):
    """Placing never holds every weight twice: before the next weight is copied, the engine and transformers'
    module already point at the previous copy, so its original can be freed (TinyLlama in fp32: 4.2 GB)."""
    from minipaged.kernels.backends.torch_backend import TorchBackend
    from minipaged.model.testing import build_tiny_llama
    path = str(build_tiny_llama(tmp_path / "m", hidden_size=512, intermediate_size=2048, num_layers=2))
    placed: list[torch.Tensor] = []
    checks: list[bool] = []
    real_placer = TorchBackend.weight_placer
    hf_holder: list = []

    def watching_placer(self, sizes, device):
        place = real_placer(self, sizes, device)

        def watched(weight):
            if placed and hf_holder:                    # the previous copy is already what transformers reads
                shared = {p.data_ptr() for p in hf_holder[0].parameters()}
                checks.append(placed[-1].data_ptr() in shared)
            placed.append(place(weight))
            return placed[-1]
        return watched
    monkeypatch.setattr(TorchBackend, "weight_placer", watching_placer)
    import minipaged.model.llama as llama
    real_store = llama.CompactLlama.store_weights_for

    def store(self, backend):
        hf_holder.append(self._hf_model)
        return real_store(self, backend)
    monkeypatch.setattr(llama.CompactLlama, "store_weights_for", store)
    engine = Engine(path, num_blocks=64, block_size=16)
    assert len(placed) == 4 * engine.model.num_layers + 1 and len(checks) == len(placed) - 1
    assert all(checks), checks


def test_a_cuda_card_without_native_bfloat16_gets_float16_and_is_told(monkeypatch, caplog):
    """Colab's T4 (compute capability 7.5) has no bf16: the default dtype there is fp16, said once; a card with
    bf16 keeps vLLM's bf16. (torch's calls are faked: no GPU here.)"""
    import torch

    from minipaged.kernels import devices

    monkeypatch.setattr(devices, "_SAID_FP16", set())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with caplog.at_level("WARNING", logger="minipaged"):
        assert devices.default_dtype(torch.device("cuda")) == "float16"
        assert devices.default_dtype(torch.device("cuda")) == "float16"
    said = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    assert len(said) == 1 and "Tesla T4 (compute capability 7.5)" in said[0] and "float16" in said[0]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert devices.default_dtype(torch.device("cuda")) == "bfloat16"
    assert devices.default_dtype(torch.device("cpu")) == "float32"
