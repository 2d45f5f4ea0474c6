"""A small Llama-3.2-Vision-style captioner on generated 32x32 scenes (CPU, no downloads).

Model: the text decoder `llama` (position='rope', num_layers=4, d_model=64, num_kv_heads=2,
  activation='swiglu'); the tiled ViT beside it from the recipe's settings

Command:   python -m experiments.captioning.train --config=experiments/captioning/configs/tiny.py[:VARIANT] --workdir=DIR
Variants:  ""          every parameter trained from scratch, images shown;
           "text_only" the baseline: the same model and captions, never an image;
           "llama32"   Llama 3.2's recipe: the text decoder comes from the text_only run in
                       /tmp/tfm_caption_text (--config.init_from=DIR to use another) and stays
                       frozen; the image encoder, projector and cross-attention layers train.
           Any of them may add ",runlocal" (e.g. `tiny.py:text_only,runlocal`), as other experiments'
           CPU runs are named: this recipe is CPU-sized already, so it changes nothing.
Hardware:  one CPU (2 shared cores); a few minutes per variant.
Expected:  see experiments/captioning/README.md (measured held-out scores of all three).
"""
from experiments import common
from experiments.captioning import scenes
from experiments.captioning.settings import CaptionSettings
from tfm.train import ImageTextTask

CROSS_ATTENTION_LAYERS = (1, 3)
VISION = dict(vocab_size=1, d_model=64, num_heads=4, num_layers=2, d_ff=128, norm_eps=1e-5, final_norm=False,
              position="none", activation="gelu", attention_bias=False, image_size=scenes.SIZE, patch_size=8,
              multimodal=dict(max_num_tiles=1, max_aspect_ratio_id=1, num_global_layers=1, intermediate_layers=(0,)))
TEXT = dict(d_model=64, num_heads=4, num_kv_heads=2, num_layers=4, d_ff=128, max_len=16,
            multimodal=dict(cross_attention_layers=CROSS_ATTENTION_LAYERS, vision=VISION))
# Llama 3.2: every text parameter outside the cross-attention layers keeps its pretrained value.
FROZEN_TEXT = "text/(?!decoder/layer_(" + "|".join(map(str, CROSS_ATTENTION_LAYERS)) + ")/)"
VARIANTS = ("", "text_only", "llama32")


def get_config(arg: str = ""):
    variant = ",".join(part for part in arg.split(",") if part != "runlocal")
    if variant not in VARIANTS:
        raise ValueError(f"captioning config variant {variant!r} unknown; choose from {VARIANTS} (each may add ',runlocal')")
    c = common.new_config(CaptionSettings, ImageTextTask)
    c.model.preset = "llama"
    c.model.overrides = TEXT
    c.train_scenes = 20_000
    c.eval_scenes = 256
    c.use_images = variant != "text_only"
    c.batch_size = 32
    c.num_train_steps = 1500
    c.optimizer.update(name="adamw", learning_rate=2e-3, warmup_steps=50, schedule="cosine", weight_decay=0.01)
    c.log_every = 100
    c.eval_every = 500
    c.checkpoint_every = 500
    if variant == "llama32":
        c.init_from = "/tmp/tfm_caption_text"
        c.optimizer.frozen = FROZEN_TEXT
    return c
