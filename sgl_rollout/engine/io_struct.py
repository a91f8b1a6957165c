"""SGLang's request objects, made in one place (tests stand plain namespaces in for them on machines
where SGLang's serving stack does not import)."""

from __future__ import annotations

from typing import Any


def make(cls_name: str, **fields: Any) -> Any:
    """An SGLang request object of ``sglang/srt/managers/io_struct.py`` (``cls_name``, e.g.
    ``"ReleaseMemoryOccupationReqInput"``) with ``fields``, for the tokenizer manager's coroutines.

    Raises:
        ImportError: SGLang's io_struct does not import here.
        AttributeError: this SGLang has no such request class.
    """
    from sglang.srt.managers import io_struct

    return getattr(io_struct, cls_name)(**fields)
