"""Seeded random `transformers` models for the oracle tests (shared by test/runtime's text checkpoints and the
multimodal ones in hf_vision.py)."""
import torch


def random_model(model_class, config, seed: int = 0):
    """``model_class(config)`` seeded, in fp32, eval mode, with every 1-D weight (RMSNorm scales, ``A_log``,
    ``dt_bias``) moved off its neutral value, so a wrong norm convention or decay formula shows up in the logits."""
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param) if not name.endswith("A_log") else torch.rand_like(param))
    return model
