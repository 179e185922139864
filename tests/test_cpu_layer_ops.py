"""The compiled layer ops (kernels/cpu_layer_ops.c) and greedy argmax (kernels/cpu_argmax.c) against their
torch specification (``TorchLayerOps`` in minipaged/model/llama.py, ``torch.argmax``), their guards, and the
engine's use of them: every layer of a cpu-backend step goes through them, and greedy tokens still match
transformers (tests/test_model_vs_transformers.py checks the logits)."""
from __future__ import annotations

import random

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.kernels import CpuArgmax, CpuLayerOps, cpu_layer_ops, torch_argmax
from minipaged.model.llama import TORCH_LAYER_OPS

TOL = dict(atol=1e-5, rtol=1e-5)


def rope_tables(tokens: int, head_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin rows as the model builds them: [cos, cos] and [-sin, sin] of random angles."""
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 20
    return torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)


@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (17, 100)])
def test_add_rms_norm_matches_torch_and_updates_the_residual(rows, hidden):
    ops, gen = cpu_layer_ops(64), torch.Generator().manual_seed(rows)
    residual, delta = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    for with_delta in (False, True):
        ours, theirs = residual.clone(), residual.clone()
        d = delta if with_delta else None
        torch.testing.assert_close(ops.add_rms_norm(ours, d, weight, 1e-5),
                                   TORCH_LAYER_OPS.add_rms_norm(theirs, d, weight, 1e-5), **TOL)
        torch.testing.assert_close(ours, theirs, **TOL)                  # residual += delta, in place
        assert torch.equal(ours, residual + delta if with_delta else residual)


@pytest.mark.parametrize("seed", range(6))
def test_rope_and_write_kv_matches_torch(seed):
    """Rotated queries, rotated keys and plain values in their slots; slot -1 leaves the cache alone."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    heads, kv_heads = rng.choice([(4, 4), (9, 3), (6, 2)])
    head_dim, block_size, num_blocks = rng.choice([16, 64]), rng.choice([1, 4, 16]), 12
    tokens = rng.randint(1, 9)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cos, sin = rope_tables(tokens, head_dim, gen)
    slots = torch.tensor(rng.sample(range(num_blocks * block_size), tokens))
    if tokens > 1:
        slots[rng.randrange(tokens)] = -1                               # an already cached token
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)]
    ours_qkv, ours_k, ours_v = qkv.clone(), caches[0].clone(), caches[1].clone()
    theirs_k, theirs_v = caches[0].clone(), caches[1].clone()
    q = cpu_layer_ops(head_dim).rope_and_write_kv(ours_qkv, cos, sin, ours_k, ours_v, slots, heads, kv_heads)
    q_ref = TORCH_LAYER_OPS.rope_and_write_kv(qkv.clone(), cos, sin, theirs_k, theirs_v, slots, heads, kv_heads)
    torch.testing.assert_close(q, q_ref, **TOL)
    torch.testing.assert_close(ours_k, theirs_k, **TOL)
    assert torch.equal(ours_v, theirs_v)                                 # values are copied, not computed
    assert q.data_ptr() == ours_qkv.data_ptr()                           # the queries are a view of qkv


def test_silu_and_mul_matches_torch():
    gen = torch.Generator().manual_seed(3)
    gate_up = torch.randn(7, 2 * 1536, generator=gen) * 4
    torch.testing.assert_close(cpu_layer_ops(64).silu_and_mul(gate_up),
                               TORCH_LAYER_OPS.silu_and_mul(gate_up.clone()), **TOL)


def test_bad_inputs_raise_instead_of_reaching_c():
    ops = cpu_layer_ops(64)
    x, w = torch.randn(3, 8), torch.ones(8)
    for args in ((x.t().contiguous().t(), None, w), (x, None, torch.ones(9)), (x.double(), None, w.double()),
                 (x, torch.randn(2, 8), w)):
        with pytest.raises(ValueError, match="contiguous float32"):
            ops.add_rms_norm(*args, 1e-5)
    qkv, (cos, sin) = torch.randn(2, 6 * 16), rope_tables(2, 16, torch.Generator().manual_seed(0))
    k_cache, v_cache = torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(ValueError, match="kv_heads"):                   # the cache holds 2 KV heads, not 1
        ops.rope_and_write_kv(torch.randn(2, 4 * 16), cos, sin, k_cache, v_cache, torch.tensor([0, 1]), 2, 1)
    for bad_slot in (16, -2):                                            # 16 slots: 0..15, and -1 to skip
        with pytest.raises(ValueError, match="outside 0..15"):
            ops.rope_and_write_kv(qkv.clone(), cos, sin, k_cache, v_cache, torch.tensor([3, bad_slot]), 2, 2)
    with pytest.raises(ValueError, match="rows, 2 \\* inter"):
        ops.silu_and_mul(torch.randn(2, 7))


def test_argmax_matches_torch_first_index_on_ties():
    argmax, gen = CpuArgmax(64), torch.Generator().manual_seed(5)
    logits = torch.randn(64, 49152, generator=gen)
    logits[3, [10, 500, 40000]] = 100.0                                  # a tie: the first index wins
    logits[4] = 0.0                                                      # all equal: index 0
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert argmax(logits)[3] == 10 and argmax(logits)[4] == 0
    for other in (logits[:2].bfloat16(), logits[0], logits[:, ::2]):     # torch's, or copied first
        assert torch.equal(argmax(other), other.argmax(dim=-1))
    assert torch_argmax(logits[:2]).tolist() == logits[:2].argmax(-1).tolist()


def test_every_layer_of_a_step_runs_the_compiled_ops(tiny_model_untied, monkeypatch):
    """A cpu-backend engine sends every layer's norms, RoPE/K-V write and SiLU through the compiled ops, and
    its greedy tokens are those of the torch backend (whose ops are transformers' math)."""
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "rope_and_write_kv", "silu_and_mul"):
        method = getattr(CpuLayerOps, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _method(self, *args, **kwargs)
        monkeypatch.setattr(CpuLayerOps, name, counted)
    prompts = [[5, 9, 33, 2, 71, 8], [100, 3, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    compiled = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert compiled.backend.name == "cpu"
    compiled.backend._decode_layers = None     # the loop in Python, each op a call (else decodes run the whole loop
    events: list = []                          # as one compiled call: tests/test_decode_layers.py)
    compiled.subscribe(events.append)
    outs = compiled.generate(prompts, params)
    layers, steps = compiled.model.num_layers, sum(1 for event in events if event.scheduled)
    assert steps >= 6
    assert calls == {"add_rms_norm": 2 * layers * steps, "rope_and_write_kv": layers * steps,
                     "silu_and_mul": layers * steps}
    plain = Engine(tiny_model_untied, block_size=4, num_blocks=64, attention_backend="torch")
    assert [o.token_ids for o in plain.generate(prompts, params)] == [o.token_ids for o in outs]
