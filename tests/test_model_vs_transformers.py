"""Our flattened, paged forward pass against transformers' own model on the same weights."""
from __future__ import annotations

import random

import pytest
import torch

from minipaged import Engine, SamplingParams, StepEvent
from tests.conftest import random_prompts


def run_and_capture_logits(engine: Engine, prompts, max_tokens: int):
    """Generate greedily, recording the logits the engine sampled from at every step of every request, and
    the StepEvent of every step."""
    captured: dict[str, list[torch.Tensor]] = {}
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    execute = engine.runner.execute

    def spy(model_input):
        logits = execute(model_input)
        for req, row in zip(model_input.sampled_requests, logits):
            captured.setdefault(req.request_id, []).append(row.clone())
        return logits
    engine.runner.execute = spy
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return outs, captured, events


@pytest.mark.parametrize("lm_head_slice_rows", [None, 48], ids=["whole-lm-head", "lm-head-in-slices"])
@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_untied"])
def test_logits_match_transformers_for_a_batch_decoded_together(fixture, lm_head_slice_rows, request, monkeypatch):
    path = request.getfixturevalue(fixture)
    if lm_head_slice_rows:       # the tiny vocabulary fits one slice of the default size: force several
        import minipaged.kernels.torch_ops as torch_ops
        monkeypatch.setattr(torch_ops, "LM_HEAD_SLICE_ROWS", lm_head_slice_rows)
    engine = Engine(path, block_size=4, num_blocks=128)
    prompts = random_prompts(random.Random(7), 5, 3, 29)
    assert len({len(p) for p in prompts}) > 1                       # a batch of different lengths
    outs, captured, events = run_and_capture_logits(engine, prompts, max_tokens=6)
    hf = engine.loaded.hf_model
    # The requests really were decoded together: some step ran a decode of every one of them.
    everyone = {out.request_id for out in outs}
    together = [ev.step for ev in events if {s.request_id for s in ev.scheduled if s.kind == "decode"} == everyone]
    assert together, f"no step decoded all of {sorted(everyone)} together"
    for out in outs:
        full = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            ref = hf(full).logits[0].float()
        n_prompt = len(out.prompt_token_ids)
        ours = torch.stack(captured[out.request_id])                 # logits that produced each output token
        theirs = ref[n_prompt - 1:n_prompt - 1 + len(out.token_ids)]
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)
        assert out.token_ids == theirs.argmax(-1).tolist()


@pytest.mark.parametrize("attention_backend", [None, "torch"])
def test_one_request_alone_matches_transformers(tiny_model_untied, attention_backend, monkeypatch):
    """A request decoding alone is the small-batch case: on the default CPU backend its decode steps run the
    layers as one compiled call (cpu_decode_layers.c, over the compiled matrix-vector loop) and the LM head through
    the compiled loop; on the torch backend F.linear."""
    from minipaged.kernels.cpu_decode_layers import CompiledDecodeLayers
    from minipaged.kernels.cpu_linear import CompiledLinear
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, attention_backend=attention_backend)
    assert engine.backend.name == (attention_backend or "cpu")
    compiled_calls: list[tuple[int, ...]] = []              # (token rows, *weight shape) the compiled loop took
    call, decode_call = CompiledLinear.__call__, CompiledDecodeLayers.__call__
    decode_layer_calls: list[int] = []                      # token rows of each compiled layer loop that ran

    def counting_call(self, x, weight):
        if self.handles(x, weight):
            compiled_calls.append((x.shape[0], *weight.shape))
        return call(self, x, weight)

    def counting_decode_call(self, model, h, *args, **kwargs):
        done = decode_call(self, model, h, *args, **kwargs)
        if done is not None:
            decode_layer_calls.append(h.shape[0])
        return done
    monkeypatch.setattr(CompiledLinear, "__call__", counting_call)
    monkeypatch.setattr(CompiledDecodeLayers, "__call__", counting_decode_call)
    prompt = random_prompts(random.Random(11), 1, 5, 30)
    outs, captured, _ = run_and_capture_logits(engine, prompt, max_tokens=10)
    model, decode_steps = engine.model, 9                   # the first token comes from the prefill step
    if attention_backend is None:          # the layers in one call at every decode step, the LM head at every step
        assert decode_layer_calls == [1] * decode_steps
        one_row_layers = [c for c in compiled_calls if c[0] == 1 and c[1:] != tuple(model.lm_head.shape)]
        assert one_row_layers == []                         # (inside the compiled layer loop, in C)
        assert compiled_calls.count((1, *model.lm_head.shape)) == decode_steps + 1
    else:
        assert compiled_calls == [] and decode_layer_calls == []
    out = outs[0]
    with torch.no_grad():
        ref = engine.loaded.hf_model(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0].float()
    n_prompt = len(out.prompt_token_ids)
    theirs = ref[n_prompt - 1:n_prompt - 1 + len(out.token_ids)]
    torch.testing.assert_close(torch.stack(captured[out.request_id]), theirs, atol=2e-5, rtol=1e-4)
    assert out.token_ids == theirs.argmax(-1).tolist()


def test_greedy_tokens_match_transformers_generate(tiny_model_untied):
    engine = Engine(tiny_model_untied, block_size=8, num_blocks=64)
    prompts = random_prompts(random.Random(3), 6, 1, 40)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    hf = engine.loaded.hf_model
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_in_vocabulary_slices_is_one_linear(dtype):
    """The CPU computes the LM head a slice of the vocabulary at a time (faster there): the same logits as
    one F.linear to rounding, for slices that divide the vocabulary and slices that leave a remainder."""
    from minipaged.model.llama import vocab_sliced_linear
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=gen).to(dtype)
    for rows in (1, 2, 7, 64):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        want = torch.nn.functional.linear(x, weight)
        for slice_rows in (100, 300, 999, 1000, 4096):
            got = vocab_sliced_linear(x, weight, slice_rows)
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got, want)    # a slice's edge tiles may round differently: not bit-exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rope_are_transformers_own_math_bit_for_bit(dtype):
    """The engine's RMSNorm (torch's fused F.rms_norm in fp32) and RoPE (roll with a signed sin table) are
    shortcuts: they must give exactly transformers' LlamaRMSNorm and apply_rotary_pos_emb, not nearly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
    from minipaged.model.llama import apply_rope, rms_norm
    gen = torch.Generator().manual_seed(0)
    for hidden in (64, 576, 2048):
        x = (torch.randn(37, hidden, generator=gen) * 3).to(dtype)
        norm = LlamaRMSNorm(hidden, eps=1e-5)
        norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        norm = norm.to(dtype)
        assert torch.equal(rms_norm(x, norm.weight.data, 1e-5), norm(x))
    for head_dim in (16, 64, 128):
        q = torch.randn(1, 9, 21, head_dim, generator=gen).to(dtype)     # transformers: [batch, heads, seq, dim]
        k = torch.randn(1, 3, 21, head_dim, generator=gen).to(dtype)
        freqs = torch.rand(21, head_dim // 2, generator=gen) * 20
        cos = torch.cat((freqs, freqs), -1).cos()
        sin_half = freqs.sin()
        sin = torch.cat((sin_half, sin_half), -1)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos[None].to(dtype), sin[None].to(dtype))
        signed_sin = torch.cat((-sin_half, sin_half), -1).to(dtype)[:, None]      # [seq, 1, dim]
        flat = torch.cat((q[0], k[0])).transpose(0, 1)                             # [seq, heads, dim]
        got = apply_rope(flat, cos.to(dtype)[:, None], signed_sin).transpose(0, 1)
        assert torch.equal(got[:9], want_q[0]) and torch.equal(got[9:], want_k[0])
