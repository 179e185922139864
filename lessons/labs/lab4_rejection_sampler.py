"""Lab 4: the rejection sampler of speculative decoding.

The student writes ``verify(p, q, draft_token_ids, generator)`` for sampled requests; the engine's own is
``minipaged.spec_decode.rejection_sampler.verify`` (adapted here to the lab's plain probability tensors). The
main check draws thousands of verifications and compares the distribution of the first output token with
the target's p: speculative sampling must leave the output distribution exactly the target's.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from minipaged.request import SamplingParams
from minipaged.sampling import probabilities
from minipaged.spec_decode.proposer import Draft
from minipaged.spec_decode.rejection_sampler import Verified, verify

from .core import Lab, expect

STUB = '''"""Lab 4: the rejection sampler. Fill in the TODOs, then run `minipaged lab check 4`.

A drafter guessed k tokens d_0 .. d_{k-1}, sampling d_i from its distribution q[i]. The target model ran once
over them and gave p[0] .. p[k]: p[i] is the target's distribution for the position d_i guessed (p[k]: the
position after the last guess). Keep drafts so that every output token is distributed exactly as p says:

  for each i: accept d_i with probability min(1, p[i][d_i] / q[i][d_i]);
              on the first rejection, output one token drawn from the *recovered* distribution
              max(p[i] - q[i], 0), normalised, and stop;
  if all k are accepted, output one bonus token drawn from p[k].

Draw every random number from `generator` (torch.rand((), generator=generator),
torch.multinomial(probs, 1, generator=generator)): a request's seed must decide its tokens.
"""
import torch


def verify(p, q, draft_token_ids, generator):
    """p: [k + 1, vocab] target probabilities; q: [k, vocab] drafter probabilities; returns the output tokens:
    the accepted drafts, then one more token."""
    tokens = []
    for i, token in enumerate(draft_token_ids):
        u = float(torch.rand((), generator=generator))
        # TODO: accept d_i with probability min(1, p[i][token] / q[i][token]) (append it, go on);
        #       else append a token drawn from max(p[i] - q[i], 0), normalised, and return.
        raise NotImplementedError("verify: accept or recover")
    # TODO: every draft accepted: append a bonus token drawn from p[k].
    raise NotImplementedError("verify: the bonus token")
'''

P0 = torch.tensor([0.5, 0.3, 0.1, 0.1])
Q0 = torch.tensor([0.1, 0.1, 0.4, 0.4])
TRIALS = 3000


def engine_verify(p: torch.Tensor, q: torch.Tensor, draft_token_ids: Sequence[int],
                  generator: torch.Generator) -> list[int]:
    """The engine's rejection sampler, given plain probabilities (log p as logits at temperature 1 gives p back)."""
    return verify(torch.log(p), Draft(list(draft_token_ids), q), SamplingParams(temperature=1.0), generator).token_ids


def first_token_distribution(fn: Any, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    p = torch.stack([P0, torch.full((4,), 0.25)])
    q = Q0.unsqueeze(0)
    counts = torch.zeros(4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # thousands of tiny ops: waking a thread pool for each costs ms on a busy CPU
    try:
        for _ in range(TRIALS):
            draft = int(torch.multinomial(Q0, 1, generator=generator))
            tokens = fn(p, q, [draft], generator)
            counts[int(tokens[0])] += 1
    finally:
        torch.set_num_threads(threads)
    return counts / TRIALS


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().sum() / 2)


def shape_of_the_answer(fn: Any) -> None:
    """the answer is the accepted drafts, then exactly one more token"""
    generator = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])   # the target agrees with 1, then 2
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    got = list(fn(p, q, [1, 2], generator))
    expect(got == [1, 2, 0], f"drafts [1, 2] that the target is certain of came back as {got}: both are accepted "
                             f"(p/q = 1), then the bonus token comes from p[k], which is certain of token 0.")
    got = list(fn(p, q[:, [0, 2, 1]].contiguous(), [2, 1], generator))
    expect(got == [1], f"drafts [2, 1] that the target gives probability 0 came back as {got}: the first is rejected "
                       f"and replaced by a token from max(p - q, 0), here certainly 1; nothing after a rejection.")


def output_is_distributed_as_the_target(fn: Any) -> None:
    """the first output token is distributed exactly as p (3000 draws)"""
    got = first_token_distribution(fn)
    distance = total_variation(got, P0)
    if distance < 0.05:
        return
    accept_min = torch.minimum(P0, Q0)
    from_p = accept_min + (1 - accept_min.sum()) * P0          # recovered token drawn from p
    always = Q0                                                 # every draft accepted
    shown = ", ".join(f"{x:.2f}" for x in got)
    target = ", ".join(f"{x:.2f}" for x in P0)
    expect(total_variation(got, from_p) > 0.05,
           f"the first token came out as [{shown}], the target says [{target}]. That is what drawing the recovered "
           f"token from p gives: accepted drafts already supply min(p, q) of each token's probability, so after a "
           f"rejection only the part q under-covers is missing, max(p - q, 0) normalised. Drawing from p again "
           f"gives too little to the tokens the drafter under-guesses.")
    expect(total_variation(got, always) > 0.05,
           f"the first token came out as [{shown}], the drafter's q, not the target's [{target}]: every draft seems "
           f"to be accepted. Accept d_i only with probability min(1, p[i][d_i] / q[i][d_i]).")
    expect(False, f"the first token came out as [{shown}] over {TRIALS} draws; the target says [{target}] "
                  f"(total variation {distance:.3f}). Check the acceptance test and the recovered distribution.")


def seeded_by_the_generator(fn: Any) -> None:
    """every random number comes from the request's generator, so a seed reproduces the tokens"""
    p = torch.stack([P0, torch.full((4,), 0.25)])
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(1234)
        torch.manual_seed(len(runs))                   # the global stream differs between the runs
        runs.append([list(fn(p, Q0.unsqueeze(0), [2], generator)) for _ in range(50)])
    expect(runs[0] == runs[1], "the same seed gave different tokens: some random number does not come from "
                               "`generator` (torch.rand(()) or torch.multinomial(...) without generator=). A "
                               "request's seed must decide its tokens whatever else runs in the batch.")


def reference() -> Any:
    return engine_verify


def install(engine: Any, fn: Any) -> None:
    """Run the student's verify for sampled requests inside the engine's speculator (greedy ones keep the
    engine's argmax rule: the lab is about sampling)."""
    def verify_drafts(target_logits: torch.Tensor, draft: Draft, params: SamplingParams,
                      generator: torch.Generator) -> Verified:
        if params.greedy:
            return verify(target_logits, draft, params, generator)
        k = len(draft.token_ids)
        p = probabilities(target_logits, params)
        q = draft.probs if draft.probs is not None else torch.zeros(k, p.shape[-1]).scatter_(
            1, torch.tensor(draft.token_ids).unsqueeze(1), 1.0)
        tokens = [int(t) for t in fn(p, q, draft.token_ids, generator)]
        return Verified(tokens, len(tokens) - 1, k)
    engine.speculator.verify_drafts = verify_drafts


LAB = Lab(4, "lab4_rejection_sampler", "The rejection sampler of speculative decoding", "verify", STUB, reference,
          (shape_of_the_answer, output_is_distributed_as_the_target, seeded_by_the_generator),
          reference_options={"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3}},
          install=install)
