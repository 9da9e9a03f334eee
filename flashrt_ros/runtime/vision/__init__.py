"""The vision tower of Qwen3.5/3.6 (``model.visual.*``): its configuration, image preprocessing and encoder."""
