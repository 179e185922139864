"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Why they exist: lm-evaluation-harness (``tokenizer_backend=remote``) and other clients count and split text with
the served model's own tokenizer, through the server, instead of downloading it; vLLM's shapes are what they
read (``TokenizeResponse``: count, max_model_len, tokens, token_strs; ``DetokenizeResponse``: prompt; the
tokenizer's config for ``/tokenizer_info``).

Where they run: in the API server's process (the engine core's steps never wait for them), and not on the event
loop, which a long text would block. They run on one worker thread of their own, with their own copy of the
tokenizer: a fast tokenizer must not be used from two threads at once, so the copy is never shared, and the single worker never uses it
twice at once. The tokens are the engine's: the same functions (``input_processor.encode_text`` and
``render_chat``) make a completion's and a chat's prompt.

Completions' and chats' prompts are tokenised the same way, on a second such worker (``prompts`` in
``api_server``), before the request is submitted: the engine core only queues token ids (issue 48: a few-MB
prompt tokenised in the engine paused every stream for seconds). A worker of its own, so that a long text sent
to ``/tokenize`` (counted, never refused) does not hold up the next chat. Before any of that, ``check_prompt_chars``
refuses a text with more characters than the context's tokens could ever cover, so the worker is never busy
for long with a prompt that would be refused anyway.
"""
from __future__ import annotations

import asyncio
import copy
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jinja2 import TemplateError

from ..input_processor import encode_text, render_chat
from ..request import InvalidRequestError, check_token_ids
from . import protocol as p


class Tokenization:
    """The three routes' work, on the front end's own tokenizer and thread."""

    def __init__(self, tokenizer: Any, model_name: str, vocab_size: int, max_model_len: int,
                 thread_name: str = "minipaged-tokenize") -> None:
        self.tokenizer = copy.deepcopy(tokenizer)         # never shared with another thread
        self.model_name, self.vocab_size, self.max_model_len = model_name, vocab_size, max_model_len
        self.info = tokenizer_info(self.tokenizer)        # fixed for the server's life: built once
        self.chars_per_token = longest_token_chars(self.tokenizer)
        self.max_prompt_chars = max_model_len * self.chars_per_token
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # ------------------------------------------------------------ generation's prompts (the ``prompts`` worker)
    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenising, a text that cannot fit the context: no token covers more than
        ``chars_per_token`` characters, so a text longer than ``max_model_len`` times that has more tokens than the
        context holds. (Generous on purpose: a prompt that fits is never refused here; one over the context by less
        is tokenised and refused by its token count, as before.)"""
        if num_chars > self.max_prompt_chars:
            raise p.ServerError(400, f"This model's maximum context length is {self.max_model_len} tokens, and this "
                                     f"prompt has {num_chars} characters: more than any text that fits (no token of "
                                     f"this model spans more than {self.chars_per_token} characters, so at most "
                                     f"{self.max_prompt_chars} characters can). Please reduce the length of the "
                                     f"{param} (POST /tokenize counts a text's tokens).", param)

    async def encode(self, text: str) -> list[int]:
        """A completion's text prompt, as the engine would tokenise it (with the tokenizer's special tokens)."""
        self.check_prompt_chars(len(text), "prompt")
        return await self._run(encode_text, self.tokenizer, text)

    async def chat(self, messages: list[dict[str, Any]], continue_final_message: bool) -> list[int]:
        """A chat's prompt through the template, as ``InputProcessor.chat_prompt`` makes it: a generation prompt
        unless the last message is continued; a template's refusal (``TemplateError``, ``ValueError``) is raised."""
        self.check_prompt_chars(sum(len(m.get("content") or "") for m in messages), "messages")
        return await self._run(render_chat, self.tokenizer, self.model_name, messages, not continue_final_message,
                               continue_final_message)

    async def decode(self, token_ids: list[int]) -> str:
        """Token ids as text (completions' ``echo`` of a prompt of ids)."""
        return await self._run(self.tokenizer.decode, token_ids)

    # ------------------------------------------------------------ vLLM's tokenizer routes
    async def tokenize(self, body: p.TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``TokenizeResponse``. A prompt longer than the context is counted, not refused: lm-eval
        tokenizes whole documents and cuts them into windows itself; ``count`` and ``max_model_len`` let a
        client see whether a text fits."""
        body.refuse_unsupported()
        return await self._run(self._tokenize, body)

    def _tokenize(self, body: p.TokenizeRequest) -> dict[str, Any]:
        if body.messages is not None:
            try:
                token_ids = render_chat(self.tokenizer, self.model_name, [m.as_template_dict() for m in body.messages],
                                        add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message,
                                        add_special_tokens=body.special_tokens())
            except InvalidRequestError:      # no template at all: its own message says what to send
                raise
            except (TemplateError, ValueError) as exc:    # as the chat route: roles the template does not take,
                # or continue_final_message with a last message the template leaves out
                raise p.ServerError(400, f"the model's chat template refused these messages: {exc}",
                                    "messages") from None
        else:
            assert body.prompt is not None
            token_ids = encode_text(self.tokenizer, body.prompt, body.special_tokens())
        out: dict[str, Any] = {"count": len(token_ids), "max_model_len": self.max_model_len, "tokens": token_ids,
                               "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = list(self.tokenizer.convert_ids_to_tokens(token_ids))
        return out

    async def detokenize(self, body: p.DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``DetokenizeResponse``; ids outside the model's vocabulary are a 400 naming them, the same check
        (and bound) as a completions prompt of token ids."""
        check_token_ids("tokens", body.tokens, self.vocab_size)
        return {"prompt": await self._run(self.tokenizer.decode, body.tokens)}


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its vocabulary's longest entry (a byte-level
    vocabulary spells each byte as one character, sentencepiece's a space as one, byte-fallback's a byte as six:
    never fewer characters than the text they decode to), added tokens included. Measured, not guessed: the
    prompt length bound built on it refuses nothing that fits."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(piece) for piece in vocab), default=16) or 16


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's config (its ``init_kwargs``, as in tokenizer_config.json) with
    special tokens as their text, ``tokenizer_class``, and the chat template the server applies. Paths to the
    tokenizer's files are left out (they name the server's disk, and no client can open them). ``eos_token``,
    ``bos_token`` and ``pad_token`` are always there, null when the tokenizer has none: lm-eval's remote tokenizer
    checks that ``eos_token`` is present before it uses the server."""
    config = {key: value for key, value in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if not key.endswith("_file")}
    info: dict[str, Any] = as_json(config)
    for name in ("bos_token", "eos_token", "pad_token"):
        if info.get(name) is None:
            info[name] = getattr(tokenizer, name, None)
    info["tokenizer_class"] = type(tokenizer).__name__
    template = getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = template
    return info


def as_json(value: Any) -> Any:
    """A config as JSON: special tokens (``AddedToken``) as their text, keys as strings, anything else unknown
    as its ``str`` (one odd value must not make the whole answer a 500)."""
    if hasattr(value, "content") and isinstance(getattr(value, "content"), str):
        return value.content
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)                                 # JSON has no inf or nan
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)
