"""The OpenAI-compatible server, tested as a client sees it: a real `gptgen serve` in a subprocess on
127.0.0.1 (the shipped model), the official `openai` client, and raw HTTP for what the client will not send.

Every result is compared with the offline API (`generate.load(...).generate`) on the same request: greedy
and seeded requests give the same tokens over HTTP, whatever else runs (the engine's batch invariance).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

import checkpoints
import generate
from generate.serving.openai_api import render_chat
from helpers import make_model, served_in_process
from model import GPTConfig

SLOTS = 4


class Server:
    """A `gptgen serve` subprocess; its stderr lines are collected in a thread."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "generate.tools.gptgen", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        first = self.proc.stderr.readline()
        match = re.search(r"listening on (http://\S+)", first)
        assert match, first
        self.url = match.group(1)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "".join(self.lines)
            if httpx.get(self.url + "/health").status_code == 200:
                return
            time.sleep(0.2)
        raise TimeoutError("the server did not get ready")

    def logged(self, text: str, timeout: float = 5) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            time.sleep(0.02)
        return False

    def count(self, text: str, at_least: int = 0, timeout: float = 5) -> int:
        """Lines logged holding ``text``, once there are ``at_least`` (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        while (n := sum(text in line for line in self.lines)) < at_least and time.monotonic() < deadline:
            time.sleep(0.02)
        return n

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return float(re.search(rf"^gptgen_{name} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def server():
    s = Server("--max-slots", str(SLOTS), "--max-queue", "512")
    s.wait_ready()
    yield s
    assert s.stop() == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    """The offline API at the server's width, deterministic: the same bits as the server (docs/server.md)."""
    return generate.load("shakespeare", slots=SLOTS, deterministic=True)


def test_health_models_and_the_log(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["shakespeare"]
    assert server.logged("GET /v1/models 200")


def test_a_greedy_completion_equals_the_offline_api(client, offline):
    got = client.completions.create(
        model="shakespeare", prompt="To be, or not to be", max_tokens=24, temperature=0
    )
    want = offline.generate("To be, or not to be", max_new_tokens=24, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens == 7
    assert got.usage.completion_tokens == len(want.token_ids) and got.usage.total_tokens == 7 + len(
        want.token_ids
    )
    assert got.object == "text_completion" and got.id.startswith("cmpl-")


def test_extreme_valid_sampling_beside_greedy_requests_changes_none_of_them(client, offline):
    # Settings at the ends of the documented ranges (top_p 1e-300 once killed every row of its step), sent
    # by the openai client at the same time as three greedy requests: all answered, the greedy texts alone's.
    extreme = [dict(top_p=1e-300), dict(temperature=5e-324), dict(temperature=1e308, top_k=2**62),
               dict(min_p=0.999999, frequency_penalty=2, presence_penalty=-2)]  # fmt: skip
    greedy = ["ROMEO:", "To be, or not", "KING HENRY:"]

    def ask(job: tuple[str, dict]) -> str:
        prompt, options = job
        extra = {k: options.pop(k) for k in ("top_k", "min_p") if k in options}  # (not in openai's signature)
        got = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=16, extra_body=extra,
                                        **options)  # fmt: skip
        return got.choices[0].text

    jobs = [("The king", {**e, "seed": i}) for i, e in enumerate(extreme)] + [
        (p, {"temperature": 0}) for p in greedy
    ]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(ask, jobs))
    assert texts[len(extreme) :] == [
        offline.generate(p, max_new_tokens=16, temperature=0).text for p in greedy
    ]


SAMPLED = dict(temperature=0.9, top_p=0.9, presence_penalty=0.5, seed=7)


@pytest.mark.parametrize("options", [dict(temperature=0), SAMPLED], ids=["greedy", "seeded"])
def test_streamed_text_equals_the_whole_text_and_the_offline_api(client, offline, options):
    whole = client.completions.create(model="shakespeare", prompt="Once upon", max_tokens=40, **options)
    stream = client.completions.create(
        model="shakespeare", prompt="Once upon", max_tokens=40, stream=True, **options
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    offline_options = {k: v for k, v in options.items() if k != "seed"}
    want = offline.generate("Once upon", max_new_tokens=40, seed=options.get("seed"), **offline_options)
    assert whole.choices[0].text == want.text


def test_a_seeded_request_repeated_gives_the_same_text(client):
    texts = {
        client.completions.create(model="shakespeare", prompt="The king", max_tokens=30, **SAMPLED)
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(texts) == 1


def test_chat_equals_the_offline_api_on_the_template(client, offline):
    messages = [
        {"role": "system", "content": "Speak as a king."},
        {"role": "user", "content": "Who art thou?"},
    ]
    got = client.chat.completions.create(model="shakespeare", messages=messages, max_tokens=30, seed=3)
    want = offline.generate(render_chat(messages), max_new_tokens=30, seed=3, stop=["\nUser:", "\nSystem:"])
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.object == "chat.completion" and got.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(
        model="shakespeare",
        messages=messages,
        max_tokens=30,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_logprobs_streamed_are_the_whole_answers_and_the_role_chunk_has_none(client):
    options = dict(model="shakespeare", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, seed=3,
                   logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**options).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(**options, stream=True) if c.choices]
    role = chunks[0].choices[0]
    assert role.delta.role == "assistant" and role.logprobs is None  # (it was {"content": []})
    assert [e for c in chunks[1:] for e in c.choices[0].logprobs.content] == whole and len(whole) == 8


def test_n_choices_use_seed_plus_their_index(client, offline):
    got = client.completions.create(model="shakespeare", prompt="ROMEO:", max_tokens=20, n=2, **SAMPLED)
    options = {k: v for k, v in SAMPLED.items() if k != "seed"}
    for j, choice in enumerate(sorted(got.choices, key=lambda c: c.index)):
        assert choice.text == offline.generate("ROMEO:", max_new_tokens=20, seed=7 + j, **options).text
    assert got.usage.prompt_tokens == 3 and got.usage.completion_tokens == sum(
        len(offline.generate("ROMEO:", max_new_tokens=20, seed=7 + j, **options).token_ids) for j in range(2)
    )


def test_a_list_of_prompts_gives_choices_in_order(client, offline):
    prompts = ["A", "The night is", "Good morrow"]
    got = client.completions.create(model="shakespeare", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        offline.generate(p, max_new_tokens=12, temperature=0).text for p in prompts
    ]


def test_stop_cuts_the_text_and_says_stop(client, offline):
    got = client.completions.create(
        model="shakespeare", prompt="To be, or not to be", max_tokens=60, temperature=0, stop=["\n"]
    )
    want = offline.generate("To be, or not to be", max_new_tokens=60, temperature=0, stop=["\n"])
    assert got.choices[0].text == want.text and "\n" not in want.text
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="shakespeare",
        prompt="To be, or not to be",
        max_tokens=60,
        temperature=0,
        stop=["\n"],
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text


def test_logprobs_are_the_offline_ones_with_alternatives(client, offline):
    got = client.completions.create(
        model="shakespeare", prompt="What light", max_tokens=10, temperature=0, logprobs=3
    )
    want = offline.generate("What light", max_new_tokens=10, temperature=0, logprobs=True)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert "".join(lp.tokens) == got.choices[0].text
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3 and top[token] == pytest.approx(chosen)  # greedy: the chosen one is the best
        assert max(top.values()) == pytest.approx(chosen)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_each_sampled_tokens_alternatives_hold_it_too_as_openais_do(client, stream):
    got = client.completions.create(model="shakespeare", prompt="What light", max_tokens=24, temperature=1.5,
                                    seed=3, logprobs=1, stream=stream)  # fmt: skip
    entries = [c.choices[0].logprobs for c in (got if stream else [got])]
    rows = [row for lp in entries for row in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)]
    assert len(rows) == 24 and all(top[token] == chosen and len(top) <= 2 for token, chosen, top in rows)
    assert any(len(top) == 2 for _, _, top in rows)  # (some sampled token was not the most likely)


@pytest.mark.parametrize(("stream", "echo"), [(False, False), (True, False), (True, True)])
def test_return_token_ids_gives_each_choices_ids_and_its_prompts(client, offline, stream, echo):
    # vLLM's extension: the ids generated (the playground shows the attention over exactly these).
    want = offline.generate("What light", max_new_tokens=12, temperature=0)
    ids = {"return_token_ids": True}
    options = dict(max_tokens=12, temperature=0, echo=echo, stream=stream, extra_body=ids)
    got = client.completions.create(model="shakespeare", prompt="What light", **options)
    choices = [c.choices[0] for c in got] if stream else got.choices
    assert [c.prompt_token_ids for c in choices if "prompt_token_ids" in c.model_extra] == [
        offline.encode("What light")
    ]  # (once, in the first chunk)
    assert [t for c in choices for t in c.token_ids] == want.token_ids
    chat = client.chat.completions.create(model="shakespeare", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, extra_body=ids)  # fmt: skip
    assert offline.tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    plain = client.completions.create(model="shakespeare", prompt="What light", max_tokens=2)
    assert "token_ids" not in plain.choices[0].model_extra


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_empty_prompt_takes_no_characters_in_the_text_offsets(client, stream):
    # An empty prompt is sent as <|endoftext|>: echoed as "", so the text after it starts at character 0.
    got = client.completions.create(model="shakespeare", prompt="", max_tokens=4, temperature=0, echo=True,
                                    logprobs=1, stream=stream)  # fmt: skip
    chunks = list(got) if stream else [got]
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens[0] == "<|endoftext|>" and text == "".join(tokens[1:]) and len(tokens) == 5
    assert offsets == [0] + [sum(len(t) for t in tokens[1:i]) for i in range(1, 5)]  # (it was 13 + ...)


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_prompt_ending_inside_a_character_puts_the_completion_after_it(client, offline, stream):
    # The prompt's ids end with the first two bytes of "こ" (echoed as "\ufffd"): the first generated
    # token's text starts after that character, not on it.
    prompt = [*offline.encode("To be"), 2515]
    assert offline.tokenizer.decode_single_token_bytes(2515) == "こ".encode()[:2]
    got = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True, logprobs=0, stream=stream)  # fmt: skip
    chunks = list(got) if stream else [got]
    text = "".join(c.choices[0].text for c in chunks)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert text.startswith("To be\ufffd") and len(offsets) > len(prompt)
    assert offsets[len(prompt) - 1] == 5 and offsets[len(prompt)] == 6  # (it was 5: on the "\ufffd")


def test_echo_returns_the_prompt_and_its_logprobs(client, offline):
    got = client.completions.create(
        model="shakespeare", prompt="What light", max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    want = offline.generate("What light", max_new_tokens=5, temperature=0)
    assert got.choices[0].text == "What light" + want.text
    lp = got.choices[0].logprobs
    ids = offline.encode("What light")
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    import torch

    with torch.inference_mode():
        full = torch.log_softmax(offline.model(torch.tensor([ids]))[0, 0], -1)
    assert lp.token_logprobs[1] == pytest.approx(float(full[ids[1]]), abs=1e-5)
    best = offline.tokenizer.decode([int(full.argmax())])  # a prompt token's alternatives, as OpenAI gives:
    assert list(lp.top_logprobs[1]) == [best, lp.tokens[1]]  # the best, then the token itself
    assert lp.top_logprobs[1][best] == pytest.approx(float(full.max()))
    assert lp.top_logprobs[1][lp.tokens[1]] == lp.token_logprobs[1]
    assert len(lp.tokens) == len(ids) + len(want.token_ids)
    streamed = client.completions.create(
        model="shakespeare", prompt="What light", max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text


def test_heavy_echo_leaves_a_stream_beside_it_unchanged_and_stops_when_its_client_leaves(server, offline):
    # 32 prompts of 500 tokens, scored for echo: one prompt's forward between two steps, after admission.
    url = server.url + "/v1/completions"
    heavy = {"prompt": [[11] * 500] * 32, "max_tokens": 0, "echo": True, "logprobs": 1}
    stream_body = {"prompt": "Long ago", "max_tokens": 40, "temperature": 0, "stream": True}
    events: list = []
    with httpx.Client(timeout=0.5) as impatient:
        reader = threading.Thread(target=_sse, args=(url, stream_body, events))
        reader.start()
        with pytest.raises(httpx.TimeoutException):
            impatient.post(url, json=heavy)  # the client leaves after 0.5 s
        reader.join(60)
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert text == offline.generate("Long ago", max_new_tokens=40, temperature=0).text
    assert server.logged("POST /v1/completions 499", timeout=20)  # it stopped scoring: the client left
    small = {"prompt": [[11] * 20] * 2, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    answer = httpx.post(url, json=small, timeout=60).json()
    assert [c["logprobs"]["token_logprobs"][0] for c in answer["choices"]] == [None, None]


def test_tokenize_and_detokenize(server, offline):
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "To be, or not"}).json()
    assert tokens["tokens"] == offline.encode("To be, or not") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == offline.model.config.n_positions
    back = httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": "To be, or not"}


@pytest.mark.parametrize(
    ("path", "body", "param", "match"),
    [("/detokenize", {"tokens": [1], "extra": 3}, "extra", r"^unrecognized request field 'extra'"),
     ("/tokenize", {"prompt": "x", "extra": 3}, "extra", r"^unrecognized request field 'extra'"),
     ("/tokenize", {"prompt": "x", "model": 5}, "model", r"^model: got 5; it must be a string"),
     ("/detokenize", {"tokens": [1], "model": ["a"]}, "model", r"^model: got \['a'\]; it must be a string"),
     ("/v1/completions", {"prompt": "x", "model": 5}, "model", r"^model: got 5; it must be a string"),
     # OpenAI's no-op fields are completions' and chat's only
     ("/v1/attention", {"prompt": "x", "best_of": 1}, "best_of", r"^unrecognized request field 'best_of'"),
     ("/tokenize", {"prompt": "x", "store": False}, "store", r"^unrecognized request field 'store'"),
     ("/tokenize", {"prompt": "x", "messages": []}, "messages", r"^give prompt or messages, not both$")],
)  # fmt: skip
def test_endpoints_refuse_unknown_fields_and_a_model_that_is_not_a_string(server, path, body, param, match):
    reply = httpx.post(server.url + path, json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and re.search(match, error["message"]), error


async def _stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    prompt = ("Once more unto the breach " * (1 + i % 7))[: 5 + 13 * (i % 9)]
    options = dict(temperature=0) if i % 2 else dict(temperature=0.8, top_k=40, seed=i)
    extra = {"extra_body": {"top_k": options.pop("top_k")}} if "top_k" in options else {}
    stream = await client.completions.create(
        model="shakespeare", prompt=prompt, max_tokens=8 + i % 13, stream=True, **options, **extra
    )
    pieces, reason = [], None
    async for chunk in stream:
        pieces.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
    return "".join(pieces), reason


def test_64_concurrent_streams_equal_the_offline_api_and_rss_stays_flat(server, offline):
    async def round_() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(_stream_one(client, i) for i in range(64)))

    results = asyncio.run(round_())
    assert len(results) == 64 and all(reason in ("stop", "length") for _, reason in results)
    # The offline texts, prompts with the same options in one call (deterministic: as each alone).
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(64):
        groups.setdefault((i % 2, 8 + i % 13), []).append(i)
    for (greedy, new), rows in groups.items():
        prompts = [("Once more unto the breach " * (1 + i % 7))[: 5 + 13 * (i % 9)] for i in rows]
        options = dict(temperature=0) if greedy else dict(temperature=0.8, top_k=40, seed=rows)
        for i, completion in zip(rows, offline.generate(prompts, max_new_tokens=new, **options), strict=True):
            assert results[i][0] == completion.text, i
    before = server.rss()
    assert asyncio.run(round_()) == results
    growth = server.rss() - before
    assert growth < 16 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over a second round of 64 streams"
    assert server.metric("slots_busy") == 0 and server.metric("queue_depth") == 0


def test_metrics_write_counts_exactly_past_a_million():
    from generate.serving.metrics_text import _Lines

    out = _Lines()
    out.metric("tokens_total", "counter", "Tokens.", [("", 1_234_567), ('{status="200"}', 2_000_003)])
    out.metric("step_seconds", "summary", "Steps.", [("_sum", 0.1), ("_count", 3)])
    samples = [line for line in out.lines if not line.startswith("#")]
    assert samples == ["gptgen_tokens_total 1234567", 'gptgen_tokens_total{status="200"} 2000003',
                       "gptgen_step_seconds_sum 0.1", "gptgen_step_seconds_count 3"]  # fmt: skip


def test_a_request_cancelled_in_the_same_turn_it_arrives_counts_as_cancelled():
    from generate.engine.engine import Engine
    from generate.engine.request import Request
    from generate.serving.engine_loop import EngineLoop
    from helpers import make_model
    from model import GPTConfig

    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    loop = EngineLoop(Engine(model, slots=1), max_queue=4)

    def turn(*cancels: Request, gone: bool = True) -> None:  # what the engine's thread does between steps
        loop.cancel(list(cancels))
        incoming, cancels, loop._incoming, loop._cancels = loop._incoming, loop._cancels, [], []
        loop._apply(incoming, cancels, gone)

    async def submit(*requests: Request) -> None:
        loop.submit(list(requests))

    came, later, ended = (Request([t], max_new_tokens=5) for t in (1, 2, 3))
    asyncio.run(submit(came, later))
    turn(came, came)  # in the turn it arrives, twice: counted once
    turn(later)  # after it joined the engine
    assert loop.metrics.cancelled == 2 and not loop.engine.has_work
    asyncio.run(submit(ended))
    turn(ended, gone=False)  # (as a shutdown's sweep: no client went away)
    assert loop.metrics.cancelled == 2


def test_attention_requests_waiting_for_a_turn_count_in_the_completions_queue():
    from generate.engine.engine import Engine
    from generate.engine.request import Request
    from generate.serving.engine_loop import EngineLoop, QueueFull
    from helpers import make_model
    from model import GPTConfig

    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    loop = EngineLoop(Engine(model, slots=1), max_queue=4)
    loop.turns_waiting = 3  # (as /v1/attention's waiters set it)

    async def submit(count: int) -> None:
        loop.submit([Request([1], max_new_tokens=1) for _ in range(count)])

    with pytest.raises(QueueFull, match=r"\(0 requests waiting for 1 slot and 3 attention requests for a"):
        asyncio.run(submit(3))  # (one for the free slot)
    asyncio.run(submit(2))  # the free slot's, and the fourth waiting
    with pytest.raises(QueueFull, match=r"\(1 requests waiting for a slot and 3 attention requests for a"):
        loop.admit()


def test_requests_that_free_slots_take_at_the_next_step_are_not_waiting_in_the_queue():
    """A burst at an idle server: the requests the free slots will take do not count against --max-queue
    (they counted, so 9 requests at once to 2 free slots and a queue of 4 had 5 refused, not 3)."""
    from generate.engine.engine import Engine
    from generate.engine.request import Request
    from generate.serving.engine_loop import EngineLoop, QueueFull
    from helpers import make_model
    from model import GPTConfig

    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    loop = EngineLoop(Engine(model, slots=2), max_queue=1)

    async def submit() -> None:
        loop.submit([Request([1], max_new_tokens=1)])

    for _ in range(3):  # two for the free slots, one waits
        asyncio.run(submit())
    with pytest.raises(QueueFull, match=r"\(1 requests waiting for 2 slots and 0 attention requests for a"):
        asyncio.run(submit())
    assert loop.queued == 3 and loop.waiting() == 1


def test_a_client_that_leaves_a_request_that_is_not_streamed_frees_its_slots(server):
    # A running request gets an update every step: the client's leaving is still looked for, every 0.25 s.
    cancelled, left = server.metric("requests_cancelled_total"), server.count("POST /v1/completions 499")
    body = {"prompt": "Hark", "max_tokens": 500, "temperature": 0.9, "stop": "zzzzqqq", "n": 2, "seed": 3}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 3
    while server.metric("slots_busy") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("slots_busy") == 0  # (it took about 6 s to finish all 800 tokens)
    assert server.metric("requests_cancelled_total") == cancelled + 2
    assert server.count("POST /v1/completions 499", left + 1) == left + 1


def test_a_client_that_drops_mid_stream_frees_its_slot_and_is_logged_as_gone(server):
    cancelled, left = server.metric("requests_cancelled_total"), server.count("POST /v1/completions 499")
    body = {"model": "shakespeare", "prompt": "Long ago", "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.metric("slots_busy") == 1
    deadline = time.monotonic() + 10
    while server.metric("slots_busy") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("slots_busy") == 0
    assert server.metric("requests_cancelled_total") == cancelled + 1
    assert server.count("POST /v1/completions 499", left + 1) == left + 1


def test_a_client_that_leaves_while_sending_its_body_is_logged_as_gone_not_as_a_traceback(server):
    import socket
    from urllib.parse import urlparse

    address = urlparse(server.url)
    seen, left = len(server.lines), server.count("POST /v1/completions 499")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(head + b'{"prompt": ')  # 11 bytes of 100, then it goes
        time.sleep(0.5)
    assert server.count("POST /v1/completions 499", left + 1) == left + 1
    assert "Traceback" not in "".join(server.lines[seen:])


def _post(server, body: object, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json"}, **kwargs
    )


BAD = [
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "temperature": True}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 1000}, 400, "n"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": [1, 2, 99999]}, 400, "prompt"),
    ({"prompt": "word " * 600}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_gets_its_status_and_an_openai_error(server, body, status, param):
    response = _post(server, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    if param:
        assert param in error["message"]


def test_bad_chat_requests(server):
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ]:
        response = _post(server, body, "/v1/chat/completions")
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_a_surrogate_field_name_and_a_huge_value_get_short_400_answers(server):
    answer = _post(server, b'{"prompt": "x", "\\ud800": 1}')
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "\\ud800"
    answer = _post(server, b'{"prompt": "x", "stop": "a\\ud800"}')  # a stop string no text can hold
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop"
    assert "lone surrogate" in answer.json()["error"]["message"]
    answer = _post(server, {"prompt": "x", "temperature": "A" * 3_000_000})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "temperature"
    assert len(answer.content) < 1000


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/completions", {"prompt": "a\ud800"}, "prompt"),
     ("/v1/completions", {"prompt": ["x", "\ud800"]}, "prompt[1]"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
     ("/v1/attention", {"prompt": "\ud800"}, "prompt"), ("/tokenize", {"prompt": "\ud800"}, "prompt")],
)  # fmt: skip
def test_a_text_with_a_surrogate_or_beyond_any_window_is_refused_naming_its_field(server, path, body, param):
    answer = _post(server, body, path)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param  # (it was None)
    message = answer.json()["error"]["message"]
    assert message == f"{param}: the text holds a lone UTF-16 surrogate; send valid Unicode"
    # A text of more characters than a window's tokens can have: refused before it is encoded.
    long = json.loads(json.dumps(body).replace("\\ud800", "a " * 40_000))
    error = _post(server, long, path).json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    assert re.fullmatch(
        rf"{re.escape(param)}: the text has \d\d,\d{{3}} characters, more than 512 tokens "
        r"\(the window\) can hold \(65,536 at most\); send a shorter text",
        error["message"],
    )


def test_malformed_json_a_huge_body_and_unknown_routes(server):
    assert _post(server, b'{"prompt": "x",').status_code == 400
    assert _post(server, b"[" * 100_000).status_code == 400
    assert _post(server, b'{"prompt": "x", "temperature": NaN}').status_code == 400
    huge = _post(server, b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}', timeout=60)
    assert huge.status_code == 413 and "exceeds" in huge.json()["error"]["message"]
    missing = httpx.get(server.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(server.url + "/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"  # (HTTP requires Allow with a 405)
    # ... and the server still answers
    assert _post(server, {"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    # A random model: greedy, it runs to the window's end (511 tokens) instead of ending at EOS as the
    # shipped model may, so the first request holds the only slot while the test fills the queue.
    path = tmp_path_factory.mktemp("random")
    config = GPTConfig(vocab_size=50257, n_positions=512, n_embd=128, n_layer=4, n_head=2)
    checkpoints.save(make_model(config, seed=1), path)
    # In int4 (group 64), so that a quantized model is served too.
    options = ["--max-slots", "1", "--max-queue", "1", "--api-key", "sesame", "--dtype", "int4"]
    options += ["--header-timeout", "1", "--body-timeout", "1"]
    s = Server("-c", str(path), *options, "--group-size", "64")
    s.wait_ready()
    s.checkpoint = path
    yield s
    assert s.stop() == 0


def test_an_int4_server_equals_the_offline_int4_api(small_server):
    body = {"prompt": "To be, or not", "max_tokens": 12, "temperature": 0, "logprobs": 0}
    answer = httpx.post(
        small_server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}
    )
    assert answer.status_code == 200
    gen = generate.load(small_server.checkpoint, dtype="int4", group_size=64)
    expected = gen.generate("To be, or not", max_new_tokens=12, temperature=0, logprobs=True)
    choice = answer.json()["choices"][0]
    assert choice["text"] == expected.text
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected.logprobs, abs=1e-6)


def test_a_full_queue_answers_429_at_once_and_the_key_is_required(small_server):
    url, key = small_server.url + "/v1/completions", {"Authorization": "Bearer sesame"}
    assert httpx.post(url, json={"prompt": "x"}).status_code == 401
    assert httpx.post(url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(small_server.url + "/health").status_code == 200  # health needs no key
    for scheme in ("bearer", "BEARER"):  # (a scheme's case does not matter in HTTP)
        models = httpx.get(small_server.url + "/v1/models", headers={"Authorization": f"{scheme} sesame"})
        assert models.status_code == 200
    body = {"prompt": "x", "max_tokens": 1000, "stream": True, "temperature": 0}
    with httpx.stream("POST", url, json=body, headers=key) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(lines)  # it has the slot
        with httpx.stream("POST", url, json=body, headers=key) as queued:
            assert queued.status_code == 200  # it waits in the queue (of 1)
            start = time.monotonic()
            refused = httpx.post(url, json={"prompt": "x"}, headers=key)
            assert refused.status_code == 429 and time.monotonic() - start < 2
            assert refused.json()["error"]["type"] == "rate_limit_error"


ALLOCATOR_FAILURE = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 804112000 bytes. Error code 12 (Cannot allocate memory)"
)


def test_running_out_of_memory_fails_the_requests_plainly_and_the_server_goes_on(offline, monkeypatch):
    """In process (Starlette's test client): the engine's products fail as the CPU allocator does; the
    requests then running get a 500 saying "out of memory" (not the allocator's words), later ones work."""
    from starlette.testclient import TestClient

    from generate.serving.server import Settings, build_app

    app = build_app(Settings("shakespeare"))
    engine = offline.engine(2, 64)
    loop = app.state.gptgen.attach(offline, engine)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    body = {"model": "shakespeare", "prompt": "To be", "max_tokens": 4, "temperature": 0}
    try:
        with TestClient(app) as http:
            real = engine.runner.decode

            def fails(*args, **kwargs):
                raise RuntimeError(ALLOCATOR_FAILURE)

            monkeypatch.setattr(engine.runner, "decode", fails)
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 500
            message = answer.json()["error"]["message"]
            assert message == (
                "the engine failed: out of memory (an allocation of 767 MiB failed); run fewer requests at "
                "once, fewer new tokens, a shorter prompt or a smaller dtype"
            )
            monkeypatch.setattr(engine.runner, "decode", real)
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200
            want = offline.generate("To be", max_new_tokens=4, temperature=0).text
            assert answer.json()["choices"][0]["text"] == want
    finally:
        loop.close()
        thread.join(30)


def test_a_connection_trickling_its_headers_is_closed_at_the_header_timeout(small_server):
    import socket
    from urllib.parse import urlparse

    address = urlparse(small_server.url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        start = time.monotonic()
        closed = False
        for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" * 10:  # one byte every 0.1 s
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - start > 3:
                break
        if not closed:
            sock.settimeout(3)
            closed = sock.recv(1024) == b""
    assert closed and time.monotonic() - start < 4
    assert httpx.get(small_server.url + "/health").status_code == 200  # others are served as before


def test_a_kept_alive_connection_has_the_header_timeout_for_its_next_request(server):
    # --header-timeout is 10 s: a connection idle 6 s after its answer still takes a request (uvicorn's own
    # keep-alive timeout, 5 s, closed it first; a load balancer keeping connections longer then got errors).
    import socket
    from urllib.parse import urlparse

    address = urlparse(server.url)
    ask = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    def answer(sock: socket.socket) -> bytes:
        got = b""
        while not got.endswith(b"}") and (more := sock.recv(4096)):
            got += more
        return got

    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(ask)
        assert answer(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        sock.sendall(ask)
        assert answer(sock).startswith(b"HTTP/1.1 200")


def test_a_body_trickling_in_gets_408_at_the_body_timeout(small_server):
    import socket
    from urllib.parse import urlparse

    address = urlparse(small_server.url)
    body = json.dumps({"prompt": "To be", "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sesame\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall(head + body[:3])
        for byte in body[3:10]:  # one byte every 0.2 s, past the 1 s deadline
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        sock.settimeout(3)
        answer = b""
        while not answer.rstrip().endswith(b"}") and (more := sock.recv(4096)):
            answer += more
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"body_timeout"' in answer.replace(b" ", b"") and time.monotonic() - start < 3
    assert httpx.get(small_server.url + "/health").status_code == 200


def test_too_many_completions_for_the_queue_get_400_at_once(small_server):
    url, key = small_server.url + "/v1/completions", {"Authorization": "Bearer sesame"}
    three = {"prompt": ["a", "b", "c"], "max_tokens": 1}  # (a slot and a queue of 1 take 2)
    answer = httpx.post(url, json=three, headers=key)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "too_many_completions"
    assert "takes at most 2 at once (1 in its slots" in error["message"]
    answer = httpx.post(url, json={"prompt": ["a", "b"], "max_tokens": 1}, headers=key)  # (the slot takes 1)
    assert answer.status_code == 200 and len(answer.json()["choices"]) == 2


def _sse(url: str, body: dict, out: list) -> None:
    """Read a stream's SSE data lines into ``out`` (then the status as its last item)."""
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        out.extend(line[6:] for line in response.iter_lines() if line.startswith("data: "))
        out.append(response.status_code)


def test_a_signal_ends_what_runs_past_the_timeout_with_503_and_exits_0(tmp_path):
    # One slot and a model slow enough that three 1,000-token requests cannot finish within the timeout: the
    # first streams, the other two wait. SIGINT after 1 s: 2 s later whatever still runs or waits ends with
    # an OpenAI-style 503; the server exits 0 with no traceback.
    config = GPTConfig(vocab_size=50257, n_positions=1024, n_embd=384, n_layer=8, n_head=4)
    checkpoints.save(make_model(config, seed=1), tmp_path)
    server = Server("-c", str(tmp_path), "--max-slots", "1", "--shutdown-timeout", "2")
    server.wait_ready()
    url = server.url + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 1000, "temperature": 0}
    streamed, queued_stream, whole, official = [], [], [], []
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id

    def official_stream() -> None:  # the openai client, queued too: its stream ends in an APIError
        try:
            for chunk in client.completions.create(model=name, stream=True, **body):
                official.append(chunk.choices[0].text)
        except openai.APIError as e:
            official.append(e)

    threads = [
        threading.Thread(target=_sse, args=(url, {**body, "stream": True}, streamed)),
        threading.Thread(target=lambda: whole.append(httpx.post(url, json=body, timeout=60))),
        threading.Thread(target=_sse, args=(url, {**body, "stream": True}, queued_stream)),
        threading.Thread(target=official_stream),
    ]
    for t in threads:
        t.start()
        time.sleep(0.2)
    time.sleep(1)
    server.proc.send_signal(signal.SIGINT)
    start = time.monotonic()
    assert server.proc.wait(30) == 0, "".join(server.lines)
    assert time.monotonic() - start < 2 + 5 + 3  # the timeout, the margin to answer, slack
    for t in threads:
        t.join(10)
    log = "".join(server.lines)
    assert "Traceback" not in log and "Event loop is closed" not in log, log
    assert whole[0].status_code == 503 and whole[0].json()["error"]["code"] == "shutting_down"
    for events in (streamed, queued_stream):  # (the first could end in time on a fast machine)
        assert events[-2:] == ["[DONE]", 200], events[-3:]
        last = json.loads(events[-3])
        assert (events is streamed and "error" not in last) or last["error"]["code"] == "shutting_down"
    assert "error" in json.loads(queued_stream[-3])
    assert isinstance(official[-1], openai.APIError) and "shutting down" in str(official[-1]), official[-1:]


def test_an_ipv6_host_is_said_as_a_url(tmp_path):
    # (it said http://::1:PORT, which no client can use)
    checkpoints.save(make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32)), tmp_path)
    s = Server("-c", str(tmp_path), "--host", "::1")
    try:
        assert s.url.startswith("http://[::1]:"), s.url
        s.wait_ready()
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_a_speculating_server_streams_the_offline_text_and_counts_proposals(tmp_path):
    s = Server("--draft", "ngram", "--max-slots", "2")
    try:
        s.wait_ready()
        offline = generate.load("shakespeare", slots=2, deterministic=True, draft="ngram")
        prompts = ["ROMEO:\nI will, I will, I will go. ROMEO:\nI will", "To be, or not to be, that is"]
        body = {"max_tokens": 30, "temperature": 0.8, "top_p": 0.95, "seed": 5, "stream": True}

        def stream(prompt: str) -> str:
            with httpx.stream("POST", s.url + "/v1/completions", json={**body, "prompt": prompt}) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both in the engine at once
            texts = list(pool.map(stream, prompts))
        for prompt, text in zip(prompts, texts, strict=True):
            assert (
                text == offline.generate(prompt, max_new_tokens=30, temperature=0.8, top_p=0.95, seed=5).text
            )
        assert s.metric("speculative_accepted_total") > 0
        assert 0 < s.metric("speculative_acceptance_rate") <= 1
    finally:
        assert s.stop() == 0, "".join(s.lines)


def test_echo_of_nan_logits_is_500_generation_failed_not_nan_in_the_body(tmp_path, caplog):
    """In process: a checkpoint whose logits are NaN, its prompt scored for echo with no token to generate:
    500 generation_failed, as generating from it (the body held NaN, which JSON has not, or failed as an
    internal error)."""
    model = make_model(GPTConfig(n_layer=1, n_head=2, n_embd=16, n_positions=32), std=0.3)
    with torch.no_grad():
        model.h[0].attn.c_attn.weight[0, 0] = float("nan")
    with served_in_process(model, tmp_path) as http, caplog.at_level(logging.INFO, logger="gptgen"):
        body = {"prompt": "To be or not", "max_tokens": 0, "echo": True, "logprobs": 1}
        for stream in (False, True):
            answer = http.post("/v1/completions", json=body | {"stream": stream})
            assert answer.status_code == 500, answer.text
            error = answer.json()["error"]
            assert error["code"] == "generation_failed" and "NaN or infinite logits" in error["message"]
        streamed = http.post("/v1/completions", json={"prompt": "To be", "max_tokens": 3, "stream": True})
        assert streamed.status_code == 200 and '"generation_failed"' in streamed.text  # (its error event)
    # Failures are logged as warnings (--log-level warning shows them), a failed stream not as cancelled.
    lines = [r for r in caplog.records if " /v1/completions " in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.WARNING] * 3, [r.getMessage() for r in lines]
    assert not any("cancelled" in r.getMessage() for r in lines)
