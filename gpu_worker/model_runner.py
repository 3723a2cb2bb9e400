"""Everything the engine enqueues on the device: forward, sampling, copies.

Per batch row the device keeps the *pending token* (the last sampled id, which
the next forward gathers without the host ever seeing it) and the row's
sampling parameters. Per step buffer (``pipeline.py``) it keeps the
page-locked host buffers the sampled ids are copied into, and on CUDA the
decode graphs captured for that step buffer (one per batch-size bucket and page-count
bucket). A Moondream row also keeps its skill state and pending region values
on the device (``moondream_skills.SkillRows``): sampling advances them, the
next forward embeds them, and the values are copied back with the ids.

Image prefill: a launch may first encode image tiles (``LaunchInputs.encode``,
built by ``image_prefill.py``): the tiles go host -> device and through the
vision family's ``encode_runs`` on the compute stream, and their features land
in their images' rows of the encoder-cache holders; then the text forward
replaces the embeddings of the launch's ``<image>`` tokens (``image_index``) by
rows of those holders (``image_segments``).

Nothing here decides *what* to run; ``engine.py`` does. Functions named
``enqueue_*`` return immediately: the work runs on the compute stream (an
executor thread on the CPU), in submission order.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from shared.arith import ceil_div
from shared.config import ATTENTIONS, QUANTIZATIONS, EngineConfig
from shared.families import family_of, read_config
from shared.models.gguf_files import GGUF_FILE
from shared.models.info import ModelInfo
from shared.models.registry import builtin, resolve_model
from shared.sampling import MAX_TOP_LOGPROBS
from shared.vision_config import ImageProcessorParams

from .device import Device
from .batch import Batch
from .kv_cache import PagedKVCache
from .lora import LoraPool
from . import cpu_kernels, families, flex_paged, quant
from .cpu_backend import pack_linears
from .gguf_weights import holds_only_bf16, quantize_linears
from .model import Llama
from .moondream import Moondream
from .moondream_skills import VALUES, SkillRows, SkillTask
from .pipeline import NUM_STEP_BUFFERS
from .sampler import MAX_EOS_IDS, RowParams, apply_bitmask, greedy_on_host, sample
from .vision import VisionEncoder

log = logging.getLogger("tandem.worker")

POISON = -(2**31)  # debug mode: a gather of a never-written pending token fails loudly
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass
class LaunchInputs:
    """Host-built description of one forward (numpy, built by the engine)."""

    decode_rows: np.ndarray  # [D] batch rows whose input is their pending token
    decode_pos: np.ndarray  # [D] position of each decode row's input token
    prefill_ids: np.ndarray  # [Tp] prompt tokens of this launch's prefill chunks
    prefill_chunks: list  # [(start_pos, num_tokens, pages)] after the decode rows
    logits_index: np.ndarray  # [R] token index of each sampling row
    sample_rows: np.ndarray  # [R] batch row of each sampling row
    sample_pos: np.ndarray  # [R] position of the token each row samples (RNG counter)
    any_random: bool
    any_filter: bool
    want_logprobs: bool
    want_top: bool = False  # some row wants the most likely tokens' logprobs (top_logprobs)
    any_bias: bool = False  # some row has a logit_bias
    any_penalty: bool = False  # some row has a penalty: its sampled tokens are counted
    any_min_tokens: bool = False  # some row has not reached its min_tokens: its stop ids are masked
    seen_width: int | None = None  # with penalties: the most tokens a row has seen (its position: a bound)
    # Encode units of this launch, before its text forward (image_prefill.py): (host tile blocks,
    # FeatureHolder, first feature row of the run in its image, the image's feature rows, its
    # ImageInput.tiling) per run.
    encode: list = ()
    # The launch's <image> tokens: packed token index [K], and where their features are,
    # in the same order: (FeatureHolder, first row, end row) runs.
    image_index: np.ndarray | None = None
    image_segments: list = ()
    token_lora: np.ndarray | None = None  # [T] LoRA slot of each token row; None: no adapter in the launch
    # Moondream: the values of the prefill tokens (spatial refs), float32 [Tp] and [Tp, 2]; None: all zero.
    prefill_coord: np.ndarray | None = None
    prefill_size: np.ndarray | None = None


class StepBuffers:
    """Per step buffer: the page-locked destinations of the device-to-host copy."""

    def __init__(self, device: Device, max_rows: int) -> None:
        self.tokens = device.pinned_empty((max_rows,), torch.int64)
        self.flags = device.pinned_empty((max_rows,), torch.int32)
        self.logprobs = device.pinned_empty((max_rows,), torch.float32)
        self.values = device.pinned_empty((max_rows, VALUES), torch.float32)  # Moondream's region values
        self.top_ids = device.pinned_empty((max_rows, MAX_TOP_LOGPROBS), torch.int32)
        self.top_logprobs = device.pinned_empty((max_rows, MAX_TOP_LOGPROBS), torch.float32)
        self.logits: torch.Tensor | None = None  # the forward's output, read by sampling
        self.hidden: torch.Tensor | None = None  # Moondream: the sampled rows' pre-post_ln hidden states
        self.out: tuple | None = None  # the step's sampled ids, flags, logprobs, values, top, filled part by part
        self.keep: list = []  # device tensors that must live until the step's copy is done


# The CPU kernels' levels whose bf16 linears were measured faster than float32's eager forward:
# x86's from AVX2 up (BENCHMARKS.md "bf16 by default wherever the CPU kernels build").
BF16_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")


def default_dtype(is_cuda: bool, kernels: bool = True) -> torch.dtype:
    """bf16 on CUDA, and on a CPU where bf16 linears run fast: where the CPU kernels build at a level of
    ``BF16_LEVELS`` (``kernels``: they may run; a one-row step 2.8-3.5x faster than float32's, 32 rows
    3.7-4.7x, a prompt 2.0-3.0x, AVX2 included) or where the CPU has native bf16 math (AVX512-BF16,
    AMX: oneDNN's); else float32."""
    if is_cuda:
        return torch.bfloat16
    if {"avx512_bf16", "amx_bf16"} & cpu_kernels.cpu_features():
        why, dtype = "the CPU has native bf16", torch.bfloat16
    elif not kernels:
        why, dtype = "the CPU kernels are off and the CPU has no native bf16", torch.float32
    elif (level := cpu_kernels.choose_level()[0].name) not in BF16_LEVELS:
        why, dtype = f"the CPU kernels' level {level} is not one of {', '.join(BF16_LEVELS)}", torch.float32
    elif not cpu_kernels.builds():
        why, dtype = "the CPU kernels do not build here and the CPU has no native bf16", torch.float32
    else:
        why, dtype = f"the CPU kernels' bf16 linears at level {level}", torch.bfloat16
    log.info("dtype %s by default: %s", str(dtype).removeprefix("torch."), why)
    return dtype


def kv_cache_dtype(activations: torch.dtype, quantized: bool, fused: bool) -> torch.dtype:
    """The KV cache's type: the activations', except bf16 under a quantized model's float32
    activations where the fused CPU kernels run its layers (``fused``): attention then reads half
    the bytes (at 32 streams it read more than the weights did: BENCHMARKS.md "The KV cache in bf16
    under quantized weights"), as llama.cpp keeps its cache in f16 under any weights."""
    return torch.bfloat16 if quantized and fused and activations == torch.float32 else activations


def _quantization(config: EngineConfig, dev: torch.device, path) -> str | None:
    """How the weights are held: ``gguf`` (a directory's GGUF file as it is), ``int8`` / ``int4``
    (quantized at load) or None (the checkpoint's floats); an impossible request raises."""
    method = config.quantization
    if method not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {method!r} (one of {', '.join(QUANTIZATIONS)})")
    if method in ("int8", "int4"):
        if dev.type != "cpu":
            raise ValueError(f"--quantization {method} runs on a CPU only (the device is {dev.type})")
        if config.loras:
            raise ValueError(f"--quantization {method} cannot be combined with LoRA adapters")
        return method
    gguf = path is not None and (path / GGUF_FILE).exists()
    if method == "auto" and gguf and dev.type == "cpu" and not config.loras and not _bf16_on_amx(config, path):
        return "gguf"
    return None


def _bf16_on_amx(config: EngineConfig, path) -> bool:
    """Whether a GGUF file of BF16 matrices is better served as bf16 floats: where the CPU kernels run at
    level amx with bf16 activations, their AMX matmul multiplies the same weights faster than the
    weight-only kernel, at one row and at 32 (BENCHMARKS.md "On the AMX Xeon again")."""
    if not config.cpu_kernels or config.dtype not in (None, "bfloat16") or cpu_kernels.choose_level()[0].name != "amx":
        return False
    if not holds_only_bf16(path):
        return False
    log.info("%s holds bf16 matrices only: served as bf16 on the AMX matmul (faster here than the weight-only "
             "kernel)", GGUF_FILE)
    return True


def model_eos_ids(config: EngineConfig) -> tuple[int, ...]:
    """The EOS ids of ``config.model``, read where the frontend reads them (``ModelInfo``); a model the
    benchmarks draw in memory has only its built-in config."""
    model = builtin(config.model)
    if model is not None and model.build is None:
        return family_of(model.random_config).eos_token_ids(model.random_config)
    return ModelInfo.load(config.model, config.generation_config).eos_token_ids


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


def context_length(requested: int | None, model_limit: int, kv_tokens: int | None) -> tuple[int, str]:
    """The context a sequence may fill (prompt + generated tokens) and why it is that long.

    ``requested`` (``--max-model-len``) is capped at the model's limit (its max_position_embeddings);
    None takes that limit, bounded by what the KV cache holds (``kv_tokens``: one sequence must fit).
    A length asked for beyond the cache stands (several short sequences still share the cache); a
    request that needs more pages than the cache has is refused then, and the reason says so."""
    if requested is None:
        if kv_tokens is not None and kv_tokens < model_limit:
            return kv_tokens, (f"what the KV cache holds, below the model's limit of {model_limit} "
                               "(--kv-pages, --kv-memory-fraction)")
        return model_limit, f"the model's limit, max_position_embeddings {model_limit}"
    if requested > model_limit:
        return model_limit, f"the model's limit; --max-model-len {requested} asked for more"
    if kv_tokens is not None and kv_tokens < requested:
        return requested, f"--max-model-len; the KV cache holds only {kv_tokens} tokens"
    return requested, "--max-model-len"


@dataclass
class LoadedModel:
    """A model as the engine serves it: ``quantized`` as :func:`_quantization` says (or ``"built"``: a
    model handed over with its linears already quantized), ``kernels`` the CPU kernels it runs on."""
    model: torch.nn.Module
    vision: VisionEncoder | None
    image_params: ImageProcessorParams | None
    dtype: torch.dtype
    quantized: str | None
    kernels: cpu_kernels.CpuKernels | None


def load_model(config: EngineConfig, device: Device, llama: torch.nn.Module | None = None,
               vision: VisionEncoder | None = None, image_params: ImageProcessorParams | None = None) -> LoadedModel:
    """``config.model`` loaded as the engine serves it (its format, dtype and kernels), with its vision
    encoder if it takes images; or ``llama`` (and ``vision``, ``image_params``), an already-built model
    (tests, benchmarks), given the same dtype and kernels."""
    dev = device.torch_device
    path = resolve_model(config.model) if llama is None else None
    if path is not None:
        family_of(read_config(path))  # an unsupported architecture or quantization: refused before any work
    built = quant.kernels_of(llama) if llama is not None else None  # a model handed over already quantized
    quantized = _quantization(config, dev, path) or ("built" if built is not None else None)
    # Quantized weights are expanded to float32 in registers and summed in float32: float32
    # activations cost nothing in weight traffic and keep the GGUF reference's numerics.
    dtype = getattr(torch, config.dtype) if config.dtype else \
        torch.float32 if quantized else default_dtype(device.is_cuda, config.cpu_kernels)
    kernels = None
    if built is not None:  # the kernels its linears multiply with (the layers then run in one call)
        kernels = built.source if config.cpu_kernels else None
    elif config.cpu_kernels and dev.type == "cpu" and (dtype == torch.bfloat16 or quantized):
        kernels = cpu_kernels.load()  # None (logged) without a C compiler: the eager forward
    if quantized and kernels is None and built is None:
        raise RuntimeError("quantized weights need the CPU kernels, which did not build here (see the log); "
                           "--quantization none serves the dequantized weights")
    quant_kernels = built or (quant.QuantKernels(kernels) if quantized else None)
    if llama is None:  # the family's model, and its image encoder if it takes images
        at_load = (quantized, config.quantization_group) if quantized in ("int8", "int4") else None
        loaded = families.load(path, dtype, dev, config.max_model_len, quant_kernels, gguf=quantized == "gguf",
                               quantize=at_load)
        llama, vision, image_params = loaded.model, loaded.vision, loaded.image_params
    if quantized in ("int8", "int4"):  # a model that knows which of its weights to quantize says so
        quantize = getattr(llama, "quantize_weights", None) or partial(quantize_linears, llama)
        quantize(quantized, config.quantization_group, quant_kernels)
    return LoadedModel(llama, vision, image_params, dtype, quantized, kernels)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: Device, llama: Llama | None = None,
                 vision: VisionEncoder | None = None, image_params: ImageProcessorParams | None = None) -> None:
        """``llama`` (and ``vision``, ``image_params``): an already-built model (tests); else
        ``config.model`` is loaded, with its vision encoder if it is a vision-language model."""
        self.device = device
        dev = device.torch_device
        page_size, max_rows = config.page_size, config.max_batch
        loaded = load_model(config, device, llama, vision, image_params)
        llama, vision, image_params, kernels = loaded.model, loaded.vision, loaded.image_params, loaded.kernels
        quantized, self.dtype = loaded.quantized, loaded.dtype
        self.model = llama.eval()
        self.config = llama.config
        if config.prepack:  # before LoRA wraps the linears (it calls them, packed or not)
            pack_linears(self.model, kernels)
        if isinstance(llama, Llama):
            llama.cpu_kernels = kernels
        self.kv_dtype = kv_cache_dtype(self.dtype, quantized is not None,
                                       isinstance(llama, Llama) and llama.cpu_kernels is not None)
        # Moondream: its region heads and per-row skill state (moondream_skills.py); None otherwise.
        self.moondream = llama if isinstance(llama, Moondream) else None
        self.skills = SkillRows(max_rows + 1, dev) if self.moondream is not None else None
        # The image family (image_prefill.ImageFamily): Moondream encodes its own images; None: a text-only model.
        self.vision = vision if vision is not None else self.moondream
        self.image_params = image_params
        # LoRA: wraps the targeted linear layers (before any graph is captured).
        self.lora = LoraPool(self.model, config.loras, config.max_loras, config.lora_kernel) if config.loras else None
        # the model's limit, as far as its rope tables reach (a model built for tests may cover fewer positions)
        model_limit = min(self.config.max_position_embeddings, llama.max_model_len)
        self.max_model_len, self.context_reason = context_length(config.max_model_len, model_limit, None)
        self.page_size = page_size
        self.max_rows = max_rows
        self.debug = config.debug
        self.vocab_size = self.config.vocab_size
        self.mask_words = ceil_div(self.vocab_size, 32)  # int32 words of one token bitmask
        self.eos_ids = model_eos_ids(config)
        if len(self.eos_ids) > MAX_EOS_IDS:
            raise ValueError(f"the model has {len(self.eos_ids)} EOS ids; at most {MAX_EOS_IDS} are supported")
        kv_pages = config.kv_pages
        per_page = PagedKVCache.page_bytes(self.config.num_hidden_layers, page_size,
                                           self.config.num_key_value_heads, self.config.head_dim, self.kv_dtype)
        if kv_pages is None:
            if device.is_cuda:
                free, _total = torch.cuda.mem_get_info(dev)
                kv_pages = int(free * config.kv_memory_fraction // per_page)
            else:
                # Enough for every row at full length, capped at 2 GiB of host memory.
                want = max_rows * ceil_div(self.max_model_len, page_size) + 1
                kv_pages = min(want, (2 << 30) // per_page)
        self.num_pages = max(2, int(kv_pages))
        # the tokens one sequence can hold (page 0 is the pool's scratch page)
        self.max_model_len, self.context_reason = context_length(config.max_model_len, model_limit,
                                                                 (self.num_pages - 1) * page_size)
        log.info("context: %d tokens (%s)", self.max_model_len, self.context_reason)
        # A model whose forward reads values back to the host (Moondream 3's expert counts) is never captured.
        self.use_graphs = config.cuda_graphs and device.is_cuda and getattr(self.model, "graph_capturable", True)
        if config.attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {config.attention!r} (one of {', '.join(ATTENTIONS)})")
        # a CUDA decode graph may read the pages in place (flex_paged.py): each kv head's pages together
        self.in_place = (self.use_graphs and config.attention == "auto" and isinstance(self.model, Llama)
                         and self.model.cpu_kernels is None)
        self.kv = PagedKVCache.from_config(self.config, self.num_pages, page_size, self.kv_dtype, dev,
                                           heads_major=self.in_place)
        self.max_pages_per_seq = ceil_div(self.max_model_len, page_size)
        # Row max_rows is a scratch row for padded graph rows; it always holds token 0.
        self.pending = torch.full((max_rows + 1,), POISON if self.debug else 0, dtype=torch.int64, device=dev)
        self.pending[max_rows] = 0
        self.params = RowParams(max_rows + 1, self.vocab_size, dev, self.max_model_len)
        # On a CPU, numpy views of the pending tokens and the rows' stop ids (sampler.greedy_on_host)
        self.pending_on_host = None if self.device.is_cuda else self.pending.numpy()
        self.stop_ids_on_host = None if self.device.is_cuda else self.params.stop_ids.numpy()
        # Host copy of every row's page table, written at admission, so a decode
        # step's metadata is a few vectorised numpy indexing ops, not a rebuild.
        self.block_tables = np.zeros((max_rows + 1, self.max_pages_per_seq), dtype=np.int64)
        self.step_buffers = [StepBuffers(device, max_rows) for _ in range(NUM_STEP_BUFFERS)]
        self.graphs: dict[tuple[int, int, int, str | None], "_DecodeGraph"] = {}
        self.graph_capture_s = 0.0  # wall time spent capturing them (warm-up and new buckets)
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    # -- rows -----------------------------------------------------------------
    def set_row(self, row: int, params, seed: int, pages: list[int], task=None, prompt_ids=()) -> None:
        """Admission: the row's page table (host) and sampling parameters (device, on the compute stream;
        ``prompt_ids`` for the repetition penalty); a Moondream row's skill task (``moondream_skills.SkillTask``)."""
        self.block_tables[row, :len(pages)] = pages
        self.block_tables[row, len(pages):] = 0
        self.device.compute.submit(lambda: self.params.set_row(row, params, seed, self.eos_ids, prompt_ids))
        if self.skills is not None:
            self.device.compute.submit(lambda: self.skills.set_row(row, task or SkillTask()))

    def copy_kv_rows(self, source: int, page: int, rows: int) -> None:
        """Admission: the first ``rows`` of KV page ``source`` (every layer) into ``page``, on the compute
        stream, so before the next forward (which may write ``source`` once it is evicted)."""
        def copy() -> None:
            for pool in (self.kv.k, self.kv.v):
                pool[:, page, :, :rows] = pool[:, source, :, :rows]  # [layers, pages, Hkv, page_size, D]
        self.device.compute.submit(copy)

    def load_lora(self, slot: int, name: str) -> None:
        """Write adapter ``name`` into LoRA slot ``slot``, after every step launched before."""
        self.device.compute.submit(lambda: self.lora.write(slot, name))

    def poison_row(self, row: int) -> None:
        if self.debug:
            self.device.compute.submit(lambda: self.pending.__setitem__(row, POISON))

    # -- host -> device ---------------------------------------------------------
    def _upload(self, arrays: list[np.ndarray], dtype=np.int64) -> list[torch.Tensor]:
        """One host-to-device copy for all of a launch's metadata (int64 unless told), from
        page-locked memory: a pageable copy would wait for the compute stream to drain."""
        if not self.device.is_cuda:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)) for a in arrays]
        sizes = [a.size for a in arrays]
        host = torch.from_numpy(np.concatenate([a.reshape(-1).astype(dtype) for a in arrays])).pin_memory()
        flat = host.to(self.device.torch_device, non_blocking=True)
        return [t.view(a.shape) for t, a in zip(flat.split(sizes), arrays)]

    # -- forward ----------------------------------------------------------------
    def enqueue_forward(self, buffer: int, inp: LaunchInputs) -> None:
        """Enqueue the forward; its logits land in ``self.step_buffers[buffer].logits``."""
        num_decode = len(inp.decode_rows)
        if len(inp.prefill_ids) == 0:  # pure decode: vectorised metadata, maybe a CUDA graph
            pages = int(inp.decode_pos.max()) // self.page_size + 1
            graph = self._graph_for(buffer, num_decode, pages)
            rows, pos = inp.decode_rows, inp.decode_pos
            if graph is not None:
                rows = np.concatenate([rows, np.full(graph.batch_size - num_decode, self.max_rows)])
                pos = np.concatenate([pos, np.zeros(graph.batch_size - num_decode, dtype=np.int64)])
                pages = graph.num_pages
            fields = [*self._decode_metadata(rows, pos, pages), rows]
            if graph is None:
                fields += [inp.prefill_ids, np.arange(num_decode)]
        else:
            graph = None
            chunks = [(int(p), 1, self.block_tables[r]) for r, p in zip(inp.decode_rows, inp.decode_pos)]
            b = Batch.build(chunks + inp.prefill_chunks, self.page_size, device="cpu")
            fields = [b.positions.numpy(), b.kv_index.numpy(), b.block_tables.numpy(), b.query_index.numpy(),
                      b.query_pos.numpy(), b.token_to_padded.numpy(), inp.decode_rows, inp.prefill_ids,
                      inp.logits_index]
            if inp.image_segments:
                fields.append(inp.image_index)
        lora = self._lora_slots(inp, graph)
        if lora is not None:
            fields.append(lora)  # last: popped after the upload
        buf = self.step_buffers[buffer]

        def run() -> None:
            t0 = time.perf_counter()
            with torch.inference_mode():
                if inp.encode:
                    self._encode(inp.encode)
                dev_fields = self._upload(fields)
                lora_slots = dev_fields.pop() if lora is not None else None
                if graph is not None:
                    logits, hidden = graph.replay(Batch(*dev_fields[:6]), dev_fields[6], lora_slots)
                    buf.logits = logits[:num_decode]
                    buf.hidden = hidden[:num_decode] if hidden is not None else None
                else:
                    batch = Batch(*dev_fields[:6])
                    rows, prefill_ids, logits_index = dev_fields[6:9]
                    ids = torch.cat([self.gather_pending(rows), prefill_ids])
                    image = None
                    if inp.image_segments:
                        features = torch.cat([h.features[a:b] for h, a, b in inp.image_segments])
                        image = (dev_fields[9], features)
                    if self.lora is not None:
                        self.lora.token_slots = lora_slots
                    buf.logits, buf.hidden = self._forward(ids, rows, batch, logits_index, image, inp)
            self.device.pad_forward(t0)

        self.device.compute.submit(run)

    def _forward(self, ids, rows, batch, logits_index, image=None, inp: LaunchInputs | None = None):
        """The text forward -> (logits, Moondream's hidden states or None). A Moondream decode row's
        input embeds its pending region values (branch-free); prefill tokens take the launch's."""
        if self.moondream is None:
            return self.model(ids, batch, self.kv, logits_index, image_features=image), None
        n_prefill = ids.shape[0] - rows.shape[0]
        coord, size = self.skills.coord[rows], self.skills.size[rows]
        if n_prefill:
            if inp is None or inp.prefill_coord is None:
                pc, ps = torch.zeros(n_prefill, device=ids.device), torch.zeros(n_prefill, 2, device=ids.device)
            else:  # spatial refs: the engine sets both
                pc, ps = self._upload([inp.prefill_coord, inp.prefill_size], np.float32)
            coord, size = torch.cat([coord, pc]), torch.cat([size, ps])
        return self.model(ids, batch, self.kv, logits_index, image, coord, size)

    def _encode(self, runs: list) -> None:
        """Compute-stream work: encode a launch's runs of encode units (one call of the vision
        family for all of them) and write each run's rows into its image's features."""
        dev = self.device.torch_device
        on_device = [([torch.from_numpy(t).to(dev, non_blocking=True) for t in blocks], tiling)
                     for blocks, _holder, _first, _rows, tiling in runs]
        encoded = self.vision.encode_runs(on_device, self.image_params, self.dtype)
        for (_, holder, first, rows, _), features in zip(runs, encoded):
            if holder.features is None:  # the image's first units: its own storage, so evicting it frees it
                holder.features = features.new_empty((rows, features.shape[1]))
            holder.features[first:first + len(features)] = features

    @property
    def feature_row_bytes(self) -> int:
        """Device bytes of one image feature row."""
        return self.config.hidden_size * self.dtype.itemsize

    def _lora_slots(self, inp: LaunchInputs, graph: "_DecodeGraph | None") -> np.ndarray | None:
        """Each token row's LoRA slot; None when the forward skips LoRA (no adapter in an eager launch).
        A graph with LoRA layers always reads one slot per row (0 for padding and rows without one)."""
        if graph is None or self.lora is None:
            return inp.token_lora
        lora = np.zeros(graph.batch_size, dtype=np.int64)
        if inp.token_lora is not None:
            lora[:len(inp.token_lora)] = inp.token_lora
        return lora

    def _decode_metadata(self, rows: np.ndarray, pos: np.ndarray, pages: int) -> list[np.ndarray]:
        """Batch fields (positions .. token_to_padded) for one token per row: Qmax == 1, T == S."""
        tables = self.block_tables[rows, :pages]
        n = len(rows)
        kv_index = tables[np.arange(n), pos // self.page_size] * self.page_size + pos % self.page_size
        index = np.arange(n)
        return [pos, kv_index, tables, index[:, None], pos[:, None], index]

    def gather_pending(self, rows: torch.Tensor) -> torch.Tensor:
        ids = self.pending[rows]
        if self.debug:
            if self.device.is_cuda:
                torch._assert_async((ids >= 0).all(), "gather of an unwritten pending token")
            elif rows.numel() and bool((ids < 0).any()):
                raise RuntimeError(f"gather of an unwritten pending token (rows {rows.tolist()})")
            self.pending[rows] = POISON  # consumed: a second gather before the next sample fails
        return ids

    # -- sampling -----------------------------------------------------------------
    def enqueue_sample(self, buffer: int, inp: LaunchInputs, part: np.ndarray | None = None,
                       mask_words: np.ndarray | None = None) -> None:
        """Enqueue sampling of some of the step's rows (``part``: indices into the
        sampling rows; None = all), with ``mask_words`` (one bitmask per row of
        ``part``) if they are constrained. A step may sample in several parts, so
        unconstrained rows are sampled before the host waits for any mask.
        """
        buf = self.step_buffers[buffer]
        num = len(inp.sample_rows)
        meta = [inp.sample_rows, inp.sample_pos] + ([part] if part is not None else [])
        masks = None
        if mask_words is not None:
            masks = torch.from_numpy(mask_words)
            if self.device.is_cuda:
                masks = masks.pin_memory()  # an async upload: never a host stall behind the forward
        on_host = self.pending_on_host is not None and part is None and masks is None and self.skills is None \
            and not (inp.any_random or inp.any_filter or inp.want_logprobs or inp.want_top or inp.any_bias
                     or inp.any_penalty or inp.any_min_tokens)

        def run() -> None:
            if on_host and buf.logits.dtype == torch.float32:  # plain greedy on a CPU: sample()'s result in numpy
                tokens, flags = greedy_on_host(buf.logits.numpy(), inp.sample_rows, self.stop_ids_on_host)
                self.pending_on_host[inp.sample_rows] = tokens
                buf.out = (torch.from_numpy(tokens), torch.from_numpy(flags), None, None, None, None)
                return
            dev_meta = self._upload(meta)
            rows, pos = dev_meta[0], dev_meta[1]
            with torch.inference_mode():
                logits, idx = buf.logits, None
                hidden = buf.hidden
                if buf.out is None:  # the step's first part: full-size outputs
                    buf.out = (torch.empty(num, dtype=torch.int64, device=logits.device),
                               torch.empty(num, dtype=torch.int32, device=logits.device),
                               torch.empty(num, dtype=torch.float32, device=logits.device),
                               torch.zeros(num, VALUES, dtype=torch.float32, device=logits.device),
                               torch.empty(num, MAX_TOP_LOGPROBS, dtype=torch.int32, device=logits.device),
                               torch.empty(num, MAX_TOP_LOGPROBS, dtype=torch.float32, device=logits.device))
                if part is not None:
                    idx = dev_meta[2]
                    logits, rows, pos = logits[idx], rows[idx], pos[idx]
                    hidden = hidden[idx] if hidden is not None else None
                if masks is not None:
                    logits = apply_bitmask(logits, masks.to(logits.device, non_blocking=True))
                if self.skills is not None:
                    logits = self.skills.suppress(logits, rows)
                tokens, flags, logprobs, top = sample(logits, rows, pos, self.params, inp.any_random, inp.any_filter,
                                                      inp.want_logprobs, inp.any_bias, inp.any_penalty, inp.want_top,
                                                      inp.any_min_tokens, inp.seen_width)
                values = None
                if self.skills is not None:  # the phase decides what is emitted; values stay on the device
                    tokens, flags, values = self.skills.advance(self.moondream, hidden, rows, tokens, flags)
                self.pending.index_copy_(0, rows, tokens)
                if inp.any_penalty:  # before the next step's sampling, in either mode (sampler.py)
                    self.params.count(rows, tokens)
                sampled = (tokens, flags, logprobs, values, *(top or (None, None)))
                for out, got in zip(buf.out, sampled):  # tokens, flags, logprobs, values, top (None unless asked)
                    if got is not None:
                        out.copy_(got) if idx is None else out.index_copy_(0, idx, got)

        self.device.compute.submit(run)

    def enqueue_copy(self, buffer: int, inp: LaunchInputs, dest: np.ndarray | None = None):
        """After the step's sampling parts: copy the sampled ids (and flags, logprobs)
        to the step buffer's page-locked arrays, and the ids to ``dest[:rows]`` (an int32 host
        array such as a token-ring entry) if given, on the copy stream. Returns the
        copy-done event: the only thing the commit waits on."""
        buf = self.step_buffers[buffer]
        num = len(inp.sample_rows)
        want_lp, want_top = inp.want_logprobs or inp.want_top, inp.want_top

        def release() -> None:
            tokens, flags, logprobs, values, top_ids, top_logprobs = buf.out
            buf.keep = [tokens, flags, logprobs if want_lp else None,
                        tokens.to(torch.int32) if dest is not None else None,
                        values if self.skills is not None else None,
                        (top_ids, top_logprobs) if want_top else None]
            buf.out = None
            buf.logits = buf.hidden = None

        self.device.compute.submit(release)
        self.device.copy.wait(self.device.compute.record())  # after sampling and release()

        def copy() -> None:
            tokens, flags, logprobs, tokens32, values, top = buf.keep
            if dest is not None:
                torch.from_numpy(dest[:num]).copy_(tokens32, non_blocking=True)
            buf.tokens[:num].copy_(tokens, non_blocking=True)
            buf.flags[:num].copy_(flags, non_blocking=True)
            if logprobs is not None:
                buf.logprobs[:num].copy_(logprobs, non_blocking=True)
            if values is not None:
                buf.values[:num].copy_(values, non_blocking=True)
            if top is not None:
                buf.top_ids[:num].copy_(top[0], non_blocking=True)
                buf.top_logprobs[:num].copy_(top[1], non_blocking=True)

        self.device.copy.submit(copy)
        return self.device.copy.record()

    def read_step(self, buffer: int, num: int, top: bool = False) -> tuple:
        """The committed step's sampled ids, flags, logprobs, Moondream's region values [num, 3]
        (None for other models) and, with ``top``, the most likely (ids, logprobs) [num, K] (else None),
        after the copy event."""
        buf = self.step_buffers[buffer]
        buf.keep = []
        values = buf.values[:num].numpy().copy() if self.skills is not None else None
        top_out = (buf.top_ids[:num].numpy().copy(), buf.top_logprobs[:num].numpy().copy()) if top else None
        return (buf.tokens[:num].numpy().copy(), buf.flags[:num].numpy().copy(), buf.logprobs[:num].numpy().copy(),
                values, top_out)

    # -- CUDA graphs ----------------------------------------------------------------
    def _graph_for(self, buffer: int, batch: int, pages: int) -> "_DecodeGraph | None":
        if not self.use_graphs:
            return None
        b = _bucket(batch, tuple(x for x in BATCH_BUCKETS if x <= self.max_rows) + (self.max_rows,))
        p = _bucket(pages, tuple(sorted({min(1 << i, self.max_pages_per_seq) for i in range(3, 16)})))
        if b is None or p is None:
            return None
        # The LoRA kernel is Python control flow, frozen into a graph when it is captured.
        key = (buffer, b, p, self.lora.kernel if self.lora is not None else None)
        if key not in self.graphs:
            t0 = time.perf_counter()
            self.graphs[key] = _DecodeGraph(self, b, p, self._graph_pool)
            took = time.perf_counter() - t0
            self.graph_capture_s += took
            log.info("captured decode graph buffer=%d batch=%d pages=%d (KV pages %s) in %.0f ms", buffer, b, p,
                     "read in place" if self.graphs[key].in_place else "gathered", took * 1e3)
        return self.graphs[key]

    def warmup(self, batch_sizes=(1, 8, 32), pages=(8, 16), progress=None) -> None:
        """Capture the common decode graphs before serving; ``progress(done, total)`` after each."""
        if not self.use_graphs:
            return
        todo = [(buffer, b, min(p, self.max_pages_per_seq))
                for buffer in range(NUM_STEP_BUFFERS) for b in batch_sizes if b <= self.max_rows for p in pages]
        for i, key in enumerate(todo):
            self._graph_for(*key)
            if progress is not None:
                progress(i + 1, len(todo))


def _in_place_attention(runner: ModelRunner, forward, bucket: str):
    """The compiled FlexAttention for a decode graph about to be captured, if it runs here and gives
    the gather path's logits on the graph's warm-up inputs; else None (logged: the graph gathers; a
    kernel that does not compile or run is not tried again)."""
    model = runner.model
    reference = forward()[0].float()
    model.attention_in_place = flex_paged.compiled_flex_attention()
    t0 = time.perf_counter()
    try:
        logits = forward()[0].float()  # (compiles FlexAttention for a new batch size)
        gap = float((logits - reference).abs().max())
        why = None if torch.allclose(logits, reference, rtol=1e-2, atol=1e-2) else \
            f"its logits differ from the gather path's by up to {gap:.3g}"
    except Exception as e:  # noqa: BLE001 - a kernel this GPU or torch build cannot compile or run
        why, runner.in_place = f"{type(e).__name__}: {e}", False
    attention, model.attention_in_place = model.attention_in_place, None
    if why is not None:
        log.warning("decode graph %s: the gather path (FlexAttention in place: %s)", bucket, why)
        return None
    log.info("decode graph %s: the KV pages read in place (FlexAttention; first call %.1f s)", bucket,
             time.perf_counter() - t0)
    return attention


class _DecodeGraph:
    """A captured decode forward for a fixed (batch bucket, page bucket)."""

    def __init__(self, runner: ModelRunner, batch_size: int, num_pages: int, pool) -> None:
        self.batch_size, self.num_pages = batch_size, num_pages
        dev = runner.device.torch_device
        chunks = [(0, 1, [0] * num_pages)] * batch_size
        self.batch = Batch.build(chunks, runner.page_size, device=dev, num_pages_per_seq=num_pages)
        self.rows = torch.full((batch_size,), runner.max_rows, dtype=torch.int64, device=dev)
        self.logits_index = torch.arange(batch_size, device=dev)
        # LoRA: the graph reads each row's slot from this static buffer (0: no adapter).
        self.lora_slots = torch.zeros(batch_size, dtype=torch.int64, device=dev)
        if runner.lora is not None:
            runner.lora.token_slots = self.lora_slots
        bucket = f"batch={batch_size} pages={num_pages}"

        def forward():
            return runner._forward(runner.pending[self.rows], self.rows, self.batch, self.logits_index)

        # Capture is rare (warm-up, or a new bucket): quiesce the device, warm up on a
        # side stream (lazy inits, the in-place attention's compile), then capture on
        # torch's private capture stream.
        torch.cuda.synchronize(dev)
        side = torch.cuda.Stream(dev)
        model = runner.model
        with torch.inference_mode(), torch.cuda.stream(side):
            if runner.in_place:
                model.attention_in_place = _in_place_attention(runner, forward, bucket)
            for _ in range(2):
                forward()
        side.synchronize()
        self.in_place = model.attention_in_place is not None  # reads the KV pages in place (else gathers them)
        try:
            self._capture(forward, pool)
        except Exception as e:  # noqa: BLE001 - the in-place attention cannot be captured here: gather
            if model.attention_in_place is None:
                raise
            log.warning("decode graph %s: the gather path (capturing FlexAttention in place failed: %s: %s)",
                        bucket, type(e).__name__, e)
            model.attention_in_place, self.in_place = None, False
            torch.cuda.synchronize(dev)
            self._capture(forward, pool)
        finally:
            model.attention_in_place = None  # the eager forwards (prefill) keep the gather path
        if runner.lora is not None:
            runner.lora.token_slots = None


    def _capture(self, forward, pool) -> None:
        with torch.inference_mode():
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.out = forward()

    def replay(self, batch: Batch, rows: torch.Tensor, lora_slots: torch.Tensor | None = None) -> tuple:
        """-> (logits, hidden or None), the graph's static outputs."""
        self.batch.copy_from(batch)
        self.rows.copy_(rows)
        if lora_slots is not None:
            self.lora_slots.copy_(lora_slots)
        self.graph.replay()
        return self.out
