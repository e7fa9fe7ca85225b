"""The playground (generate/serving/playground.py and its page), tested as a user and a client see it: a real
`gptgen playground` in a subprocess (the shipped model, one slot, a queue of one), its page in headless
Chromium (Debian's package, driven by Playwright), and `POST /v1/attention` over plain HTTP.

Everything the page shows is compared with the offline API on the same model: the greedy text and its
logprobs with `Generator.generate`, the attention weights with `Generator.attention`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

import generate
from generate.serving import playground
from generate.serving.openai_api import APIError, TokenText
from model import GPTConfig

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
PROMPT = "To be, or not to be"
WEB = Path(playground.__file__).parent / "web"


class Server:
    """A `gptgen playground` subprocess with one slot and a queue of one; its stderr collected in a thread."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", "generate.tools.gptgen", "playground", "--port", "0"]
        command += ["--max-slots", "1", "--max-queue", "1"]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.lines = [self.proc.stderr.readline(), self.proc.stderr.readline()]
        match = re.search(r"listening on (http://\S+)", self.lines[0])
        assert match, self.lines
        self.url = match.group(1)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 120
        while httpx.get(self.url + "/health").status_code != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.1)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return float(re.search(rf"^gptgen_{name} (\S+)$", text, re.M).group(1))

    def wait_idle(self) -> None:
        until(lambda: self.metric("slots_busy") == 0 and self.metric("queue_depth") == 0)


def until(condition, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0, "".join(s.lines)


@pytest.fixture(scope="module")
def offline():
    """The offline API at the server's width: the same bits as the server (docs/server.md)."""
    return generate.load("shakespeare", slots=1, deterministic=True)


@pytest.fixture(scope="module")
def browser():
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is missing: install Debian's package (apt-get install chromium; .ci/run does)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server):
    """A fresh page of the playground at 1280x800; every request it makes must go to its own server."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    page.wait_for_function("() => document.getElementById('model').textContent.startsWith('shakespeare')")
    yield page
    context.close()
    assert not errors, errors
    assert requests and all(url.startswith(server.url + "/") for url in requests), requests


def run(page, prompt: str = PROMPT, *, wait: bool = True, **controls: str) -> None:
    """Type the prompt, set the controls (by test id), press Generate, and wait for the end."""
    page.get_by_test_id("prompt").fill(prompt)
    for name, value in controls.items():
        page.get_by_test_id(name.replace("_", "-")).fill(value)
    page.get_by_test_id("generate").click()
    if wait:
        page.wait_for_function(
            "() => /^(Done|Stopped)/.test(document.querySelector('[data-testid=status]').textContent) || "
            "!document.querySelector('[data-testid=error]').hidden"
        )


def tokens(page) -> list[dict]:
    return page.eval_on_selector_all(
        "[data-testid=token]",
        "els => els.map(e => ({index: +e.dataset.index, kind: e.dataset.kind, text: e.dataset.text, "
        "shown: e.textContent, logprob: e.dataset.logprob === undefined ? null : +e.dataset.logprob}))",
    )


def test_greedy_text_in_the_page_equals_the_offline_api_token_by_token(page, offline):
    run(page, temperature="0", max_tokens="24")
    want = offline.generate(PROMPT, max_new_tokens=24, temperature=0, logprobs=True)
    assert page.get_by_test_id("output").text_content() == want.text
    got = tokens(page)
    assert [t["index"] for t in got] == list(range(len(got)))
    prompt, generated = got[: -len(want.token_ids)], got[-len(want.token_ids) :]
    assert "".join(t["text"] for t in prompt) == PROMPT and all(t["kind"] == "prompt" for t in prompt)
    assert len(prompt) == len(offline.encode(PROMPT)) and all(t["logprob"] is None for t in prompt)
    assert [t["kind"] for t in generated] == ["generated"] * len(want.token_ids)
    assert "".join(t["shown"] for t in generated) == want.text
    name = TokenText(offline.tokenizer.decode_single_token_bytes)  # (OpenAI's token strings)
    assert [t["text"] for t in generated] == [name(i) for i in want.token_ids]
    assert [t["logprob"] for t in generated] == pytest.approx(want.logprobs, abs=1e-5)
    assert page.get_by_test_id("generate").is_enabled() and page.get_by_test_id("stop").is_disabled()


def cells(page) -> list[dict]:
    return page.eval_on_selector_all(
        "[data-testid=attention-cell]",
        "els => els.map(e => ({q: +e.dataset.query, k: +e.dataset.key, layer: +e.dataset.layer, "
        "head: +e.dataset.head, w: +e.dataset.weight, masked: e.dataset.masked === 'true'}))",
    )


def check_matrix(got: list[dict], want: torch.Tensor, layer: int, head: int) -> None:
    """The cells are layer ``layer``, head ``head`` of ``want`` (n_layer, n_head, T, T), each once."""
    t = want.shape[-1]
    assert len(got) == t * t and {(c["q"], c["k"]) for c in got} == {
        (q, k) for q in range(t) for k in range(t)
    }
    assert all(c["layer"] == layer and c["head"] == head for c in got)
    for c in got:
        assert c["w"] == pytest.approx(float(want[layer, head, c["q"], c["k"]]), abs=1e-5)
        assert c["masked"] == (c["k"] > c["q"])
        if c["masked"]:
            assert c["w"] == 0
    for q in range(t):
        assert math.fsum(c["w"] for c in got if c["q"] == q) == pytest.approx(1, abs=1e-5)


def test_a_selected_token_shows_the_offline_attention_with_the_future_masked(page, offline):
    run(page, temperature="0", max_tokens="10")
    text = PROMPT + page.get_by_test_id("output").text_content()
    want = offline.attention(text)  # (n_layer, n_head, T, T)
    t = want.shape[-1]
    assert len(tokens(page)) == t
    token = page.locator(f'[data-testid=token][data-index="{t - 3}"]')
    token.focus()
    token.press("Enter")  # the keyboard selects
    view = page.get_by_test_id("attention")
    page.wait_for_function(
        f"() => document.querySelectorAll('[data-testid=attention-cell]').length === {t * t}"
    )
    assert view.is_visible() and token.get_attribute("aria-pressed") == "true"
    check_matrix(cells(page), want, 0, 0)
    page.select_option("#layer", "5")
    page.select_option("#head", "2")
    first = "document.querySelector('[data-testid=attention-cell]').dataset"
    page.wait_for_function(f"() => {first}.layer === '5' && {first}.head === '2'")
    check_matrix(cells(page), want, 5, 2)
    assert page.locator(".strip").count() == want.shape[0] * want.shape[1]
    page.locator('.strip[data-layer="7"][data-head="3"]').click()  # a strip enlarges its head
    page.wait_for_function(f"() => {first}.layer === '7' && {first}.head === '3'")
    check_matrix(cells(page), want, 7, 3)
    page.locator("#mask-toggle").click()
    assert page.locator("#matrix").get_attribute("class").split()[-1] == "mask-mode"


def test_stop_ends_a_long_generation_and_frees_the_slot(page, server):
    cancelled = server.metric("requests_cancelled_total")
    run(page, "Long ago", wait=False, temperature="0", max_tokens="480")
    page.wait_for_function("() => document.querySelectorAll('[data-kind=generated]').length >= 3")
    assert server.metric("slots_busy") == 1
    page.get_by_test_id("stop").click()
    page.wait_for_function(
        "() => document.querySelector('[data-testid=status]').textContent.startsWith('Stopped')"
    )
    server.wait_idle()
    assert server.metric("requests_cancelled_total") == cancelled + 1
    assert page.locator("[data-kind=generated]").count() < 480
    assert page.get_by_test_id("generate").is_enabled() and page.get_by_test_id("stop").is_disabled()


def test_a_bad_value_shows_the_servers_message_in_the_page(page):
    run(page, temperature="-1")
    error = page.get_by_test_id("error")
    assert error.is_visible() and "temperature: got -1; it must be >= 0" in error.text_content()
    assert page.get_by_test_id("temperature").get_attribute("aria-invalid") == "true"
    assert page.get_by_test_id("output").text_content() == ""
    run(page, "word " * 600, temperature="0")
    assert "window is 512 positions" in error.text_content()


def _hold(url: str, out: list) -> None:
    """A long greedy stream, read until the test closes the server's slot for it."""
    body = {"prompt": "Long ago", "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        out.append(response.status_code)
        for _ in response.iter_lines():
            if len(out) > 1:
                return


@contextlib.contextmanager
def full(server):
    """The server's one slot and its queue of one held by two long streams; idle again after."""
    held: list[list] = [[], []]
    threads = [threading.Thread(target=_hold, args=(server.url, out)) for out in held]
    try:
        threads[0].start()
        until(lambda: server.metric("slots_busy") == 1)
        threads[1].start()  # the queue (of one) is full
        until(lambda: server.metric("queue_depth") == 1)
        yield
    finally:
        for out in held:
            out.append("done")
        for thread in threads:
            thread.join(30)
    server.wait_idle()


def test_a_busy_server_says_so_in_the_page_and_to_attention_requests(page, server):
    with full(server):
        busy = httpx.post(server.url + "/v1/attention", json={"prompt": PROMPT})
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
        run(page, temperature="0")
        assert page.get_by_test_id("error").text_content().startswith("The server is busy: ")


def select(page, index: int) -> None:
    page.locator(f'[data-testid=token][data-index="{index}"]').click()
    page.wait_for_function("() => !document.getElementById('attention').hasAttribute('aria-busy')")


def test_a_text_that_fills_the_window_shows_the_attention_over_its_own_tokens(page, offline):
    # Its text encodes into 513 tokens, one more than the window: the page asked for those before, and the
    # server refused them. It now sends the ids generated (return_token_ids), whatever the text encodes into.
    prompt = "To be, or not to be, that is the question. " * 37
    run(page, prompt, temperature="1.6", seed="6", max_tokens="64")
    want = offline.generate(prompt, max_new_tokens=64, temperature=1.6, seed=6)
    assert want.finish_reason == "length" and len(offline.encode(prompt)) + len(want.token_ids) == 512
    assert len(offline.encode(prompt + want.text)) == 513
    select(page, 511)
    assert page.locator("#attention-error").is_hidden()
    assert page.locator(".strip").count() == 8 * 4 and page.locator("canvas.matrix-canvas").count() == 1


def test_a_failed_attention_request_clears_what_another_token_showed(page, server):
    run(page, temperature="0", max_tokens="8")
    select(page, 3)
    assert page.locator(".strip").count() > 0
    with full(server):
        select(page, 6)  # refused (429): token 3's strips and matrix are not left under the message
        assert page.locator("#attention-error").text_content().startswith("No attention: The server is busy")
        assert (
            page.locator(".strip").count() == 0 and page.locator("[data-testid=attention-cell]").count() == 0
        )
        assert (
            page.locator("#strips-title").text_content() == ""
            and page.locator("#matrix-caption").text_content() == ""
        )
        page.select_option("#layer", "2")  # nothing to draw a layer of: still nothing, not "Computing…"
        assert page.locator("[data-testid=attention-cell]").count() == 0
        assert page.locator("#matrix-caption").text_content() == ""
        page.locator("#mask-toggle").click()  # nor token 3's caption, nor its matrix when the window resizes
        page.set_viewport_size({"width": 1100, "height": 800})
        page.wait_for_timeout(400)  # (the page redraws 200 ms after the last resize)
        assert page.locator("#matrix-caption").text_content() == ""
        assert page.locator("[data-testid=attention-cell]").count() == 0
        page.locator("#mask-toggle").click()
    select(page, 6)
    assert page.locator("#attention-error").is_hidden() and page.locator(".strip").count() == 8 * 4


def test_a_head_chosen_from_the_keyboard_keeps_the_focus(page):
    run(page, temperature="0", max_tokens="4")
    token = page.locator('[data-testid=token][data-index="2"]')
    token.focus()
    token.press("Enter")
    page.wait_for_selector("[data-testid=attention-cell]")
    page.locator('.strip[data-layer="1"][data-head="2"]').focus()
    page.keyboard.press("Enter")
    first = "document.querySelector('[data-testid=attention-cell]').dataset"
    page.wait_for_function(f"() => {first}.layer === '1' && {first}.head === '2'")
    focused = "(a => `${a.dataset.layer}/${a.dataset.head}`)(document.activeElement)"
    assert page.evaluate(focused) == "1/2"  # (it was the page's body: the strips were drawn anew)
    assert page.locator(".strip[aria-pressed=true]").count() == 1
    assert page.locator('.strip[data-layer="1"][data-head="2"]').get_attribute("aria-pressed") == "true"
    page.keyboard.press("Tab")  # on to the next head
    assert page.evaluate(focused) == "1/3"


def test_the_query_line_says_a_prompt_token_was_given_not_chosen(page):
    run(page, temperature="0", max_tokens="3")
    select(page, 2)  # ",": the prompt gives the next token, " or"
    line = page.locator("#query-line").text_content()
    assert "3 ␣or" in line and "prompt" in line and "chose" not in line
    select(page, 6)  # the prompt's last token: its output chose the first generated token
    chose = "The model's output at this position chose the next token, 7 "
    assert page.locator("#query-line").text_content().startswith(chose)


def test_a_stream_the_network_breaks_says_so_plainly(page):
    # The answer's body fails after its headers, as when the server is killed mid-stream: fetch's reader
    # throws a TypeError, "network error", which the page showed as it was.
    page.evaluate(
        """() => {
        const real = window.fetch;
        window.fetch = async (path, init) => {
            const answer = await real(path, init);
            if (path !== "/v1/completions") return answer;
            const body = new ReadableStream({ start(c) { c.error(new TypeError("network error")); } });
            return new Response(body, { status: answer.status, headers: answer.headers });
        };
    }"""
    )
    run(page, temperature="0", max_tokens="4")
    error = page.get_by_test_id("error").text_content()
    assert error == "The server closed the stream before it finished; try again."
    assert page.get_by_test_id("generate").is_enabled() and page.get_by_test_id("stop").is_disabled()


def test_text_held_back_when_the_stream_fails_is_said_to_be_so_not_a_stop_strings(page):
    # The server's events, faked: the echo, a token whose text is held back (a stop string's start, say),
    # then the stream's error. Its tip called the token "part of a stop string, which is not returned".
    page.evaluate(
        """() => {
        const echo = { tokens: ["Hi"], token_logprobs: [null], text_offset: [0], top_logprobs: [null] };
        const held = { tokens: [" sid"], token_logprobs: [-1.5], text_offset: [2],
                       top_logprobs: [{ " sid": -1.5 }] };
        const events = [
            { choices: [{ index: 0, text: "Hi", logprobs: echo, prompt_token_ids: [17250], token_ids: [] }] },
            { choices: [{ index: 0, text: "", logprobs: held, token_ids: [9785] }] },
            { error: { message: "the model produced NaN or infinite logits", type: "server_error",
                       param: null, code: "generation_failed" } },
        ];
        const body = events.map((e) => `data: ${JSON.stringify(e)}\n\n`).join("");
        const real = window.fetch;
        window.fetch = async (path, init) => path !== "/v1/completions" ? real(path, init)
            : new Response(body, { status: 200, headers: { "Content-Type": "text/event-stream" } });
    }"""
    )
    run(page, "Hi", temperature="0", max_tokens="4")
    assert "NaN or infinite logits" in page.get_by_test_id("error").text_content()
    (held,) = [t for t in tokens(page) if t["kind"] == "generated"]
    page.locator(f"[data-testid=token][data-index='{held['index']}']").hover()
    tip = page.locator("#tip").text_content()
    assert "Not in the text: the stream ended in an error while it was held back" in tip, tip


def test_a_seed_past_2_to_the_53_is_sent_as_typed(page, offline):
    seed = 2**53 + 1  # (a JavaScript number is 2**53: another seed, another text)
    run(page, "To be", temperature="1", seed=str(seed), max_tokens="12")
    want = offline.generate("To be", max_new_tokens=12, temperature=1, seed=seed)
    assert page.get_by_test_id("output").text_content() == want.text
    assert want.text != offline.generate("To be", max_new_tokens=12, temperature=1, seed=2**53).text


def test_the_page_fits_a_phone(browser, server):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    page.goto(server.url + "/")
    run(page, temperature="0", max_tokens="12")
    page.locator('[data-testid=token][data-index="4"]').tap()
    page.wait_for_selector("[data-testid=attention-cell]")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing wider than the screen
    context.close()


def test_a_tap_shows_the_tip_on_a_phone(browser, server):
    """A touch has no hover: a tapped token keeps its tip (its probability, the alternatives), a tapped cell
    its weight, through a scroll, until a tap elsewhere (they were hidden as the tap ended)."""
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    page.goto(server.url + "/")
    run(page, temperature="0", max_tokens="6")
    tip = page.locator("#tip")
    page.locator('[data-testid=token][data-index="8"]').tap()  # (the page scrolls down to the attention)
    page.wait_for_selector("[data-testid=attention-cell]")
    page.wait_for_timeout(1000)  # (the smooth scroll's end)
    assert tip.is_visible() and "token 8 · generated" in tip.text_content() and "p = " in tip.text_content()
    scrolled, cdp = page.evaluate("window.scrollY"), context.new_cdp_session(page)
    for kind, y in [("touchStart", 300), *(("touchMove", y) for y in range(320, 700, 20)), ("touchEnd", 0)]:
        cdp.send("Input.dispatchTouchEvent", {"type": kind, "touchPoints": [{"x": 200, "y": y}] * (y > 0)})
    until(lambda: page.evaluate("window.scrollY") < scrolled - 200)  # a finger scrolled back up
    assert tip.is_visible()
    page.locator('[data-testid=attention-cell][data-query="8"][data-key="2"]').tap()
    page.wait_for_timeout(300)
    assert tip.is_visible() and "query 8, key 2 · layer 0, head 0" in tip.text_content()
    page.locator("h1").tap()
    page.wait_for_timeout(300)
    assert tip.is_hidden()
    context.close()


def attention(server, body: object) -> httpx.Response:
    return httpx.post(server.url + "/v1/attention", content=json.dumps(body).encode(), timeout=60)


def test_attention_over_http_equals_generator_attention(server, offline):
    text = "Now is the winter of our discontent"
    answer = attention(server, {"prompt": text, "model": "shakespeare"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    got = answer.json()
    ids = offline.encode(text)
    assert got["token_ids"] == ids and "".join(got["tokens"]) == text
    assert got["layers"] == list(range(8)) and got["heads"] == list(range(4))
    want = offline.attention(text)
    torch.testing.assert_close(torch.tensor(got["weights"]), want, atol=1e-5, rtol=0)
    one = attention(server, {"prompt": ids, "layer": 6, "head": 3, "query": 4}).json()
    assert one["layers"] == [6] and one["heads"] == [3] and one["queries"] == [4]
    torch.testing.assert_close(torch.tensor(one["weights"]), want[6:7, 3:4, 4:5], atol=1e-5, rtol=0)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'gptgen_requests_total{endpoint="/v1/attention",status="200"}' in metrics


BAD = [
    ({"prompt": PROMPT, "layer": 8}, "layer", "it must be an integer in 0..7"),
    ({"prompt": PROMPT, "layer": -1}, "layer", "it must be an integer in 0..7"),
    ({"prompt": PROMPT, "head": 4}, "head", "it must be an integer in 0..3"),
    ({"prompt": PROMPT, "head": "1"}, "head", "it must be an integer in 0..3"),
    ({"prompt": PROMPT, "query": 7}, "query", "it must be an integer in 0..6"),
    ({"prompt": "word " * 600}, "prompt", "it has 601 tokens, but the model's window holds 512"),
    ({"prompt": [5] * 200}, "layer", "8 layers x 4 heads x 200 query rows x 200 tokens = 1,280,000 weights"),
    ({"prompt": [1, 99999]}, "prompt", "token id 99999 is outside the vocabulary 0..50256"),
    ({"prompt": []}, "prompt", "a string or a non-empty list of token ids"),
    ({"prompt": PROMPT, "layers": [1]}, "layers", "unrecognized request field 'layers'"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_attention_request_gets_400_naming_the_field(server, body, param, message):
    answer = attention(server, body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (
        error["param"] == param and message in error["message"] and error["type"] == "invalid_request_error"
    )


def test_more_tokens_than_an_attention_request_takes_are_refused_below_a_longer_window():
    config = GPTConfig(n_positions=1024, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(APIError, match="it has 513 tokens, but at most 512 a call") as refused:
        playground.parse_attention({"prompt": [1] * 513}, encode=list, config=config, vocab=50257)
    assert refused.value.param == "prompt" and refused.value.code == "too_many_tokens"


def test_attention_is_refused_with_503_at_shutdown(offline):
    """In process: once the server stops taking work, an attention request gets 503, not a wait."""
    from starlette.testclient import TestClient

    from generate.serving.server import Settings, build_app

    app = build_app(Settings("shakespeare"))
    loop = app.state.gptgen.attach(offline, offline.engine(1, 64))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        with TestClient(app) as http:
            assert http.post("/v1/attention", json={"prompt": "To be"}).status_code == 200
            loop.stop(60)
            answer = http.post("/v1/attention", json={"prompt": "To be"})
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down"
    finally:
        loop.close()
        thread.join(30)
    assert not thread.is_alive()


def test_nan_attention_weights_are_a_500_not_invalid_json(tmp_path):
    """In process: a checkpoint whose attention is NaN gets 500 attention_failed (its weights would be a
    200 holding NaN, which JSON has not)."""
    from helpers import make_model, served_in_process

    model = make_model(GPTConfig(n_layer=2, n_head=2, n_embd=16, n_positions=32), std=0.3)
    with torch.no_grad():
        model.h[1].attn.c_attn.weight[0, 0] = float("nan")
    with served_in_process(model, tmp_path) as http:
        assert http.post("/v1/attention", json={"prompt": "To be", "layer": 0}).status_code == 200
        answer = http.post("/v1/attention", json={"prompt": "To be", "layer": 1, "head": 0})
        assert answer.status_code == 500
        error = answer.json()["error"]
        assert error["code"] == "attention_failed"
        assert "NaN or infinite attention weights in layer 1" in error["message"]


def test_the_page_and_its_files_are_served_with_their_types(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    names = re.findall(r'(?:src|href)="/playground/([^"]+)"', page.text)
    names += [n for f in WEB.glob("*.js") for n in re.findall(r'from "\./([^"]+)"', f.read_text())]
    assert set(names) == {f.name for f in WEB.iterdir()} - {"index.html"}
    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
    for name in names:
        answer = httpx.get(f"{server.url}/playground/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"] == types[Path(name).suffix]
        assert answer.content == (WEB / name).read_bytes()
    for missing in ["nothing.js", "..%2Fplayground.py", ".hidden.css", "index"]:
        assert httpx.get(f"{server.url}/playground/{missing}").status_code == 404


def test_the_shipped_files_name_no_other_server():
    for f in WEB.iterdir():
        text = f.read_text()
        assert not re.search(r"https?:|wss?:|@import|(?:src|href)\s*=\s*[\"']?//", text), f.name
        assert not re.search(r"url\(\s*[\"']?(?!data:)", text), f.name  # (CSS: only data: URLs)


def test_the_playground_command_says_where_the_page_is(server):
    port = server.url.rsplit(":", 1)[1]
    assert server.lines[1] == f"gptgen playground: the playground is at http://127.0.0.1:{port}/\n"


def test_playground_open_says_and_opens_the_address(monkeypatch, capsys):
    import webbrowser

    from generate.tools import serve

    assert "--open" in serve.build_parser(playground=True).format_help()
    assert "--open" not in serve.build_parser().format_help()
    opened = []
    monkeypatch.setattr(webbrowser, "open", lambda url: opened.append(url) or len(opened) < 3)
    serve._announce("gptgen playground", "0.0.0.0", 8123, True)
    serve._announce("gptgen playground", "::", 8123, True)
    assert opened == ["http://127.0.0.1:8123/", "http://[::1]:8123/"]
    serve._announce("gptgen playground", "127.0.0.1", 8123, True)  # no browser here
    assert capsys.readouterr().err.splitlines() == [
        "gptgen playground: the playground is at http://127.0.0.1:8123/",
        "gptgen playground: the playground is at http://[::1]:8123/",
        "gptgen playground: the playground is at http://127.0.0.1:8123/",
        "gptgen playground: no web browser could be opened here; open http://127.0.0.1:8123/ yourself",
    ]
