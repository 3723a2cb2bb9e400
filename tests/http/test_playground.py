"""The playground page (``GET /``) in a real browser: headless Chromium, driven by Selenium
with the system chromedriver, against a real ``tandem serve`` subprocess.

What a person sees is what is checked: text streams in piece by piece (a MutationObserver
records every length the answer had), the live figures move while a request runs, marks
over the image sit where the returned normalised coordinates put them (read back from the
DOM: their data- attributes and their boxes on screen), a server with an API key refuses
the page until the key is entered, and the browser console stays free of errors.
Screenshots go to the test's temporary directory and must not be blank.

Without Chromium the tests skip, except in CI (``CI=true``), where they fail.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import time

import httpx
import pytest
from PIL import Image
from prerequisites import unavailable
from processes import CLI, ROOT, free_port, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
KEY = "playground-test-key"
# sim:20: a simulated device with 20 ms steps, so a stream takes long enough to watch it grow
VLM_SLOW = ["--model", "tiny-random-vlm", "--device", "sim:20"]
TEXT_SLOW = ["--model", "tiny-random", "--device", "sim:20"]


def _browser_or_skip():
    missing = [name for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not path]
    if importlib.util.find_spec("selenium") is None:  # the `test` extra
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        reason = f"no browser to test the page with: {', '.join(missing)} missing " \
                 "(apt-get install -y chromium chromium-driver)"
        unavailable(reason)


@contextlib.contextmanager
def tandem_serve(tmp_path, *args: str):
    """A ``tandem serve`` with HTTP on a free port; yields its base URL once /ready says so."""
    port = free_port()
    log = open(tmp_path / f"serve-{port}.log", "w+")
    proc = subprocess.Popen([*CLI, "serve", *args, "--bind", f"ipc://{tmp_path}/serve-{port}.sock",
                             "--http", f"127.0.0.1:{port}", "--drain-timeout", "1"],
                            cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        log.seek(0)
        return log.read()[-3000:]

    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"tandem serve exited:\n{tail()}"
            assert time.monotonic() < deadline, f"tandem serve not ready:\n{tail()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        stop_server(proc)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vision-language model (it chats too), without an API key."""
    with tandem_serve(tmp_path_factory.mktemp("serve"), *VLM_SLOW) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """A text-only model behind an API key."""
    with tandem_serve(tmp_path_factory.mktemp("serve-key"), *TEXT_SLOW, "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


# --------------------------------------------------------------------------- helpers


def open_page(driver, url: str) -> None:
    driver.get(url + "/")
    console_errors(driver)  # start each test with an empty log


def wait_for(driver, condition, timeout: float = 60, what: str = "condition"):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), what)


def console_errors(driver) -> list[str]:
    """The browser's console errors since the last call."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def send(driver, mode: str, text: str = "") -> None:
    from selenium.webdriver.common.by import By
    driver.find_element(By.CSS_SELECTOR, f"input[name=mode][value={mode}]").find_element(By.XPATH, "..").click()
    prompt = driver.find_element(By.ID, "prompt")
    if prompt.is_enabled():
        prompt.clear()
        prompt.send_keys(text)
    driver.find_element(By.ID, "send").click()


def wait_answer(driver, turns_before: int, timeout: float = 60) -> dict:
    """Wait for the next answer to finish; its text, whether it failed, and the JSON panel."""
    wait_for(driver, lambda d: js(d, "return document.querySelectorAll('#transcript .turn.assistant').length")
             > turns_before and js(d, "return document.body.dataset.busy") == "", timeout, "the answer to end")
    turn = js(driver, """const t = [...document.querySelectorAll('#transcript .turn.assistant')].pop();
                         return {text: t.querySelector('.text').textContent, error: t.classList.contains('error')};""")
    return {**turn, "json": json.loads(js(driver, "return document.getElementById('json').textContent"))}


def assistant_turns(driver) -> int:
    return js(driver, "return document.querySelectorAll('#transcript .turn.assistant').length")


def watch_answer_lengths(driver) -> None:
    """Record every length the newest answer's text takes (window.__lengths), and the server
    tokens/s figures shown while a request is in flight (window.__busyRates)."""
    js(driver, """
        window.__lengths = []; window.__busyRates = [];
        new MutationObserver(() => {
          const t = [...document.querySelectorAll('#transcript .turn.assistant .text')].pop();
          if (t) window.__lengths.push(t.textContent.length);
        }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
        new MutationObserver(() => {
          if (document.body.dataset.busy === '1')
            window.__busyRates.push(parseFloat(document.getElementById('fig-server-tps').dataset.value));
        }).observe(document.getElementById('fig-server-tps'), {attributes: true, childList: true});
    """)


def screenshot(driver, path) -> None:
    """Save a screenshot and check it is not blank: a page with text, marks and an image has
    many colours; a blank or single-colour page has a handful."""
    png = driver.get_screenshot_as_png()
    path.write_bytes(png)
    colours = Image.open(io.BytesIO(png)).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, f"{path} looks blank ({len(colours or [])} colours)"


def set_field(driver, element_id: str, value) -> None:
    js(driver, "document.getElementById(arguments[0]).value = arguments[1]", element_id, str(value))


# --------------------------------------------------------------------------- the page's files


def test_page_and_its_files_are_served_from_the_package_and_need_no_network(keyed_server):
    """Everything the page loads is Tandem's own (no CDN: it works offline) and public even
    with an API key (a browser opening a URL sends none); the API routes are not public."""
    html = httpx.get(keyed_server + "/")
    assert html.status_code == 200 and "text/html" in html.headers["content-type"]
    refs = re.findall(r'(?:src|href)="([^"]+)"', html.text)
    assert len(refs) >= 3  # favicon, stylesheet, script: the check below is not vacuous
    for ref in refs:
        assert ref.startswith("/static/"), f"the page loads {ref} from elsewhere"
        r = httpx.get(keyed_server + ref)
        assert r.status_code == 200 and r.content, ref
        text = r.text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, not a fetch
        assert not re.search(r"https?://|url\(\s*[\"']?//|@import", text), f"{ref} refers elsewhere"
    # public means the package's static files only: no way out of the folder, nor into an API route
    for path in ("/static/%2e%2e/app.py", "/static/%2e%2e/%2e%2e/v1/stats", "/static/../v1/stats"):
        assert httpx.get(keyed_server + path).status_code in (401, 404), path
    assert httpx.get(keyed_server + "/v1/stats").status_code == 401
    stats = httpx.get(keyed_server + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stats["model"] == "tiny-random" and stats["info"]["worker_ready"] is True
    for name in ("committed_tokens", "bubble_idle_s", "bubble_busy_s", "device_idle_fraction", "running"):
        assert name in stats["info"], name
    assert set(stats["requests"]) == {"prompt_tokens", "generation_tokens", "ttft_count", "ttft_sum_s"}


# --------------------------------------------------------------------------- text


def test_chat_streams_in_while_the_figures_move(browser, server, tmp_path):
    open_page(browser, server)
    wait_for(browser, lambda d: js(d, "return document.getElementById('model').textContent") == "tiny-random-vlm")
    watch_answer_lengths(browser)
    set_field(browser, "max-tokens", 120)
    set_field(browser, "temperature", 1.0)
    send(browser, "chat", "Tell me a story.")
    answer = wait_answer(browser, 0)

    assert not answer["error"], answer
    final = len(answer["text"])
    seen = js(browser, "return window.__lengths")
    partial = sorted({n for n in seen if 0 < n < final})
    assert final > 0 and len(partial) >= 3, f"the answer did not grow piece by piece: lengths {seen}"
    # the JSON beside it is the same answer, with the server's token count
    assert answer["json"]["message"]["content"] == answer["text"]
    assert answer["json"]["usage"]["completion_tokens"] >= len(partial)
    # the figures: this request's, and the server's while it ran
    assert float(js(browser, "return document.getElementById('fig-ttft').dataset.value")) > 0
    assert float(js(browser, "return document.getElementById('fig-tps').dataset.value")) > 0
    busy_rates = js(browser, "return window.__busyRates")
    assert any(r > 0 for r in busy_rates), f"server tokens/s did not move during the request: {busy_rates}"
    idle = js(browser, "return document.getElementById('fig-idle').dataset.value")
    assert idle != "" and 0 <= float(idle) <= 1

    # the conversation goes on: the second turn is sent with the first
    send(browser, "chat", "And then?")
    second = wait_answer(browser, 1)
    assert not second["error"] and second["json"]["usage"]["prompt_tokens"] > answer["json"]["usage"]["prompt_tokens"]
    screenshot(browser, tmp_path / "chat.png")
    assert console_errors(browser) == []


def test_an_api_key_server_refuses_the_page_until_the_key_is_entered(browser, keyed_server, tmp_path):
    from selenium.webdriver.common.by import By
    open_page(browser, keyed_server)
    wait_for(browser, lambda d: "API key" in d.find_element(By.ID, "status").text, what="the page to ask for a key")
    send(browser, "chat", "hello")
    refused = wait_answer(browser, 0)
    assert refused["error"] and "API key" in refused["text"]

    key = browser.find_element(By.ID, "api-key")
    key.send_keys("wrong")
    key.submit()
    wait_for(browser, lambda d: "refused this API key" in d.find_element(By.ID, "status").text,
             what="the wrong key to be refused")
    assert browser.find_element(By.ID, "model").text != "tiny-random"

    key.clear()
    key.send_keys(KEY)
    key.submit()
    wait_for(browser, lambda d: d.find_element(By.ID, "model").text == "tiny-random", what="the model name")
    send(browser, "chat", "hello")
    answer = wait_answer(browser, 1)
    assert not answer["error"] and answer["text"], answer
    # the key lasts for the tab's session: a reload keeps it
    browser.refresh()
    wait_for(browser, lambda d: d.find_element(By.ID, "model").text == "tiny-random", what="the model after reload")
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == KEY
    screenshot(browser, tmp_path / "api-key.png")
    # the refused requests are the only console errors: the 401s, nothing else
    errors = console_errors(browser)
    assert errors and all("401" in e for e in errors), errors


# --------------------------------------------------------------------------- marks over an image


def make_image(path, size=(640, 420)) -> None:
    """A picture with shapes and a gradient (not one colour: screenshots must show it)."""
    img = Image.new("RGB", size)
    px = img.load()
    for x in range(size[0]):
        for y in range(size[1]):
            px[x, y] = (x * 255 // size[0], y * 255 // size[1], 128)
    img.paste((250, 240, 30), (100, 80, 260, 220))
    img.paste((20, 30, 200), (380, 200, 560, 380))
    img.save(path)


def upload(driver, path) -> None:
    from selenium.webdriver.common.by import By
    driver.find_element(By.ID, "file").send_keys(str(path))
    wait_for(driver, lambda d: js(d, "const p = document.getElementById('photo');"
                                     "return !document.getElementById('stage').hidden && p.complete && p.naturalWidth > 0"),
             what="the image to show")


def drawn_marks(driver) -> dict:
    """The marks over the image as the browser lays them out, and the image's own box."""
    return js(driver, """
        const box = (el) => { const r = el.getBoundingClientRect();
                              return {left: r.left, top: r.top, width: r.width, height: r.height}; };
        const attrs = (el) => Object.fromEntries([...el.attributes].filter(a => a.name.startsWith('data-'))
                                                 .map(a => [a.name.slice(5), parseFloat(a.value)]));
        return {image: box(document.getElementById('photo')),
                points: [...document.querySelectorAll('#overlay .mark-point')].map(el => ({...attrs(el), box: box(el)})),
                boxes: [...document.querySelectorAll('#overlay .mark-box')].map(el => ({...attrs(el), box: box(el)}))};
    """)


def assert_points_drawn_at(marks: dict, points: list[dict]) -> None:
    img = marks["image"]
    assert len(marks["points"]) == len(points) and not marks["boxes"]
    for drawn, p in zip(marks["points"], points):
        assert (drawn["x"], drawn["y"]) == pytest.approx((p["x"], p["y"]), abs=1e-9)
        cx = drawn["box"]["left"] + drawn["box"]["width"] / 2
        cy = drawn["box"]["top"] + drawn["box"]["height"] / 2
        assert cx == pytest.approx(img["left"] + p["x"] * img["width"], abs=1.5)
        assert cy == pytest.approx(img["top"] + p["y"] * img["height"], abs=1.5)


def assert_boxes_drawn_at(marks: dict, objects: list[dict]) -> None:
    img = marks["image"]
    assert len(marks["boxes"]) == len(objects) and not marks["points"]
    for drawn, o in zip(marks["boxes"], objects):
        assert [drawn[k] for k in ("x-min", "y-min", "x-max", "y-max")] == \
            pytest.approx([o["x_min"], o["y_min"], o["x_max"], o["y_max"]], abs=1e-9)
        b = drawn["box"]
        assert b["left"] == pytest.approx(img["left"] + min(o["x_min"], o["x_max"]) * img["width"], abs=1.5)
        assert b["top"] == pytest.approx(img["top"] + min(o["y_min"], o["y_max"]) * img["height"], abs=1.5)
        assert b["width"] == pytest.approx(abs(o["x_max"] - o["x_min"]) * img["width"], abs=1.5)
        assert b["height"] == pytest.approx(abs(o["y_max"] - o["y_min"]) * img["height"], abs=1.5)


def test_marks_land_on_the_coordinates_they_are_given(browser, server, tmp_path):
    """The drawing itself, with chosen coordinates (corners, edges, a box given corners
    reversed): each mark's place on screen is its normalised coordinates times the image."""
    make_image(tmp_path / "shapes.png")
    open_page(browser, server)
    upload(browser, tmp_path / "shapes.png")
    points = [{"x": 0.0, "y": 0.0}, {"x": 0.25, "y": 0.75}, {"x": 1.0, "y": 1.0}, {"x": 0.5, "y": 0.125}]
    js(browser, "drawPoints(arguments[0])", points)
    assert_points_drawn_at(drawn_marks(browser), points)
    objects = [{"x_min": 0.15625, "y_min": 0.19, "x_max": 0.40625, "y_max": 0.52},
               {"x_min": 0.875, "y_min": 0.9, "x_max": 0.59, "y_max": 0.47},  # reversed corners
               {"x_min": 0.0, "y_min": 0.0, "x_max": 1.0, "y_max": 1.0}]
    js(browser, "drawBoxes(arguments[0])", objects)
    assert_boxes_drawn_at(drawn_marks(browser), objects)
    # the check is not vacuous: a box moved by a tenth of the image fails it
    moved = [{**objects[0], "x_min": objects[0]["x_min"] + 0.1}] + objects[1:]
    with pytest.raises(AssertionError):
        assert_boxes_drawn_at(drawn_marks(browser), moved)
    # a narrower window lays the image out smaller; the marks follow it
    browser.set_window_size(700, 900)
    try:
        assert_boxes_drawn_at(drawn_marks(browser), objects)
    finally:
        browser.set_window_size(1280, 900)
    screenshot(browser, tmp_path / "marks.png")
    assert console_errors(browser) == []


# --------------------------------------------------------------------------- a vision model, end to end


def ask_until_placed(driver, mode: str, obj: str, turns: int) -> tuple[list[dict], int]:
    """Ask until an answer places a mark inside the image, checking every answer's marks on
    the way. tiny-random-vlm's weights are random: most answers are `none` or a corner, so
    the page samples (temperature 2) until one is not, lest the check be vacuous."""
    key, check, coords = {"detect": ("objects", assert_boxes_drawn_at, ("x_min", "y_min", "x_max", "y_max")),
                          "point": ("points", assert_points_drawn_at, ("x", "y"))}[mode]
    for _ in range(40):
        send(driver, mode, obj)
        answer = wait_answer(driver, turns)
        turns += 1
        assert not answer["error"], answer
        found = answer["json"][key]
        check(drawn_marks(driver), found)
        if any(0 < item[c] < 1 for item in found for c in coords):
            return found, turns
    pytest.fail(f"40 {mode} answers placed nothing inside the image")


def test_ask_about_an_image_in_every_mode(browser, server, tmp_path):
    """Upload a generated image; detect and point draw what the server returned where it
    says; caption and query stream in about it. A screenshot of each mode."""
    make_image(tmp_path / "shapes.png")
    open_page(browser, server)
    wait_for(browser, lambda d: js(d, "return document.getElementById('model').textContent") == "tiny-random-vlm")
    upload(browser, tmp_path / "shapes.png")
    set_field(browser, "temperature", 2.0)
    set_field(browser, "max-objects", 4)

    objects, turns = ask_until_placed(browser, "detect", "yellow square", 0)
    assert drawn_marks(browser)["boxes"]
    screenshot(browser, tmp_path / "detect.png")
    points, turns = ask_until_placed(browser, "point", "blue square", turns)
    assert drawn_marks(browser)["points"]
    screenshot(browser, tmp_path / "point.png")

    set_field(browser, "max-tokens", 40)
    for mode, text, key in [("caption", "", "caption"), ("query", "What is yellow?", "answer")]:
        watch_answer_lengths(browser)
        send(browser, mode, text)
        answer = wait_answer(browser, turns)
        turns += 1
        assert not answer["error"] and answer["text"], answer
        assert answer["json"][key] == answer["text"]
        seen = js(browser, "return window.__lengths")
        assert len({n for n in seen if 0 < n < len(answer["text"])}) >= 2, f"{mode} did not stream: {seen}"
        assert drawn_marks(browser)["points"] == [], "a new question clears the old marks"
        screenshot(browser, tmp_path / f"{mode}.png")
    assert console_errors(browser) == []


def test_a_text_model_turns_the_image_modes_off(browser, keyed_server, tmp_path):
    """Modes that need an image are off; a question asked with an image on the page goes
    to the model without it (not a 400)."""
    from selenium.webdriver.common.by import By
    open_page(browser, keyed_server)
    key = browser.find_element(By.ID, "api-key")
    key.clear()
    key.send_keys(KEY)
    key.submit()
    wait_for(browser, lambda d: js(d, "return document.querySelector('input[value=detect]').disabled"),
             what="detect to be turned off")
    modes = js(browser, "return [...document.querySelectorAll('input[name=mode]')].map(r => [r.value, r.disabled])")
    assert dict(modes) == {"chat": False, "query": False, "caption": True, "point": True, "detect": True}
    console_errors(browser)  # the 401s of a page opened without the key (the key test checks those)
    make_image(tmp_path / "shapes.png")
    upload(browser, tmp_path / "shapes.png")
    assert "takes no images" in browser.find_element(By.ID, "status").text
    turns = assistant_turns(browser)
    send(browser, "query", "What is this?")
    answer = wait_answer(browser, turns)
    assert not answer["error"] and answer["text"], answer
    asked = js(browser, "return [...document.querySelectorAll('#transcript .turn.user .who')].pop().textContent")
    assert asked == "you · query"  # not "· image"
    assert console_errors(browser) == []


def test_a_missing_browser_skips_here_and_fails_in_ci(monkeypatch):
    import test_playground
    monkeypatch.setattr(test_playground, "CHROMIUM", None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium"):
        _browser_or_skip()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="chromium"):
        _browser_or_skip()
