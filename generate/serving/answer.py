"""One HTTP request's answer in OpenAI's shapes: the whole completion, or its stream of chunks."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from generate.api import Generator
from generate.engine.engine import NOT_FINITE_ADVICE, GenerationError
from generate.engine.request import Request
from generate.serving import openai_api as oa
from generate.serving.engine_loop import SHUTDOWN, EngineLoop, Update

if TYPE_CHECKING:
    from starlette.requests import Request as HTTPRequest

SCORE_CHUNK = 8  # prompt positions scored a call (with the head over the vocabulary: under a decode step)


def shutting_down() -> oa.APIError:
    """The answer to work the shutdown ends: 503 ``shutting_down``."""
    return oa.APIError(SHUTDOWN, status=503, type="server_error", code="shutting_down")


class Stepped(Protocol):
    """Work done a piece a call in the engine's thread (echo's scoring, an attention forward)."""

    done: bool

    def step(self) -> None: ...


async def step_until_done(loop: EngineLoop, request: HTTPRequest, note: dict, work: Stepped) -> None:
    """Run ``work.step`` in the engine's thread, one call between two steps, until ``work.done``; stop with
    503 at the shutdown, and with 499 (noted as cancelled) when the client has gone."""
    while not work.done:
        if loop.ending:
            raise shutting_down()
        if await request.is_disconnected():
            note["cancelled"] = True
            raise oa.APIError("the client went away", status=499, code="cancelled")
        await loop.call(work.step)


class Answer:
    """Builds one HTTP request's OpenAI objects from its engine requests."""

    def __init__(self, model_name: str, gen: Generator, job: oa.Job, requests: list[Request]) -> None:
        self.gen, self.job, self.requests = gen, job, requests
        self.chat = job.chat
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex
        self.model, self.created = model_name, int(time.time())
        self.name = oa.TokenText(gen.tokenizer.decode_single_token_bytes)
        self.prompt_logprobs: list[list[float | None]] = []
        self.prompt_top: list[list[dict[int, float] | None]] = []  # (each prompt's, as scored for echo)
        # (an echoed empty text was sent as <|endoftext|>, which the echo does not show: no characters)
        unshown = [int(job.echo and not job.prompt_texts[self.prompt_of(i)]) for i in range(len(requests))]
        echoed = [len(job.prompts[self.prompt_of(i)]) if job.echo else 0 for i in range(len(requests))]
        self.offsets = [oa.TextOffsets(gen.tokenizer.decode_single_token_bytes, unshown=u, prompt=p)
                        for u, p in zip(unshown, echoed, strict=True)]  # fmt: skip
        self.chunk_kind = "chat.completion.chunk" if job.chat else "text_completion"
        self._ids_sent: set[int] = set()  # (choices whose prompt ids went: return_token_ids)

    def prompt_of(self, index: int) -> int:
        return index // self.job.n

    def usage(self) -> dict[str, int]:
        return oa.usage(self.requests, sum(len(p) for p in self.job.prompts))

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _echo(self, index: int) -> str:
        return self.job.prompt_texts[self.prompt_of(index)] if self.job.echo else ""

    def _logprobs(self, index: int, tokens: list[int], logprobs: list, top: list, first: bool) -> Any:
        if self.job.logprobs is None:
            return None
        if self.chat:
            return oa.chat_logprobs(
                tokens, logprobs, top, self.gen.tokenizer.decode_single_token_bytes, self.name
            )
        if first and self.job.echo:
            prompt = self.job.prompts[self.prompt_of(index)]
            tokens, logprobs = prompt + tokens, self.prompt_logprobs[self.prompt_of(index)] + logprobs
            top = self.prompt_top[self.prompt_of(index)] + top
        return oa.completion_logprobs(tokens, logprobs, top, self.name, self.offsets[index])

    def whole(self) -> dict[str, Any]:
        """The non-streamed answer."""
        choices = []
        for i, r in enumerate(self.requests):
            top = r.top_list if r.top_logprobs else [{} for _ in r.token_ids]
            logprobs = self._logprobs(i, r.token_ids, r.logprobs_list, top, first=True)
            text = self._echo(i) + r.text.text
            choice = (
                {"index": i, "message": {"role": "assistant", "content": text}}
                if self.chat
                else {"index": i, "text": text}
            )
            ids = self._ids(i, r.token_ids)
            choices.append(choice | ids | {"logprobs": logprobs, "finish_reason": r.finish_reason})
        return self.head("chat.completion" if self.chat else "text_completion") | {
            "choices": choices,
            "usage": self.usage(),
        }

    def chunk(self, index: int, text: str, update: Update | None, first: bool) -> dict[str, Any]:
        """One streamed chunk for choice ``index``."""
        tokens, logprobs, top = (update.tokens, update.logprobs, update.top) if update else ([], [], [])
        reason = update.finish_reason if update else None
        echoed = first and not self.chat  # (chat's first chunk, its role's, has null logprobs, as OpenAI's)
        lp = self._logprobs(index, tokens, logprobs, top, first) if tokens or echoed else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice |= self._ids(index, tokens) | {"logprobs": lp, "finish_reason": reason}
        return self.head(self.chunk_kind) | {"choices": [choice]}

    def _ids(self, index: int, tokens: list[int]) -> dict[str, list[int]]:
        """``return_token_ids``: the choice's new token ids, and in its first chunk its prompt's."""
        if not self.job.token_ids:
            return {}
        first = index not in self._ids_sent
        self._ids_sent.add(index)
        prompt = {"prompt_token_ids": self.job.prompts[self.prompt_of(index)]} if first else {}
        return prompt | {"token_ids": tokens}

    def stream_start(self) -> list[dict[str, Any]]:
        """Chunks sent before any token: the chat role, or the echoed prompt."""
        if self.chat or self.job.echo:
            return [self.chunk(i, self._echo(i), None, first=True) for i in range(len(self.requests))]
        return []


def sse(obj: object) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class PromptScorer:
    """Each prompt token's log-probability given the tokens before it (the first has none), and the ``top``
    most likely tokens' there (by id, as a generated token's), computed :data:`SCORE_CHUNK` positions a call
    through a KV cache of the prompt's own: the server runs one call between two decode steps, so scoring a
    long prompt never stalls the streams for long. NaN or infinite logits raise GenerationError."""

    def __init__(self, gen: Generator, prompt: list[int], top: int = 0) -> None:
        self.model, self.prompt, self.top = gen.model, prompt, top
        self.vocab = min(gen.model.config.vocab_size, gen.tokenizer.n_vocab)
        self.logprobs: list[float | None] = [None]
        self.alternatives: list[dict[int, float] | None] = [None]
        self.cache = None  # made by the first step, in the engine's thread; dropped by the last

    @property
    def done(self) -> bool:
        return len(self.logprobs) == len(self.prompt)

    def step(self) -> None:
        """Score the next chunk of positions."""
        import torch

        from model import KVCache

        start = len(self.logprobs) - 1
        end = min(len(self.prompt) - 1, start + SCORE_CHUNK)
        model, device = self.model, self.model.device
        if self.cache is None:
            self.cache = KVCache(model.config, 1, len(self.prompt), dtype=model.compute_dtype, device=device)
        with torch.inference_mode():
            ids = torch.tensor([self.prompt[start:end]], device=device)
            positions = torch.arange(start, end, device=device)[None]
            logits = self.model(ids, positions=positions, cache=self.cache, span=end)[0].float()
            logits = logits[:, : self.vocab]  # (a padded vocabulary's ids beyond the tokenizer's: none)
            if not torch.isfinite(logits).all():  # (as in a generating step; JSON has no NaN)
                dtype = model.compute_dtype
                raise GenerationError(f"the model produced NaN or infinite logits (dtype {dtype}) scoring "
                                      f"the prompt for echo; {NOT_FINITE_ADVICE}")  # fmt: skip
            chosen = torch.tensor(self.prompt[start + 1 : end + 1], device=device)[:, None]
            log_probs = torch.log_softmax(logits, dim=-1)
            self.logprobs += log_probs.gather(-1, chosen)[:, 0].tolist()
            values, ids = log_probs.topk(min(self.top, log_probs.shape[-1]))  # (none: an empty dict each)
            self.alternatives += [dict(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(),
                                                                               strict=True)]  # fmt: skip
        if self.done:
            self.cache = None
