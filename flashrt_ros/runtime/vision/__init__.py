"""The vision tower of Qwen3.5/3.6 (``model.visual.*``): its configuration, image preprocessing and encoder."""


def ingest_length(items) -> int:
    """Stream positions checked ingest items take (see ``layout.ingest_length``; imported here on first use, so the
    configuration stays importable without torch)."""
    from .layout import ingest_length as length
    return length(items)
