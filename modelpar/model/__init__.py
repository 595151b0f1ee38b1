"""Decoder-only transformers (GPT-2 or Llama style) built from the tensor-parallel layers (§3.4, §6).

``ModelConfig`` is the shape; ``build_stage(cfg, stage, num_stages, group=...)`` builds one rank's
pipeline stage with its tensor-parallel shards, initialised like the single-process model;
``LMLoss`` is the last stage's loss.
"""

from modelpar.model.config import ARCHS, VOCAB_MULTIPLE, ModelConfig
from modelpar.model.init import build_stage, global_name, init_parameters
from modelpar.model.transformer import LMLoss, TokenEmbedding, Transformer, layers_of_stage, split_stage

__all__ = ["ARCHS", "VOCAB_MULTIPLE", "LMLoss", "ModelConfig", "TokenEmbedding", "Transformer", "build_stage",
           "global_name", "init_parameters", "layers_of_stage", "split_stage"]
