"""Requests in: check a prompt and its ``SamplingParams``, tokenise it, and turn it into ``Request``s.

Everything that can be wrong with a request is found here, before anything is queued, so a bad request
gets a clear error and never reaches the scheduler (where it could hurt the requests around it). A prompt
with ``n > 1`` becomes n requests (named by ``output_processor.sample_ids``) that share the prompt (and, through
the prefix cache, its KV blocks); the output processor gathers them back into one output.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from .output_processor import sample_ids
from .request import InvalidRequestError, Request, SamplingParams

Prompt = Union[str, Sequence[int]]


def as_prompt_list(prompts: Union[Prompt, Iterable[Prompt]]) -> list[Prompt]:
    """One prompt (text, or a list of token ids) or many, as a list of prompts."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


@dataclass(frozen=True)
class ProcessedPrompt:
    token_ids: list[int]
    text: Optional[str]              # the prompt as the caller gave it, if it was text
    params: SamplingParams


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """A text's token ids, for generate(), the routes and /tokenize alike: what /tokenize counts is charged."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def render_chat(tokenizer: Any, model_name: str, conversation: list[dict], add_generation_prompt: bool,
                continue_final_message: bool, add_special_tokens: bool = False) -> list[int]:
    """A conversation through the chat template, as token ids (as transformers' ``apply_chat_template`` makes
    them), for chat and /tokenize alike; vLLM's ``add_special_tokens`` adds BOS on top of the template's."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(f"{model_name} has no chat template; send plain text, not messages.", "messages")
    return encode_text(tokenizer, tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
        tokenize=False), add_special_tokens)


class InputProcessor:
    def __init__(self, model_name: str, tokenizer: Any, vocab_size: int, max_model_len: int,
                 blocks_needed: Callable[[int], int], num_blocks: int) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.blocks_needed = blocks_needed
        self.num_blocks = num_blocks
        self._arrival_counter = itertools.count()     # global arrival order: FCFS and preemption use it
        self._id_counter = itertools.count()

    def process(self, prompt: Prompt, params: Optional[SamplingParams]) -> ProcessedPrompt:
        """Validate and tokenise; raises InvalidRequestError naming the problem and the fix."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a minipaged.SamplingParams.")
        token_ids, text = self._tokenize(prompt)
        self._check_fits(token_ids, params)
        return ProcessedPrompt(token_ids, text, params)

    def _tokenize(self, prompt: Prompt) -> tuple[list[int], Optional[str]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty; give at least one character or token id.")
            return encode_text(self.tokenizer, prompt), prompt
        try:
            token_ids = [int(t) for t in prompt]
            if any(t != p for t, p in zip(token_ids, prompt)):
                raise TypeError
        except (TypeError, ValueError):
            raise InvalidRequestError("a prompt must be a string or a list of integer token ids.") from None
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; give at least one character or token id.")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id(s) {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1}).")
        return token_ids, None

    def _check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """A request must fit the context, and the pool must be able to hold it at its longest: one that
        can never get its blocks would wait (or be preempted) forever."""
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} (room is needed "
                f"for at least one generated token); shorten the prompt or raise max_model_len.")
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        need = self.blocks_needed(longest)
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"this request can grow to {longest} tokens = {need} KV blocks, but the whole pool has "
                f"{self.num_blocks} blocks, so it could never finish; lower max_tokens or the prompt length, "
                f"or raise num_blocks / kv_cache_memory.")

    def make_requests(self, prompt: ProcessedPrompt, request_id: Optional[str],
                      id_in_use: Callable[[str], bool]) -> tuple[str, list[Request]]:
        """The user-visible id and its requests: one, or one per sample when ``n > 1``."""
        n = prompt.params.n

        def taken(rid: str) -> bool:
            return any(id_in_use(r) for r in {rid, *sample_ids(rid, n)})

        if request_id is None:                    # the next number that nobody has taken by hand
            request_id = next(rid for rid in map(str, self._id_counter) if not taken(rid))
        request_id = str(request_id)
        if taken(request_id):
            raise InvalidRequestError(f"request id {request_id!r} (or one of its samples' ids) is already in use; "
                                      f"pass a new one or None.")
        now = time.perf_counter()
        return request_id, [Request(rid, list(prompt.token_ids), prompt.params, next(self._arrival_counter), now,
                                    prompt=prompt.text, sample_index=i, parent_id=request_id)
                            for i, rid in enumerate(sample_ids(request_id, n))]

    def chat_prompt(self, conversation: list[dict], continue_final_message: bool = False) -> list[int]:
        """A conversation through the model's chat template, ready for the assistant's answer; with
        ``continue_final_message`` (vLLM's option) the last message is left open, to be continued."""
        return render_chat(self.tokenizer, self.model_name, conversation, not continue_final_message,
                           continue_final_message)

    def prompt_text(self, prompt: ProcessedPrompt) -> str:
        """The prompt as text for observers (the TUI shows prompts; token-id prompts are decoded once)."""
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)
