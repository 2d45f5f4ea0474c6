"""The model families (encoder, decoder-only, encoder-decoder, vision encoder), all built from
`tfm.layers.block.Block`."""
from tfm.models.decoder import DecoderLM
from tfm.models.encoder import EncoderModel
from tfm.models.encoder_decoder import EncoderDecoder
from tfm.models.outputs import EncoderOutput, LMOutput, Unembedding, VisionOutput
from tfm.models.vision import VisionEncoder

__all__ = ["DecoderLM", "EncoderModel", "EncoderDecoder", "VisionEncoder", "LMOutput", "EncoderOutput",
           "VisionOutput", "Unembedding"]
