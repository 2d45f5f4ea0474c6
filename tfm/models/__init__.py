"""The model families (encoder, decoder-only, encoder-decoder, vision encoders, vision-language), all built from
`tfm.layers.block.Block`."""
from tfm.models.decoder import DecoderLM
from tfm.models.encoder import EncoderModel
from tfm.models.encoder_decoder import EncoderDecoder
from tfm.models.outputs import EncoderOutput, LMOutput, Unembedding, VisionOutput
from tfm.models.vision import TiledVisionEncoder, VisionEncoder
from tfm.models.vision_language import VisionLanguageModel

__all__ = ["DecoderLM", "EncoderModel", "EncoderDecoder", "VisionEncoder", "TiledVisionEncoder", "VisionLanguageModel",
           "LMOutput", "EncoderOutput", "VisionOutput", "Unembedding"]
