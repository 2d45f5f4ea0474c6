"""The three families, all built from `tfm.layers.block.Block`."""
from tfm.models.decoder import DecoderLM
from tfm.models.encoder import EncoderModel
from tfm.models.encoder_decoder import EncoderDecoder

__all__ = ["DecoderLM", "EncoderModel", "EncoderDecoder"]
