"""HTTP for ``tandem serve``: OpenAI- and Moondream-compatible routes, ``/health``, ``/metrics``.

One more client of the server's request path (``bridge.py``): every HTTP
request is a protocol ``generate`` over the server's in-process endpoint, so
there is one request table and one validation. Modules: ``app.py`` (routes,
API key), ``openai.py``, ``moondream.py``, ``playground.py`` (the page at
``/``, in ``static/``, and ``/v1/stats``), ``common.py`` (body, model, images,
disconnects, SSE), ``errors.py`` (statuses), ``listener.py`` (uvicorn on its
own thread), ``tokens.py`` (``/tokenize``, ``/detokenize``), ``openapi.py`` (``/openapi.json`` and
each body's msgspec Struct, which ``common.read_body`` decodes). Contract: docs/HTTP.md.
"""
from .listener import HttpListener

__all__ = ["HttpListener"]
