"""Images over HTTP on a vision-language model (tiny-random-vlm, random weights): the
unmodified ``moondream`` client's four skills and the ``openai`` client's ``image_url``
parts reach the model as protocol ``images``; point and detect come back well-formed
(the grammars), bad data URLs are a 400 for that request only."""
from __future__ import annotations

import base64
import io

import httpx
import moondream
import openai
import pytest
from live_server import LiveServer
from PIL import Image

from frontend.http import HttpListener

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live():
    srv = LiveServer(model="tiny-random-vlm")
    http = HttpListener(srv.server, "127.0.0.1", 0).start()
    srv.http = http
    yield srv
    http.stop()
    srv.close()


def picture(seed: int) -> Image.Image:
    img = Image.new("RGB", (96, 64), (20 * seed % 256, 90, 160))
    img.paste((250, 250, 20), (10 + seed, 10, 40 + seed, 40))
    return img


def data_url(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_moondream_skills_on_an_image(live):
    md = moondream.vl(endpoint=live.http.url + "/v1")
    img = picture(1)
    before = live.on_server_thread(lambda: live.svc.stats()["encoder_cache_misses"])
    caption = md.caption(img, settings={"max_tokens": 6})["caption"]
    assert isinstance(caption, str)
    streamed = "".join(md.caption(img, stream=True, settings={"max_tokens": 6, "temperature": 0})["caption"])
    assert streamed == md.caption(img, settings={"max_tokens": 6, "temperature": 0})["caption"]
    assert isinstance(md.query(img, "What is it?", settings={"max_tokens": 6})["answer"], str)
    points = md.point(img, "the square", settings={"max_objects": 3})["points"]
    assert len(points) <= 3 and all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)
    objects = md.detect(img, "the square", settings={"max_objects": 2})["objects"]
    assert len(objects) <= 2
    assert all(0 <= o["x_min"] <= o["x_max"] <= 1 and 0 <= o["y_min"] <= o["y_max"] <= 1 for o in objects)
    # One picture, many requests: encoded once (the encoder cache), whichever route asked.
    after = live.on_server_thread(lambda: live.svc.stats()["encoder_cache_misses"])
    assert after - before == 1


def test_openai_image_url_parts(live):
    oai = openai.OpenAI(base_url=live.http.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    content = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": data_url(picture(2))}},
               {"type": "text", "text": "with"}, {"type": "image_url", "image_url": {"url": data_url(picture(3))}}]
    r = oai.chat.completions.create(model="tiny-random-vlm", messages=[{"role": "user", "content": content}],
                                    max_tokens=4, temperature=0)
    text_only = oai.chat.completions.create(model="tiny-random-vlm", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "Compare with"}])
    # Each image adds its tile tokens to the prompt (non-vacuity: the images were really used).
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens + 2 * 16


def test_bad_image_urls_are_a_400_for_that_request_only(live):
    with httpx.Client(base_url=live.http.url, timeout=60) as c:
        for url, why in [("https://example.com/cat.png", "data: URL"), ("data:image/png,raw", "base64"),
                         ("data:image/png;base64,@@@", "invalid base64"),
                         ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "image")]:
            r = c.post("/v1/caption", json={"image_url": url})
            assert r.status_code == 400 and why in r.json()["error"]["message"], (url, r.text)
        ok = c.post("/v1/query", json={"image_url": data_url(picture(4)), "question": "?",
                                       "settings": {"max_tokens": 2}})
        assert ok.status_code == 200 and "answer" in ok.json()
