"""An offline chat tokenizer for the agent-loop tests and the tiny vision-language model: byte-level,
one token per byte, ChatML turns (``<|im_start|>role ... <|im_end|>``) and hermes-style tool calls
(``<tool_call>{json}</tool_call>``, tool results as ``<tool_response>`` blocks in a user turn), the format
verl's ``hermes`` tool parser reads (``verl/experimental/agent_loop/tool_parser.py``). The chat template
is written here; no hub download, no model's own template."""

from __future__ import annotations

import json
from pathlib import Path

#: ChatML with a tools preamble and hermes tool calls / responses; a message whose content is a list of
#: parts renders image and video parts as Qwen2-VL's placeholder runs.
CHAT_TEMPLATE = (
    "{%- macro render(c) -%}{%- if c is string -%}{{ c }}{%- else -%}{%- for p in c -%}"
    "{%- if p.type == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif p.type == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else -%}{{ p.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\nTools you may call, one JSON object each inside <tool_call></tool_call>:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{{ '<|im_start|>assistant' }}{%- if m.content -%}{{ '\\n' + m.content }}{%- endif -%}"
    "{%- for call in m.tool_calls -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}{{ render(m.content) }}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"]


def build_chat_tokenizer(extra_special=()):
    """A ``PreTrainedTokenizerFast``: 256 byte tokens (ids 0..255) then :data:`SPECIAL` (ids 256..262),
    then ``extra_special`` in order (ids 263...); eos ``<|im_end|>``, pad ``<|endoftext|>``, chat
    template :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    extra = [t for t in SPECIAL if t not in ("<|im_end|>", "<|endoftext|>")] + list(extra_special)
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.chat_template = CHAT_TEMPLATE
    return tok


#: The shape of :func:`build_chat_model_dir`'s model with weights (Qwen2 architecture, head_dim 64).
TOOLS_MODEL_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2}


def build_chat_model_dir(folder, with_weights: bool = False, seed: int = 0, init_std: float = 0.15) -> str:
    """A Qwen2-architecture model folder with the tokenizer of :func:`build_chat_tokenizer`, the folder
    verl's ``HFModelConfig`` reads for ``actor_rollout_ref.model.path``.

    Args:
        folder: where to write it.
        with_weights: False: ``config.json`` of a 1-layer model and no weights (for engine doubles).
            True: a :data:`TOOLS_MODEL_SHAPE` model (~1.5 M parameters, bf16 ``model.safetensors``) with
            random weights (:func:`.models.redraw` from ``seed``; ``init_std`` 0.15 makes greedy
            decoding's choices clear, not near-ties), what ``bench verl --task tools`` runs on both
            sides so that their tokens can be compared.

    Returns:
        the folder, as a string.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_chat_tokenizer()
    tok.save_pretrained(folder)
    shape = TOOLS_MODEL_SHAPE if with_weights else {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                                    "num_attention_heads": 4, "num_key_value_heads": 2}
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": len(tok), **shape,
              "max_position_embeddings": 8192, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
              "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if with_weights:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from .models import redraw

        model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "architectures"}))
        redraw(model, seed, init_std)
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(folder)
