"""The chat page at `/` of `ninfer serve`: its files as served, and a real headless Chromium (Debian's
`chromium` + `chromium-driver`, driven by Selenium) that types a message, watches the reply stream in with its
tokens/s, and stops a long reply halfway. The browser test is skipped, saying why, where either is missing."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ninfer
import pytest
from server_helpers import ServerProcess, wait_healthy, wait_idle

from ninfer.server.webui import FILES, STATIC

CTX, PARALLEL = 4096, 2
SYSTEM = "You are a helpful assistant."


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("chat-page") / "server.log"
    s = ServerProcess(["-m", str(smollm2_path), "-c", str(CTX), "-np", str(PARALLEL), "-t", "2", "--metrics",
                       "--api-key", "sesame"], log)
    try:
        wait_healthy(s.base, s.proc)
        yield s
    finally:
        s.stop()


def test_page_files_are_served_without_the_key(server: ServerProcess) -> None:
    for path, (name, media_type) in FILES.items():
        r = httpx.get(server.base + path)
        assert r.status_code == 200, path
        assert r.headers["content-type"] == media_type
        assert r.content == (STATIC / name).read_bytes()
        assert "script-src 'self'" in r.headers["content-security-policy"]
    # The API itself still wants the key.
    assert httpx.get(f"{server.base}/v1/models").status_code == 401
    # Nothing is fetched from another origin (no CDN): every URL in the files is relative.
    for name, _ in FILES.values():
        assert not re.search(r"https?://|//[a-z]", (STATIC / name).read_text()), name


def test_no_webui_flag(smollm2_path: Path, tmp_path: Path) -> None:
    s = ServerProcess(["-m", str(smollm2_path), "-c", "512", "-t", "1", "--no-webui"], tmp_path / "server.log")
    try:
        wait_healthy(s.base, s.proc)
        assert httpx.get(s.base + "/").status_code == 404
        assert httpx.get(s.base + "/static/chat.js").status_code == 404
    finally:
        s.stop()


def _browser():  # -> selenium.webdriver.Chrome
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no headless browser: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def _wait(condition, timeout: float, what: str):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_chat_in_a_browser(server: ServerProcess, smollm2_path: Path) -> None:
    from_llm = ninfer.LLM(smollm2_path, n_ctx=CTX // PARALLEL, threads=2)
    question = "What is the capital of France?"
    expected = from_llm.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                             max_tokens=16, temperature=0).text
    driver = _browser()
    try:
        driver.get(server.base + "/")
        find = driver.find_element

        def set_value(element_id: str, value: str) -> None:
            el = find("id", element_id)
            el.clear()
            el.send_keys(value)

        set_value("api_key", "sesame")
        set_value("system", SYSTEM)
        set_value("temperature", "0")
        set_value("max_tokens", "16")
        _wait(lambda: find("id", "model").text, 30, "the model's name")
        assert find("id", "model").text == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert not find("id", "stop").is_enabled()

        # A short greedy reply: the text LLM.chat gives for the same conversation, then the speed line.
        set_value("prompt", question + "\n")  # (Enter sends)
        replies = lambda: driver.find_elements("css selector", ".message.assistant")  # noqa: E731
        _wait(lambda: "tokens/s" in find("id", "speed").text, 60, "the speed of the first reply")
        assert [m.text for m in driver.find_elements("css selector", ".message.user")] == [question]
        assert replies()[0].text == expected.strip()
        speed = find("id", "speed")
        assert float(speed.get_attribute("data-tokens-per-second")) > 0
        assert re.fullmatch(r"\d+\.\d tokens/s \(\d+ tokens, first token after \d+ ms\)", speed.text), speed.text

        # A long reply: watch it grow chunk by chunk, press stop halfway, and it grows no more.
        set_value("max_tokens", "1500")
        set_value("prompt", "Write a very long story about a dragon who learns to read.\n")
        _wait(lambda: len(replies()) == 2 and find("id", "stop").is_enabled(), 30, "the second reply to start")
        lengths: list[int] = []
        deadline = time.monotonic() + 60
        while len(set(lengths)) < 5 and time.monotonic() < deadline:
            lengths.append(len(replies()[1].text))
            time.sleep(0.05)
        assert len({n for n in lengths if n > 0}) >= 4, f"the reply did not stream: lengths {lengths}"
        assert lengths == sorted(lengths)
        find("id", "stop").click()
        _wait(lambda: not find("id", "stop").is_enabled(), 10, "the stop button to take effect")
        stopped_at = replies()[1].text
        assert "stopped" in replies()[1].get_attribute("class")
        assert "stopped" in find("id", "speed").text
        time.sleep(1.5)
        assert replies()[1].text == stopped_at, "the reply kept growing after stop"
        # The server dropped the request too (a closed stream cancels it), well before 1500 tokens.
        idle = wait_idle(server.base, timeout=10)
        assert idle["ninfer:requests_processing"] == 0
        n_words = len(stopped_at.split())
        assert 0 < n_words < 1000, n_words
        assert find("id", "send").is_enabled()
    finally:
        driver.quit()


def test_a_chats_next_turn_reuses_the_slots_cache(server: ServerProcess) -> None:
    """The page sends the whole conversation each turn; the slot that answered the last turn still holds it, so
    only the new turn is evaluated (timings.prompt_n), not the history."""
    auth = {"Authorization": "Bearer sesame"}
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name three colours of the rainbow, please."}]
    body = {"max_tokens": 12, "temperature": 0}
    first = httpx.post(f"{server.base}/v1/chat/completions", headers=auth, json={**body, "messages": messages},
                       timeout=60).json()
    messages += [first["choices"][0]["message"], {"role": "user", "content": "And two more?"}]
    second = httpx.post(f"{server.base}/v1/chat/completions", headers=auth, json={**body, "messages": messages},
                        timeout=60).json()
    n_prompt = second["usage"]["prompt_tokens"]
    evaluated = second["timings"]["prompt_n"]
    # Everything up to the end of the first prompt at least is reused; what is evaluated is the reply's closing
    # tokens as the template renders them and the new turn (about 15 tokens).
    assert n_prompt > first["usage"]["prompt_tokens"] + 10
    assert 0 < evaluated <= n_prompt - first["usage"]["prompt_tokens"], (evaluated, n_prompt)
