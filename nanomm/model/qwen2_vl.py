"""Qwen2-VL = vision tower + projector, the Qwen2 language model, and the glue between them.

Lessons: lessons/02-vision-encoder.md (images -> visual tokens), lessons/03-mrope.md (positions).

Qwen2.5-VL is the same model with another vision tower (vision_windowed.py: window attention, RMSNorm, SwiGLU);
its language model, its positions and its glue are Qwen2-VL's, so `config.model_type` only picks the tower.

The glue is two things: visual tokens replace the embeddings of the expanded <|image_pad|> tokens, in
order, and positions are M-RoPE (3, tokens) ids computed by `rope.mrope_positions`.

The same class holds a text-only Qwen2 checkpoint (a draft model for speculative decoding): `visual` is None,
`encode_images` refuses, and positions are `rope.text_positions` (equal rows: 1-D RoPE).
"""

import torch
from torch import nn

from nanomm.model.attention import AttentionBackend
from nanomm.model.config import ModelConfig
from nanomm.model.qwen2 import DeepStack, Qwen2Model, visual_rows
from nanomm.model.rope import mrope_cos_sin
from nanomm.model.vision import VisionTransformer
from nanomm.model.vision_deepstack import DeepStackVisionTransformer
from nanomm.model.vision_windowed import WindowedVisionTransformer

VISION_TOWERS = {"qwen2_vl": VisionTransformer, "qwen2_5_vl": WindowedVisionTransformer,  # by config.model_type
                 "qwen3_vl": DeepStackVisionTransformer}


class Qwen2VL(nn.Module):
    def __init__(self, config: ModelConfig, name_or_path: str = "qwen2-vl"):
        super().__init__()
        self.config = config
        self.name_or_path = name_or_path  # the folder or hub id it was loaded from: names it in cache keys and errors
        self.visual = VISION_TOWERS[config.model_type](config.vision) if config.has_vision else None
        self.language_model = Qwen2Model(config.text)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        self.tie_weights()

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    def encode_images(self, pixel_values: torch.Tensor, image_grids, received_attention: bool = False):
        """Patches of several images (num_patches, 1176) -> one (tokens_i, hidden) tensor per image (and, with
        received_attention, the attention each token receives in the tower's last layer: `VisionTransformer`)."""
        if self.visual is None:
            raise ValueError(f"{self.name_or_path} is a text-only Qwen2 model (no vision tower): "
                             "it cannot encode images")
        return self.visual(pixel_values, [tuple(g) for g in image_grids], received_attention)

    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None,
              image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings (tokens, hidden); the rows where image_mask is True become the visual tokens, in order.

        The mask is explicit, not `input_ids == image_token_id`: a model may *generate* an <|image_pad|> id,
        and that token is text (it has no picture behind it), as it is in transformers.
        """
        x = self.language_model.embed_tokens(input_ids)
        if image_embeds is None:
            return x
        if image_mask is None:
            raise ValueError(f"{image_embeds.shape[0]} visual tokens need a mask saying where they go")
        # Checked on the device, without the host waiting for the answer (a GPU step never reads a value back)
        torch._assert_async(image_mask.sum() == image_embeds.shape[0],
                            f"{image_embeds.shape[0]} visual tokens need a mask with as many True rows")
        return torch.where(image_mask[:, None], visual_rows(image_embeds.to(x.dtype), image_mask), x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend,
                image_embeds: torch.Tensor | None = None, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (tokens,), positions (3, tokens) -> final hidden states (tokens, hidden).

        image_embeds: (image tokens, hidden), or for a DeepStack model (1 + levels, image tokens, hidden): level 0
        replaces the embeddings, level i is added after decoder layer i - 1."""
        deepstack = None
        if image_embeds is not None and image_embeds.dim() == 3:
            image_embeds, deepstack = image_embeds[0], DeepStack(image_embeds[1:], image_mask)
        x = self.embed(input_ids, image_embeds, image_mask)
        t = self.config.text
        cos, sin = mrope_cos_sin(positions, t.head_dim, t.rope_theta, t.mrope_section, x.dtype, t.mrope_interleaved)
        return self.language_model(x, cos, sin, attention, deepstack)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the rows given (only the positions that sample: the head is the widest matmul)."""
        return self.lm_head(hidden).float()
