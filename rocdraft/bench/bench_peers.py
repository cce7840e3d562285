"""The transformers peer of ``rocdraft bench --compare-hf``: greedy ``generate`` and prompt
lookup on the same target directory (transformers is imported only when a peer is built)."""
from __future__ import annotations

PROMPT_LOOKUP_TOKENS = 4  # transformers' prompt_lookup_num_tokens (no draft model)


class HFPeer:
    """transformers on the same target: greedy ``generate`` and prompt lookup."""

    def __init__(self, target: str, dtype: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            target, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        pad = self.model.generation_config.pad_token_id
        self.pad_token_id = pad if isinstance(pad, int) else 0

    def generate(self, batch: list[list[int]], max_new_tokens: int,
                 prompt_lookup: bool = False) -> list[list[int]]:
        """batch: prompt token ids (left-padded here) -> the new token ids of each."""
        torch = self.torch
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids
                                  for ids in batch], device=self.device)  # [batch, width]
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch],
                            device=self.device)
        extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS} if prompt_lookup else {}
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=max_new_tokens, eos_token_id=None,
                                      pad_token_id=self.pad_token_id, **extra)
        return [row[width:].tolist() for row in out]
