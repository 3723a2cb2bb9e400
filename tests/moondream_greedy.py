"""A plain greedy loop over :class:`gpu_worker.moondream.Moondream`, batch of one (test helper).

The decoding rules of MOONDREAM.md §4 (and MOONDREAM3.md §4 for a Moondream 3) written as directly
as possible, one forward per token, so the model can be checked against the reference's figures
before any engine is involved. Also the check of a quantized Moondream (2 or 3) against the float
model given its dequantized weights.
"""
from __future__ import annotations

import torch

from frontend.moondream import prompts
from gpu_worker.batch import Batch
from gpu_worker.kv_cache import PagedKVCache
from shared.moondream_config import ANSWER_ID, COORD_ID, EOS_ID, SIZE_ID

PAGE = 16


class Session:
    """One sequence on its own paged cache: feed embeddings chunk by chunk, read the last row."""

    def __init__(self, model, max_len: int = 1024):
        t = model.spec.text
        self.model = model
        pages = -(-max_len // PAGE)
        self.kv = PagedKVCache(t.n_layers, pages + 1, PAGE, t.n_kv_heads, t.dim // t.n_heads,
                               model.text.wte.dtype)
        self.table = list(range(1, pages + 1))
        self.pos = 0

    @torch.no_grad()
    def feed(self, ids: list[int], coord=None, size=None, prefix=None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (with per-token coord [T] / size [T, 2] values, or the image prefix embeddings
        in place of the first rows) -> (logits [vocab], pre-post_ln hidden [dim]) of the last token."""
        n = len(ids)
        batch = Batch.build([(self.pos, n, self.table)], PAGE)
        image = None
        if prefix is not None:
            image = (torch.arange(len(prefix)), prefix)
        logits, hidden = self.model(torch.tensor(ids), batch, self.kv, torch.tensor([n - 1]), image, coord, size)
        self.pos += n
        return logits[0].clone(), hidden[0].clone()

    def feed_coord(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.feed([COORD_ID], coord=x.view(1))

    def feed_size(self, wh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.feed([SIZE_ID], size=wh.view(1, 2))


def start(model, prefix: torch.Tensor | None = None) -> Session:
    """A session with the image block (``model.image_prefix``) prefilled, or an empty one."""
    s = Session(model)
    if prefix is not None:
        s.feed([EOS_ID] * len(prefix), prefix=prefix)
    return s


def prompt_values(ids: list[int], refs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not refs:
        return None, None
    coords, sizes = prompts.spatial_ref_values(refs)
    coord = torch.zeros(len(ids))
    size = torch.zeros(len(ids), 2)
    ids_t = torch.tensor(ids)
    coord[ids_t == COORD_ID] = torch.tensor(coords, dtype=torch.float32)
    if sizes:
        size[ids_t == SIZE_ID] = torch.tensor(sizes, dtype=torch.float32)
    return coord, size


def generate_text(s: Session, ids: list[int], max_tokens: int, refs=()) -> list[int]:
    """Caption / query answer: the first token unsuppressed, then the answer token banned; stop at eos."""
    logits, _ = s.feed(ids, *prompt_values(ids, refs))
    out = []
    tok = int(logits.argmax())
    while tok != EOS_ID and len(out) < max_tokens:
        out.append(tok)
        logits, _ = s.feed([tok])
        logits[ANSWER_ID] = float("-inf")
        tok = int(logits.argmax())
    return out


def generate_reasoning(s: Session, ids: list[int], max_tokens: int, refs=()) -> list[int]:
    """Reasoning: stop at the answer token (not fed); eos and size banned; a coord token feeds its value."""
    logits, hidden = s.feed(ids, *prompt_values(ids, refs))
    out = []
    tok = int(logits.argmax())
    while tok != ANSWER_ID and len(out) < max_tokens:
        out.append(tok)
        if tok == COORD_ID:
            logits, hidden = s.feed_coord(s.model.region.coord(hidden[None]))
        else:
            logits, hidden = s.feed([tok])
        logits[EOS_ID] = logits[SIZE_ID] = float("-inf")
        tok = int(logits.argmax())
    return out


def generate_objects(s: Session, ids: list[int], max_objects: int, size: bool) -> list[dict]:
    """Point / detect: while the full-vocabulary argmax is not eos, x, y (and size) are forced steps;
    Moondream 3 decides after the first object between coord and eos alone."""
    logits, hidden = s.feed(ids)
    region = s.model.region
    out = []

    def more() -> bool:
        if out and s.model.rules.two_way_stop:
            return bool(s.model.coord_over_eos(hidden[None])[0])
        return int(logits.argmax()) != EOS_ID

    while len(out) < max_objects and more():
        x = region.coord(hidden[None])
        _, hidden = s.feed_coord(x)
        y = region.coord(hidden[None])
        logits, hidden = s.feed_coord(y)
        if size:
            wh = region.size(hidden[None])[0]
            logits, hidden = s.feed_size(wh)
            w, h = float(wh[0]), float(wh[1])
            out.append({"x_min": float(x) - w / 2, "y_min": float(y) - h / 2,
                        "x_max": float(x) + w / 2, "y_max": float(y) + h / 2})
        else:
            out.append({"x": float(x), "y": float(y)})
    return out


def quant_kernels():
    """The weight-only kernels (``gpu_worker.quant.QuantKernels``), or the test skipped where the CPU
    kernels did not build."""
    import pytest

    from gpu_worker import cpu_kernels
    from gpu_worker.quant import QuantKernels

    built = cpu_kernels.load()
    if built is None:
        pytest.skip("the CPU kernels did not build here")
    return QuantKernels(built)


def check_quantized_against_dequantized(path, method: str, image, ids: list[int]) -> None:
    """--quantization int8|int4: the experts (quantized as they are read), the blocks' and the vision
    encoder's linears run through the weight-only kernels; the float model given the dequantized
    weights computes the same hidden states up to float32 summation order (1e-5 relative) and the same
    coordinate bin, while the float32 checkpoint's differ (non-vacuity: something was quantized)."""
    from gpu_worker.moondream import Experts, Moondream
    from gpu_worker.quant import QuantLinear

    kernels = quant_kernels()
    quantized = Moondream.from_pretrained(path, quantize=(method, 32, kernels))
    quantized.quantize_weights(method, 32, kernels)
    original, dequantized = Moondream.from_pretrained(path), Moondream.from_pretrained(path)
    held = {name: m for name, m in quantized.named_modules()  # an expert's linear: in its Experts' stack
            if (isinstance(m, QuantLinear) and ".quantized." not in name)
            or (isinstance(m, Experts) and m.quantized is not None)}
    assert any(name.startswith("vision.") for name in held) and any(name.startswith("text.") for name in held)
    with torch.no_grad():
        for name, m in held.items():
            w = m.dequantize() if isinstance(m, QuantLinear) else torch.stack([e.dequantize() for e in m.quantized])
            dequantized.get_submodule(name).weight.copy_(w)
        hidden = {}
        for key, model in (("q", quantized), ("d", dequantized), ("f", original)):
            s = start(model, model.image_prefix(torch.from_numpy(image[0]), image[1]))
            hidden[key] = s.feed(ids)[1]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(hidden["q"], hidden["d"]) < 1e-5
    assert quantized.region.coord(hidden["q"][None]) == dequantized.region.coord(hidden["d"][None])
    assert rel(hidden["q"], hidden["f"]) > 1e-3
