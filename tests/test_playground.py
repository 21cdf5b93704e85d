"""The logprob playground (`/playground`) in a real browser: headless Chromium drives the page
against a live server on a tiny random model that has SmolLM2's tokenizer and chat template, with
prompt lookup as its drafter. Every assertion reads the DOM and compares it with what the server
answers to the same request (the page shows its last request as JSON; the test re-sends it).

Chromium comes from Debian's `chromium` and `chromium-driver` (.ci/run installs them). Where they
are missing the browser tests skip, naming the packages, unless VERISPEC_REQUIRE_BROWSER=1 (CI),
which makes a missing browser a failure.
"""

from __future__ import annotations

import colorsys
import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest

from conftest import make_tiny_checkpoint
from server_utils import ServerProcess
from verispec.config import EngineConfig, SpeculativeConfig
from verispec.entrypoints.openai.playground import STATIC, playground_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# A prompt whose tail repeats, so prompt lookup has drafts and a random model's greedy loops land them.
LOOP_PROMPT = " ".join(["red green blue"] * 12)


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_path) -> str:
    """A tiny random llama with SmolLM2's tokenizer (so text, chat template and EOS are real). Tied
    embeddings at this scale make greedy decoding fall into loops of a few tokens, which prompt
    lookup drafts and the target accepts: every token source shows up."""
    from verispec.models.tokenizer_cache import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("chat") / "llama", "llama", vocab_size=len(tok),
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.1)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    srv = ServerProcess("--model", tiny_chat_model, "--dtype", "float32", "--speculative-config", json.dumps(SPEC),
                        api_key="pg-key")
    yield srv
    srv.stop()


# ------------------------------------------------------------------------------------ the route
def test_the_config_names_the_drafter_and_the_package_holds_every_asset():
    spec = playground_config(EngineConfig(speculative=SpeculativeConfig.parse(SPEC)), "m", api_key_required=False)
    assert spec == {"model": "m", "speculative_method": "ngram", "num_speculative_tokens": 4, "api_key_required": False}
    assert playground_config(EngineConfig(), "m", True)["speculative_method"] is None
    page = (STATIC / "playground.html").read_text()
    for name in ("playground.js", "playground-view.js", "playground.css"):
        assert f"/playground/{name}" in page and (STATIC / name).exists()
    # No markup from strings anywhere in the page's script: text goes in with textContent.
    for name in ("playground.js", "playground-view.js"):
        assert "innerHTML" not in (STATIC / name).read_text() and "insertAdjacentHTML" not in (STATIC / name).read_text()


def test_the_page_and_its_assets_are_served_with_a_strict_policy(server):
    page = server.get("/playground", headers={"Authorization": ""})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    for name, kind in (("playground.js", "text/javascript"), ("playground-view.js", "text/javascript"),
                       ("playground.css", "text/css")):
        asset = server.get(f"/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
    assert server.get("/playground/../api_server.py").status_code == 404
    assert server.get("/playground/nothing.js").status_code == 404
    config = server.get("/playground/config.json").json()
    assert config["speculative_method"] == "ngram" and config["num_speculative_tokens"] == 4
    assert config["api_key_required"] is True
    # The page needs no key; the routes it calls still do.
    assert server.post("/v1/completions", {"prompt": "a", "max_tokens": 1}, headers={"Authorization": ""}).status_code == 401


def test_token_sources_over_http_count_the_accepted_drafts(server):
    body = {"prompt": LOOP_PROMPT, "max_tokens": 40, "temperature": 0, "return_token_sources": True,
            "return_token_ids": True}
    choice = server.post("/v1/completions", body).json()["choices"][0]
    sources = choice["token_sources"]
    assert len(sources) == len(choice["token_ids"]) == 40
    assert {s["kind"] for s in sources} >= {"accepted"}
    off = server.post("/v1/completions", {**body, "speculative": False}).json()["choices"][0]
    assert off["token_ids"] == choice["token_ids"]
    assert {s["kind"] for s in off["token_sources"]} == {"sampled"}
    assert all(s["drafts"] == 0 for s in off["token_sources"])
    assert choice["prompt_token_ids"] == server.post("/tokenize", {"prompt": LOOP_PROMPT}).json()["tokens"]


# ------------------------------------------------------------------------------------ the browser
@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or DRIVER is None:
        if os.environ.get("VERISPEC_REQUIRE_BROWSER") == "1":
            pytest.fail("VERISPEC_REQUIRE_BROWSER=1 but chromium or chromedriver is missing")
        pytest.skip("no headless browser: apt install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def open_page(browser, server, mode: str = "chat"):
    browser.get(server.url + "/playground")
    wait_for(browser, lambda: browser.execute_script("return document.body.dataset.state") == "ready")
    key = browser.find_element("id", "api-key")
    key.clear()
    key.send_keys(server.api_key)
    browser.find_element("css selector", f"input[name=mode][value={mode}]").click()


def fill(browser, element_id: str, value) -> None:
    el = browser.find_element("id", element_id)
    el.clear()
    el.send_keys(str(value))


def generate(browser, **controls) -> dict:
    """Sets the controls, clicks Generate, waits for the stream and the scoring pass; returns the
    request the page sent ({url, body})."""
    for name, value in controls.items():
        fill(browser, name, value)
    browser.find_element("id", "generate").click()
    wait_for(browser, lambda: browser.execute_script("return document.body.dataset.state") == "done")
    error = browser.find_element("id", "error").text
    assert not error, error
    return json.loads(browser.find_element("id", "last-request").get_attribute("textContent"))


def wait_for(browser, cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise TimeoutError(f"the page did not get there in {timeout} s")


def replay(server, sent: dict) -> dict:
    """The page's last request, sent again without streaming (seeded or greedy: the same answer)."""
    resp = server.post(sent["url"], {**sent["body"], "stream": False})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def tokens(browser) -> list[dict]:
    return browser.execute_script("""
        return [...document.querySelectorAll('#tokens .tok')].map((el) => ({
            text: el.textContent, logprob: el.dataset.logprob === undefined ? null : Number(el.dataset.logprob),
            id: Number(el.dataset.tokenId), source: el.dataset.source || null, colour: getComputedStyle(el).backgroundColor,
            classes: [...el.classList], underline: getComputedStyle(el).textDecorationStyle,
            line: getComputedStyle(el).textDecorationLine}));""")


def expected_colour(logprob: float) -> tuple[int, int, int]:
    """playground.js's tokenColour: hsl(round(120 p), 75%, 80%)."""
    hue = round(120 * min(1.0, max(0.0, math.exp(logprob))))
    r, g, b = colorsys.hls_to_rgb(hue / 360, 0.80, 0.75)
    return round(r * 255), round(g * 255), round(b * 255)


def rgb(css: str) -> tuple[int, int, int]:
    inner = css[css.index("(") + 1 : css.index(")")]
    return tuple(int(float(x)) for x in inner.split(",")[:3])


def test_every_token_is_coloured_and_underlined_by_its_logprob(browser, server, tmp_path):
    open_page(browser, server, "chat")
    # Processed at a low temperature, a random model's probabilities spread over every colour band.
    fill(browser, "top_k", 20)
    sent = generate(browser, prompt="Tell me about the sea.", temperature=0.1, seed=7, max_tokens=24, top_logprobs=5)
    choice = replay(server, sent)
    shown = tokens(browser)
    content = choice["logprobs"]["content"]
    assert [t["id"] for t in shown] == choice["token_ids"] and len(shown) == len(content) > 0
    for tok, entry in zip(shown, content):
        assert tok["text"] == entry["token"] and tok["logprob"] == entry["logprob"]
        got, want = rgb(tok["colour"]), expected_colour(entry["logprob"])
        assert all(abs(a - b) <= 1 for a, b in zip(got, want)), (tok, want)
        p = math.exp(entry["logprob"])
        assert tok["underline"] == ("solid" if p >= 0.5 else "dashed" if p >= 0.1 else "dotted") or (
            p >= 0.5 and tok["line"] == "none")
    save_artifact(browser, tmp_path, "playground-chat.png")


def save_artifact(browser, tmp_path, name: str) -> None:
    """A screenshot in the test's directory, and in $VERISPEC_ARTIFACTS when set (CI keeps it)."""
    browser.save_screenshot(str(tmp_path / name))
    if os.environ.get("VERISPEC_ARTIFACTS"):
        Path(os.environ["VERISPEC_ARTIFACTS"]).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(os.environ["VERISPEC_ARTIFACTS"]) / name))


def test_the_popover_lists_the_servers_top_logprobs_exactly(browser, server):
    open_page(browser, server, "completion")
    sent = generate(browser, prompt="Once upon a time", temperature=1.0, seed=3, max_tokens=12, top_logprobs=6)
    choice = replay(server, sent)
    for i in (0, 5, 11):
        browser.find_elements("css selector", "#tokens .tok")[i].click()
        rows = browser.execute_script("""
            return [...document.querySelectorAll('#popover tr.alt-row')].map((r) => [r.dataset.token, Number(r.dataset.logprob)]);""")
        top = sorted(choice["logprobs"]["top_logprobs"][i].items(), key=lambda kv: -kv[1])
        assert rows == [list(kv) for kv in top]
        summary = browser.find_element("css selector", "#popover .summary").text
        assert "raw logprob" in summary and "processed logprob" in summary and "rank" in summary


def test_accepted_drafts_are_marked_when_speculation_is_on(browser, server, tmp_path):
    open_page(browser, server, "completion")
    sent = generate(browser, prompt=LOOP_PROMPT, temperature=0, max_tokens=40)
    choice = replay(server, sent)
    shown = tokens(browser)
    kinds = [s["kind"] for s in choice["token_sources"]]
    assert [t["source"] for t in shown] == kinds and "accepted" in kinds
    assert [("src-accepted" in t["classes"]) for t in shown] == [k == "accepted" for k in kinds]
    stats = browser.find_element("id", "stats")
    assert int(stats.get_attribute("data-accepted")) == kinds.count("accepted")
    drafted = sum(s["drafts"] for s in {s["step"]: s for s in choice["token_sources"]}.values())
    assert int(stats.get_attribute("data-drafted")) == drafted
    assert "acceptance rate" in stats.text
    save_artifact(browser, tmp_path, "playground-speculation.png")
    browser.find_element("id", "speculative").click()  # off for this request
    sent = generate(browser)
    assert sent["body"]["speculative"] is False
    assert {t["source"] for t in tokens(browser)} == {"sampled"}


def test_clicking_an_alternative_continues_from_it(browser, server):
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server, "completion")
    first = generate(browser, prompt="The capital of France is", temperature=0, max_tokens=10, top_logprobs=4)
    before = tokens(browser)
    prompt_ids = first_prompt_ids(server, first)
    spans = browser.find_elements("css selector", "#tokens .tok")
    spans[3].send_keys(Keys.ENTER)  # the keyboard way in: Enter opens the popover, focus on its first button
    assert browser.switch_to.active_element.get_attribute("class") == "alt"
    rows = browser.find_elements("css selector", "#popover tr.alt-row")
    pick = next(r for r in rows if "sampled" not in r.get_attribute("class"))
    alt_text = pick.get_attribute("data-token")
    wait_for(browser, lambda: pick.find_element("css selector", "button").is_enabled())
    pick.find_element("css selector", "button").click()
    wait_for(browser, lambda: browser.execute_script("return document.body.dataset.state") == "done")
    sent = json.loads(browser.find_element("id", "last-request").get_attribute("textContent"))
    after = tokens(browser)
    assert [t["id"] for t in after[:3]] == [t["id"] for t in before[:3]]
    assert after[3]["text"] == alt_text and "src-user" in after[3]["classes"]
    assert sent["body"]["prompt"] == prompt_ids + [t["id"] for t in before[:3]] + [after[3]["id"]]
    assert after[3]["id"] != before[3]["id"]
    assert [t["id"] for t in after[4:]] == replay(server, sent)["token_ids"]


def first_prompt_ids(server, sent: dict) -> list[int]:
    return server.post("/tokenize", {"prompt": sent["body"]["prompt"]}).json()["tokens"]


def test_tokens_are_reached_and_left_by_keyboard(browser, server):
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server, "completion")
    generate(browser, prompt="One two three", temperature=0, max_tokens=6)
    spans = browser.find_elements("css selector", "#tokens .tok")
    spans[0].send_keys(Keys.ARROW_RIGHT)
    assert browser.switch_to.active_element.get_attribute("data-index") == "1"
    popover = browser.find_element("id", "popover")
    assert popover.is_displayed() and popover.get_attribute("data-index") == "1"  # focus shows it
    browser.switch_to.active_element.send_keys(Keys.ENTER)
    assert browser.switch_to.active_element.get_attribute("class") == "alt"
    browser.switch_to.active_element.send_keys(Keys.ESCAPE)
    assert not popover.is_displayed()
    assert browser.switch_to.active_element.get_attribute("data-index") == "1"


def test_model_text_that_spells_markup_is_shown_as_text_and_never_runs(browser, server):
    from selenium.common.exceptions import NoAlertPresentException

    open_page(browser, server, "completion")
    fill(browser, "extra", json.dumps({"structured_outputs": {
        "regex": r"<script>document\.title='pwned';alert\(1\)</script><img src=x onerror=alert\(2\)>"}}))
    browser.find_element("id", "show_prompt").click()
    generate(browser, prompt="<b>bold</b><script>alert(3)</script>", temperature=0, max_tokens=80)
    text = browser.execute_script("return document.getElementById('tokens').textContent")
    assert text.startswith("<script>document.title='pwned';alert(1)</script><img src=x onerror=alert(2)>")
    assert browser.execute_script(
        "return document.querySelectorAll('#tokens script, #tokens img, #prompt-tokens script, #prompt-tokens b').length") == 0
    assert "<b>bold</b><script>" in browser.execute_script("return document.getElementById('prompt-tokens').textContent")
    assert browser.title == "verispec logprob playground"
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text


def test_prompt_tokens_show_their_prompt_logprobs(browser, server):
    open_page(browser, server, "completion")
    browser.find_element("id", "show_prompt").click()
    sent = generate(browser, prompt="A short prompt to score", temperature=0, max_tokens=4)
    ids = first_prompt_ids(server, sent)
    scored = server.post("/v1/completions", {"prompt": ids, "max_tokens": 0, "prompt_logprobs": 1,
                                             "logprobs_mode": "processed_logprobs", "temperature": 0}).json()
    rows = scored["choices"][0]["prompt_logprobs"]
    shown = browser.execute_script("""
        return [...document.querySelectorAll('#prompt-tokens .tok')].map((el) =>
            el.dataset.logprob === undefined ? null : Number(el.dataset.logprob));""")
    assert len(shown) == len(ids) and shown[0] is None
    assert shown[1:] == [rows[i][str(t)]["logprob"] for i, t in enumerate(ids) if i > 0]


def test_chat_streams_the_same_token_ids_and_sources_as_the_whole_answer(server):
    body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 24, "temperature": 0,
            "return_token_ids": True, "return_token_sources": True}
    whole = server.post("/v1/chat/completions", body).json()
    events = [json.loads(line[6:]) for line in server.post("/v1/chat/completions", {**body, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"] and len(whole["prompt_token_ids"]) > 3
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert [t for c in choices for t in c.get("token_ids") or []] == whole["choices"][0]["token_ids"]
    streamed = [s for c in choices for s in c.get("token_sources") or []]
    # The same kinds; steps count the engine's steps, so the second answer's are later ones.
    def relative(sources):
        return [(s["kind"], s["drafts"], s["step"] - sources[0]["step"]) for s in sources]
    assert relative(streamed) == relative(whole["choices"][0]["token_sources"]) and len(streamed) == 24
    plain = server.post("/v1/chat/completions", {k: v for k, v in body.items() if not k.startswith("return_")}).json()
    assert plain["choices"][0].get("token_ids") is None and plain.get("prompt_token_ids") is None


def test_a_refused_request_shows_the_servers_message_and_the_first_choice_alone(browser, server):
    open_page(browser, server, "completion")
    fill(browser, "temperature", -1)
    browser.find_element("id", "generate").click()
    wait_for(browser, lambda: browser.execute_script("return document.body.dataset.state") == "done")
    assert "400" in browser.find_element("id", "error").text and "temperature" in browser.find_element("id", "error").text
    fill(browser, "extra", "[1, 2]")
    browser.find_element("id", "generate").click()
    assert "a JSON object is expected" in browser.find_element("id", "error").text
    fill(browser, "extra", json.dumps({"n": 3}))
    sent = generate(browser, temperature=1.0, seed=5, max_tokens=8)
    assert [t["id"] for t in tokens(browser)] == replay(server, sent)["token_ids"]
